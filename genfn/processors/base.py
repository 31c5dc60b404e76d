"""What every logits processor shares: the calling convention and masked reads of the buffer.

A processor is a frozen value with ``__call__(logits, ctx) -> logits``: ``logits`` is ``[B, V]``
float32 and ``ctx`` a :class:`~genfn.processors.context.LogitsContext`. A *stateful* processor
(SynthID) instead has ``init_state(batch_size, device)`` and ``apply(logits, ctx, state) ->
(logits, state)``, so its memory lives in the decoding state, not in the object.

The helpers below read ``ctx.tokens`` without ever slicing by ``cur_len``: garbage columns are
replaced by a sentinel (usually ``V``, one past the vocabulary) so that scatters land in a spare
column that is dropped afterwards. That keeps every shape static inside a compiled step.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from genfn.processors.context import LogitsContext

__all__ = [
    "LogitsProcessor",
    "StatefulLogitsProcessor",
    "ProcessorBase",
    "filled_tokens",
    "tail_tokens",
    "token_set_mask",
    "vocab_mask",
    "as_id_list",
]


@runtime_checkable
class LogitsProcessor(Protocol):
    """``processor(logits, ctx) -> logits``: pure, shape preserving."""

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor: ...


@runtime_checkable
class StatefulLogitsProcessor(Protocol):
    """A processor that carries memory across steps in an explicit state pytree."""

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> Any: ...

    def apply(self, logits: torch.Tensor, ctx: LogitsContext, state: Any) -> tuple[torch.Tensor, Any]: ...


class ProcessorBase:
    """Mixin with the class-level facts the chain needs about a processor.

    ``compile_safe``: the processor traces under ``torch.compile(fullgraph=True)`` (no host sync,
    no data-dependent shapes). ``stateful``: it needs ``init_state``/``apply`` instead of ``__call__``.
    """

    compile_safe: ClassVar[bool] = True
    stateful: ClassVar[bool] = False


def filled_tokens(ctx: LogitsContext, fill: int, start: torch.Tensor | int | None = None) -> torch.Tensor:
    """``[B, N]`` tokens with every column outside ``[start, cur_len)`` replaced by ``fill``.

    ``start`` may be an int, a 0-d tensor, or a ``[B]`` tensor (per-row start, e.g. left padding).
    """
    n = ctx.tokens.shape[1]
    pos = torch.arange(n, device=ctx.tokens.device).unsqueeze(0)
    keep = pos < ctx.cur_len
    if start is not None:
        if isinstance(start, torch.Tensor) and start.dim() == 1:
            keep = keep & (pos >= start.to(pos.device).unsqueeze(1))
        else:
            keep = keep & (pos >= start)
    return torch.where(keep, ctx.tokens, torch.full_like(ctx.tokens, fill))


def tail_tokens(ctx: LogitsContext, length: int) -> torch.Tensor:
    """``[B, length]`` the last ``length`` filled tokens (``input_ids[:, -length:]``).

    When ``cur_len < length`` the leading entries are clamped reads of column 0 and meaningless:
    callers guard with ``ctx.cur_len >= length``.
    """
    b, n = ctx.tokens.shape
    idx = ctx.cur_len - length + torch.arange(length, device=ctx.tokens.device)
    idx = idx.clamp(min=0, max=n - 1)
    return ctx.tokens.gather(1, idx.unsqueeze(0).expand(b, length))


def token_set_mask(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, V]`` bool: which vocabulary entries appear in each row of ``ids``.

    Entries ``>= vocab_size`` (the sentinel) fall into a spare column that is dropped.
    """
    b = ids.shape[0]
    mask = torch.zeros((b, vocab_size + 1), dtype=torch.bool, device=ids.device)
    mask = mask.scatter(1, ids.clamp(max=vocab_size), True)
    return mask[:, :vocab_size]


def vocab_mask(ids: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[V]`` bool: ``isin(arange(V), ids)``."""
    return torch.isin(torch.arange(vocab_size, device=device), ids.to(device))


def as_id_list(value: Any, name: str = "token ids") -> tuple[int, ...]:
    """Normalize an int / list / tensor of token ids into a tuple of ints (a static value)."""
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist()
    if isinstance(value, int):
        value = [value]
    out = tuple(int(v) for v in value)
    if any(v < 0 for v in out):
        raise ValueError(f"`{name}` has to be a list of non-negative integers, but is {list(out)}")
    return out
