"""transformers-style callables as genfn processors: ``(input_ids, scores) -> scores``.

``generate(logits_processor=...)`` accepts transformers' own processor objects (a
``transformers.SuppressTokensLogitsProcessor``, a ``LogitsProcessorList``) and any callable with
two positional arguments. They see transformers' ``input_ids``, ``tokens[:, :cur_len]``, which
needs the length on the host: the wrapper is **eager-only** (``compile_safe = False``), and every
row must stand at the same length (as in ``generate``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from genfn.processors.base import ProcessorBase
from genfn.processors.context import LogitsContext
from genfn.state.base import pytree_dataclass, static_field

__all__ = ["ExternalLogitsProcessor", "is_genfn_processor", "as_genfn_processor"]


class _ByIdentity:
    """A callable held as static pytree metadata: hashed and compared by identity (a
    ``LogitsProcessorList`` is a list, so it would be unhashable and compared by content)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _ByIdentity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"<{type(self.obj).__name__} at {id(self.obj):#x}>"


def _describe(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


@pytree_dataclass
class ExternalLogitsProcessor(ProcessorBase):
    """Run a transformers-style ``processor(input_ids, scores) -> scores`` inside a genfn chain."""

    compile_safe = False

    function: _ByIdentity = static_field()

    @classmethod
    def wrap(cls, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> ExternalLogitsProcessor:
        if not callable(fn):
            raise TypeError(f"a logits processor must be callable, got {type(fn).__name__}")
        return cls(_ByIdentity(fn))

    @property
    def wrapped(self) -> Any:
        """The user's callable."""
        return self.function.obj

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        fn = self.wrapped
        lengths = ctx.row_cur_len()
        cur_len = int(lengths[0])
        if not bool((lengths == cur_len).all()):
            raise ValueError(
                f"the logits processor {_describe(fn)} takes transformers' input_ids, which needs every row at the "
                f"same length; rows stand at {lengths.tolist()}"
            )
        # Copies: a transformers processor may write into its arguments, and genfn's are shared state.
        out = fn(ctx.tokens[:, :cur_len].clone(), logits.clone())
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"the logits processor {_describe(fn)} returned {type(out).__name__}, expected a tensor "
                            f"of scores shaped {tuple(logits.shape)}")
        if out.shape != logits.shape:
            raise TypeError(f"the logits processor {_describe(fn)} returned scores shaped {tuple(out.shape)}, "
                            f"expected {tuple(logits.shape)}")
        # A new tensor built from slices or a transpose may be a strided view, and may come back in
        # another float dtype: the chain hands on contiguous scores of the logits' dtype.
        return out.to(logits.dtype).contiguous()


def is_genfn_processor(p: Any) -> bool:
    """Whether ``p`` follows genfn's ``(logits, ctx)`` convention (rather than transformers')."""
    return isinstance(p, ProcessorBase) or bool(getattr(p, "genfn_processor", False)) or hasattr(p, "fingerprint")


def as_genfn_processor(p: Any) -> Any:
    """``p`` itself if it is a genfn processor, else ``p`` wrapped as an external one."""
    if is_genfn_processor(p):
        return p
    if not callable(p):
        raise TypeError(f"`logits_processor` entries must be logits processors (callables), got {type(p).__name__}")
    return ExternalLogitsProcessor.wrap(p)
