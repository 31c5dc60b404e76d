"""Stopping criteria as pure functions ``(...) -> done mask [B]``.

The compiled step evaluates the built-in criteria (max length, EOS) on tensors; time limits
and user criteria that need Python are checked by the driver between steps.
"""

from __future__ import annotations

import abc

import torch

__all__ = ["max_length_reached", "eos_emitted", "StoppingCriteria", "StoppingCriteriaList"]


def max_length_reached(cur_len: torch.Tensor, max_length: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``[B]`` True once the sequences hold ``max_length`` tokens (prompt included)."""
    return (cur_len >= max_length).expand(batch_size)


def eos_emitted(next_tokens: torch.Tensor, eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """``[B]`` True where the newest token is one of ``eos_token_ids``."""
    if not eos_token_ids:
        return torch.zeros_like(next_tokens, dtype=torch.bool)
    eos = torch.tensor(eos_token_ids, dtype=next_tokens.dtype, device=next_tokens.device)
    return (next_tokens.unsqueeze(-1) == eos).any(-1)


class StoppingCriteria(abc.ABC):
    """A user criterion: called with ``(input_ids [B, cur_len], scores [B, V])``, returns ``[B]`` bool.

    Same call signature as transformers' ``StoppingCriteria``; it runs eagerly between steps.
    """

    @abc.abstractmethod
    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        """``[B]`` bool: which rows should stop."""


class StoppingCriteriaList(list):
    """A list of criteria; a row is done when any criterion says so."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for criterion in self:
            done = done | torch.as_tensor(criterion(input_ids, scores, **kwargs), device=done.device)
        return done
