"""``FunctionalModel``: the value a step function receives — spec, params and the pure apply.

The eager driver and the compiled driver hand a step the very same kind of value (the compiled one
holds the weights as the compiled module's buffers, so inductor can fold them into constants), so a
step that works eagerly works compiled. It imports nothing from genfn: the driver depends on it,
never on the ``Model`` class.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["FunctionalModel"]


class FunctionalModel:
    """``(spec, params, apply_fn)`` with ``apply(tokens, positions, cache, mask, **kw) -> (logits, cache)``."""

    __slots__ = ("spec", "params", "apply_fn")

    def __init__(self, spec: Any, params: Any, apply_fn: Callable):
        self.spec = spec
        self.params = params
        self.apply_fn = apply_fn

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def apply(self, tokens, positions, cache, attention_mask=None, **kwargs):
        return self.apply_fn(self.spec, self.params, tokens, positions, cache, attention_mask, **kwargs)

    def with_params(self, params: Any) -> "FunctionalModel":
        return FunctionalModel(self.spec, params, self.apply_fn)

    def __repr__(self) -> str:
        return f"FunctionalModel({self.spec!r})"
