"""ContinuousBatchingConfig: the settings of continuous batching, with transformers' fields."""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .checks import Interval, check_bool, check_no_unknown_keys, check_optional_bool, choice_check, int_check
from .checks import is_sequence, nested_check, optional, real_check, type_error
from .compile import CompileConfig

__all__ = ["ContinuousBatchingConfig", "GENFN_FIELDS"]

GENFN_FIELDS = ("chunked_prefill", "batch_invariant")  # fields transformers' ContinuousBatchingConfig does not have

logger = logging.getLogger(__name__)

_SCHEDULER_TYPES = ("fifo", "prefill_first")


@dataclass
class ContinuousBatchingConfig:
    """Settings of continuous batching (``generate_batch``, the batching manager): transformers' fields.

    Storage and validation only; what each knob does lives with the batching code. Memory
    related fields left as ``None`` are inferred at runtime from the device.

    genfn's own fields (after transformers'; ``GENFN_FIELDS``): ``chunked_prefill`` splits a
    prompt longer than the token budget across forwards (off: such a prompt fails); the manager's
    ``chunked_prefill=`` keyword, when given, overrides it. ``batch_invariant`` runs the forwards in
    the batch-invariant mode (``genfn.deterministic``; also on when the manager is built inside it).
    """

    page_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_memory_percent: float | None = None
    max_requests_per_batch: int | None = None
    max_blocks_per_request: int | None = None
    allow_block_sharing: bool = True
    use_async_batching: bool | None = None
    use_cuda_graph: bool | tuple[bool, bool] | None = None
    q_padding_interval_size: int = 0
    kv_padding_interval_size: int = 0
    varlen_compile_config: CompileConfig | None = None
    decode_compile_config: CompileConfig | None = None
    default_compile_level: int = 0
    scheduler_type: str = "fifo"
    safety_margin: float | None = None
    return_logprobs: bool = False
    seed: int | None = None
    auto_switch_to_flash: bool = True
    cpu_offload_space: float | None = 0.0
    cpu_offload_space_safety_threshold: float = 0.8
    max_queue_size: int = 0
    per_request_processors: bool = False
    drop_unsupported_processors: bool = True
    disable_nccl_graph_mixing: bool = True
    cpu_group_timeout: float | None = 300.0
    # Deprecated in transformers; still read so that old call sites keep working.
    use_default_compile_configs: bool | None = None
    max_cached_graphs: int | None = None
    block_size: int | None = None
    chunked_prefill: bool = True
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        for name in ("varlen_compile_config", "decode_compile_config"):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                setattr(self, name, CompileConfig.from_dict(value))
        self._apply_deprecated_fields()
        self.validate()

    def _apply_deprecated_fields(self) -> None:
        """Translate deprecated knobs into their replacements, logging a warning as transformers does."""
        if self.use_default_compile_configs is not None:
            check_bool("use_default_compile_configs", self.use_default_compile_configs)
            self.default_compile_level = 3 if self.use_default_compile_configs else 0
            logger.warning(
                "`use_default_compile_configs` is deprecated, use `default_compile_level` instead; "
                "setting default_compile_level=%d.",
                self.default_compile_level,
            )
        if self.max_cached_graphs is not None:
            logger.warning("`max_cached_graphs` is deprecated and has no effect.")
        if self.block_size is not None:
            int_check(minimum=4)("block_size", self.block_size)
            self.page_size = self.block_size
            logger.warning("`block_size` is deprecated, use `page_size` instead; using it as the page size.")

    def validate(self) -> None:
        int_check(minimum=4)("page_size", self.page_size)
        for name in ("num_blocks", "max_batch_tokens", "max_requests_per_batch"):
            optional(int_check(minimum=1))(name, getattr(self, name))
        optional(real_check(Interval(0.0, 1.0, low_open=True)))("max_memory_percent", self.max_memory_percent)
        optional(int_check(minimum=0))("max_blocks_per_request", self.max_blocks_per_request)
        self._validate_cuda_graph()
        for name in ("q_padding_interval_size", "kv_padding_interval_size", "max_queue_size"):
            int_check(minimum=0)(name, getattr(self, name))
        for name in ("varlen_compile_config", "decode_compile_config"):
            optional(nested_check((CompileConfig,), "a CompileConfig or a dict"))(name, getattr(self, name))
        int_check(minimum=0, maximum=3)("default_compile_level", self.default_compile_level)
        choice_check(_SCHEDULER_TYPES)("scheduler_type", self.scheduler_type)
        optional(real_check(Interval(0.0, 1.0)))("safety_margin", self.safety_margin)
        optional(int_check())("seed", self.seed)
        optional(real_check(Interval(0.0)))("cpu_offload_space", self.cpu_offload_space)
        real_check(Interval(0.0, 1.0))("cpu_offload_space_safety_threshold", self.cpu_offload_space_safety_threshold)
        optional(real_check(Interval(0.0, low_open=True), allow_inf=True))(
            "cpu_group_timeout", self.cpu_group_timeout
        )
        for name in (
            "allow_block_sharing",
            "return_logprobs",
            "auto_switch_to_flash",
            "per_request_processors",
            "drop_unsupported_processors",
            "disable_nccl_graph_mixing",
            "chunked_prefill",
            "batch_invariant",
        ):
            check_bool(name, getattr(self, name))
        check_optional_bool("use_async_batching", self.use_async_batching)
        optional(int_check(minimum=0))("max_cached_graphs", self.max_cached_graphs)

    def _validate_cuda_graph(self) -> None:
        value = self.use_cuda_graph
        if value is None or isinstance(value, bool):
            return
        if not (is_sequence(value) and len(value) == 2 and all(isinstance(flag, bool) for flag in value)):
            type_error("use_cuda_graph", "None, a bool, or a (varlen, decode) pair of bools", value)

    @property
    def cuda_graph_booleans(self) -> tuple[bool, bool]:
        """Whether CUDA graphs are on for the (varlen, decode) paths; None means off until decided."""
        if self.use_cuda_graph is None:
            return False, False
        if isinstance(self.use_cuda_graph, bool):
            return self.use_cuda_graph, self.use_cuda_graph
        return tuple(self.use_cuda_graph)

    @property
    def fallback_max_blocks_per_request(self) -> int:
        """The block-table width used when nothing hints at a better one."""
        return 32

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = value.to_dict() if isinstance(value, CompileConfig) else copy.deepcopy(value)
        return out

    @classmethod
    def from_dict(cls, config_dict: Mapping[str, Any]) -> ContinuousBatchingConfig:
        check_no_unknown_keys(cls, config_dict)
        return cls(**config_dict)
