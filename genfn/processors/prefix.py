"""Constrained generation through a user callback: ``prefix_allowed_tokens_fn(batch_id, ids)``.

This processor is **eager-only**. The callback is arbitrary Python that receives the sequence
so far (a tensor sliced to the row's ``cur_len``, which needs the length on the host) and returns
a list (or tensor) of token ids; nothing about that can be traced into a graph. Compile a step
without it, or run the step eagerly (the driver's eager mode runs the very same step function).
Rows may stand at different lengths: each hypothesis gets its own slice.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch

from genfn.processors.base import ProcessorBase
from genfn.processors.context import LogitsContext
from genfn.state.base import pytree_dataclass, static_field

__all__ = ["PrefixConstrainedLogitsProcessor"]


def _allowed_ids(allowed, vocab_size: int) -> list[int]:
    """The callback's answer as a list of in-vocabulary ids, or a clear error naming it."""
    if isinstance(allowed, torch.Tensor):
        allowed = allowed.reshape(-1).tolist()
    elif isinstance(allowed, (list, tuple)):
        allowed = list(allowed)
    else:
        raise TypeError(
            f"`prefix_allowed_tokens_fn` must return a list or a tensor of token ids, got {type(allowed).__name__}"
        )
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in allowed):
        raise TypeError(f"`prefix_allowed_tokens_fn` must return integer token ids, got {allowed!r}")
    allowed = [int(t) for t in allowed]
    bad = sorted({t for t in allowed if t < 0 or t >= vocab_size})
    if bad:
        raise ValueError(
            f"`prefix_allowed_tokens_fn` returned token ids outside the vocabulary [0, {vocab_size}): {bad}"
        )
    return allowed


@pytree_dataclass
class PrefixConstrainedLogitsProcessor(ProcessorBase):
    """Allow only the tokens the callback returns for each hypothesis.

    ``num_beams`` hypotheses per batch entry share the entry's ``batch_id``. If every hypothesis
    of an entry has only ``-inf`` left, the bare mask is returned for that entry (transformers'
    rule for unsatisfiable constraints). An empty allowed list raises ``ValueError``.
    """

    compile_safe = False

    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] = static_field()
    num_beams: int = static_field(1)

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        lengths = ctx.row_cur_len().tolist()
        vocab = logits.shape[-1]
        mask = torch.full_like(logits, -math.inf)
        batch_size = logits.shape[0] // self.num_beams
        for batch_id in range(batch_size):
            for beam_id in range(self.num_beams):
                row = batch_id * self.num_beams + beam_id
                allowed = self.prefix_allowed_tokens_fn(batch_id, ctx.tokens[row, : lengths[row]])
                allowed = _allowed_ids(allowed, vocab)
                if len(allowed) == 0:
                    raise ValueError(
                        f"`prefix_allowed_tokens_fn` returned an empty list for batch ID {batch_id}. This means "
                        "that the constraint is unsatisfiable. Please check your implementation of "
                        "`prefix_allowed_tokens_fn`."
                    )
                mask[row, allowed] = 0
        out = logits + mask
        unsatisfiable = out.amax(dim=-1).isneginf().view(batch_size, -1).all(dim=-1, keepdim=True)
        return torch.where(unsatisfiable.repeat_interleave(self.num_beams, dim=0), mask, out)
