"""Numerical hygiene: replace NaN/inf by finite values, and renormalize to log-probabilities.

``LogitNormalization`` is always the last processor of a chain (``renormalize_logits``), so that
the scores beam search accumulates are proper log-probabilities after every truncation.
"""

from __future__ import annotations

import torch

from genfn.processors.base import ProcessorBase
from genfn.processors.context import LogitsContext
from genfn.state.base import pytree_dataclass

__all__ = ["InfNanRemoveLogitsProcessor", "LogitNormalization", "nonfinite_rows"]


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """``[...]`` bool: rows of ``logits [..., V]`` holding a NaN or an infinity. The one finiteness
    check of raw logits: every strategy and continuous batching record it (the driver raises
    ``NonFiniteLogitsError``; the batching manager fails that request alone)."""
    return ~torch.isfinite(logits).all(dim=-1)


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
