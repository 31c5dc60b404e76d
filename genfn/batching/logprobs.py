"""The log-probabilities a batch step reports: of each chosen token, and each row's most likely tokens.

Both are read from the model's *raw* distribution, ``log_softmax(logits)`` before any logits
processor, temperature, penalty or bias: what OpenAI's API and vLLM report by default, and a
value that does not depend on how the token was picked. The top-k runs once over the whole batch
at the largest ``k`` any row asked for; each row then keeps its own first ``k`` pairs.
"""

from __future__ import annotations

import torch

__all__ = ["raw_logprobs", "top_logprobs", "top_pairs"]


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` float32 log-softmax of the model's logits."""
    return torch.log_softmax(logits.float(), dim=-1)


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure: the ``k`` most likely tokens of each row, ``(ids [R, k], logprobs [R, k])``, most
    likely first (``k`` is a host int: a static shape)."""
    values, ids = torch.topk(logprobs, k, dim=-1, largest=True, sorted=True)
    return ids, values


def top_pairs(ids: list[int], values: list[float], k: int) -> list[tuple[int, float]]:
    """One row's first ``k`` ``(token_id, logprob)`` pairs (host lists, after the step's sync)."""
    return list(zip(ids[:k], values[:k]))
