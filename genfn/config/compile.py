"""CompileConfig: how the driver ``torch.compile``\\ s the decode step (transformers' fields and defaults)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .checks import check_bool, check_mapping, check_no_unknown_keys, check_optional_bool, type_error, value_error

__all__ = ["CompileConfig"]

_COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class CompileConfig:
    """How the driver ``torch.compile``\\ s the decode step (transformers' fields and defaults).

    ``fullgraph``: refuse graph breaks. ``dynamic``: dynamic-shape graphs (None lets torch decide).
    ``backend``: a backend name or callable. ``mode``: a ``torch.compile`` mode
    (``"reduce-overhead"`` = CUDA graphs). ``options``: backend options; torch refuses ``mode``
    and ``options`` together, so pass ``mode=None`` with ``options``.
    """

    fullgraph: bool = False
    dynamic: bool | None = None
    backend: str | Callable[..., Any] = "inductor"
    mode: str | None = "reduce-overhead"
    options: dict[str, Any] | None = None

    # Class-level switch, not a field and never serialized (as in transformers): lets `generate`
    # compile on devices where it would not by default, e.g. CPU in tests.
    _compile_all_devices = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise TypeError/ValueError now for what ``torch.compile`` would reject later."""
        check_bool("fullgraph", self.fullgraph)
        check_optional_bool("dynamic", self.dynamic)
        if not ((isinstance(self.backend, str) and self.backend) or callable(self.backend)):
            type_error("backend", "a backend name (non-empty str) or a callable", self.backend)
        if self.mode is not None and not isinstance(self.mode, str):
            type_error("mode", f"one of {_COMPILE_MODES}", self.mode)
        if self.mode not in _COMPILE_MODES:
            value_error("mode", f"one of {_COMPILE_MODES}", self.mode)
        if self.options is not None:
            check_mapping("options", self.options)
            if self.mode is not None:
                raise ValueError(
                    f"`mode` ({self.mode!r}) and `options` cannot both be set: torch.compile accepts only one. "
                    "Pass mode=None together with options."
                )

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (the keyword arguments of ``torch.compile``)."""
        return {field.name: copy.deepcopy(getattr(self, field.name)) for field in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, config_dict: Mapping[str, Any]) -> CompileConfig:
        check_no_unknown_keys(cls, config_dict)
        return cls(**config_dict)
