"""Constrained generation through a user callback: ``prefix_allowed_tokens_fn(batch_id, ids)``.

This processor is **eager-only**. The callback is arbitrary Python that receives the sequence
so far (a tensor sliced to ``cur_len``, which needs the length on the host) and returns a Python
list; nothing about that can be traced into a graph. Compile a step without it, or run the step
eagerly (the driver's eager mode runs the very same step function).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from genfn.processors.base import ProcessorBase
from genfn.processors.context import LogitsContext
from genfn.state.base import pytree_dataclass, static_field

__all__ = ["PrefixConstrainedLogitsProcessor"]


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
        cur_len = int(ctx.cur_len)
        sequences = ctx.tokens[:, :cur_len]
        mask = torch.full_like(logits, -math.inf)
        batch_size = sequences.shape[0] // self.num_beams
        for batch_id in range(batch_size):
            for beam_id in range(self.num_beams):
                row = batch_id * self.num_beams + beam_id
                allowed = self.prefix_allowed_tokens_fn(batch_id, sequences[row])
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
