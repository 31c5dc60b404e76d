"""Numerical hygiene: replace NaN/inf by finite values, and renormalize to log-probabilities.

``LogitNormalization`` is always the last processor of a chain (``renormalize_logits``), so that
the scores beam search accumulates are proper log-probabilities after every truncation.
"""

from __future__ import annotations

import torch

from genfn.processors.base import ProcessorBase
from genfn.processors.context import LogitsContext
from genfn.state.base import pytree_dataclass

__all__ = ["InfNanRemoveLogitsProcessor", "LogitNormalization"]


@pytree_dataclass
class InfNanRemoveLogitsProcessor(ProcessorBase):
    """NaN -> 0, +inf -> the largest finite value, -inf -> the smallest, so sampling cannot fail."""

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        info = torch.finfo(logits.dtype)
        out = torch.where(logits != logits, 0.0, logits)
        out = torch.where(logits == float("inf"), info.max, out)
        return torch.where(logits == -float("inf"), info.min, out)


@pytree_dataclass
class LogitNormalization(ProcessorBase):
    """``log_softmax`` over the vocabulary."""

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        return logits.log_softmax(dim=-1)
