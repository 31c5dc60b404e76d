"""The grammar mask of structured outputs, applied inside a pure decode step.

A host-side matcher (``genfn.structured``) fills a ``[B, ceil(V / 32)]`` int32 bitmask between
steps (bit ``i % 32`` of word ``i // 32`` set: token ``i`` allowed); the step receives it as a tensor
leaf and sets the disallowed tokens' scores to ``-inf``. A free row's mask is all ones, so one
compiled step serves constrained and free rows alike.
"""

from __future__ import annotations

import torch

__all__ = ["apply_token_bitmask", "allowed_tokens", "FREE_ROW"]

# The mask word of a row that nothing constrains (every bit set).
FREE_ROW = -1


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[..., W]`` int32 words -> ``[..., vocab_size]`` bool (True: allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*bitmask.shape[:-1], bitmask.shape[-1] * 32)[..., :vocab_size].bool()


def apply_token_bitmask(scores: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``scores [..., V]`` with every token the ``bitmask [..., ceil(V / 32)]`` does not allow set to -inf."""
    allowed = allowed_tokens(bitmask, scores.shape[-1])
    return scores.masked_fill(~allowed, float("-inf"))
