"""The stopping checks a decode step runs on tensors: pure, compile-safe, per row.

Lengths are per row (``cur_len [B]``), as everywhere in a step; a 0-d length still works and
then serves every row.
"""

from __future__ import annotations

import torch

__all__ = ["max_length_reached", "eos_emitted", "eos_in_new_tokens"]


def max_length_reached(cur_len: torch.Tensor, max_length: torch.Tensor | int,
                       batch_size: int | None = None) -> torch.Tensor:
    """``[B]`` True where row ``b`` holds ``max_length[b]`` tokens (prompt included) or more.

    ``max_length`` is ``[B]`` or 0-d (one limit for every row). ``batch_size`` is only needed when
    both lengths are 0-d, to give the answer its ``[B]`` shape.
    """
    reached = cur_len >= max_length
    if batch_size is not None:
        reached = reached.expand(batch_size)
    return reached


def eos_emitted(next_tokens: torch.Tensor, eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """``[B]`` True where the newest token is one of ``eos_token_ids``."""
    if not eos_token_ids:
        return torch.zeros_like(next_tokens, dtype=torch.bool)
    eos = torch.tensor(eos_token_ids, dtype=next_tokens.dtype, device=next_tokens.device)
    return (next_tokens.unsqueeze(-1) == eos).any(-1)


def eos_in_new_tokens(tokens: torch.Tensor, old_len: torch.Tensor, cur_len: torch.Tensor,
                      eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """``[B]`` True where a token appended by the latest step (columns ``old_len[b] <= c <
    cur_len[b]`` of ``tokens [B, N]``) is one of ``eos_token_ids``.

    For steps that append several tokens to a row (speculation) or none (a finished row): the
    window is a mask over the whole buffer, never a slice by a tensor.
    """
    batch, n = tokens.shape
    if not eos_token_ids:
        return torch.zeros(batch, dtype=torch.bool, device=tokens.device)
    cols = torch.arange(n, device=tokens.device)
    new = (cols >= torch.as_tensor(old_len).reshape(-1, 1)) & (cols < torch.as_tensor(cur_len).reshape(-1, 1))
    eos = torch.tensor(eos_token_ids, dtype=tokens.dtype, device=tokens.device)
    is_eos = (tokens.unsqueeze(-1) == eos).any(-1)
    return (is_eos & new).any(-1)
