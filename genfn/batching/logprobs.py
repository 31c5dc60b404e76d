"""The log-probabilities a batch step reports: of each chosen token, and each row's most likely tokens.

Both are read from the model's *raw* distribution, ``log_softmax(logits)`` before any logits
processor, temperature, penalty or bias: what OpenAI's API and vLLM report by default, and a
value that does not depend on how the token was picked. The top-k runs once over the whole batch
at the largest ``k`` any row asked for; each row then keeps its own first ``k`` pairs.
"""

from __future__ import annotations

import torch

from genfn.kernels import decode_linear_available

__all__ = ["chosen_logprobs", "max_logsumexp", "native_pick", "raw_logprobs", "top_logprobs", "top_pairs"]


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` float32 log-softmax of the model's logits."""
    return torch.log_softmax(logits.float(), dim=-1)


def native_pick(scores: torch.Tensor) -> bool:
    """Whether :func:`max_logsumexp` reads ``scores`` in one native pass (``token_ops.cpp``)."""
    return (scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.dim() == 2
            and scores.shape[-1] > 0 and scores.is_contiguous() and decode_linear_available())


def max_logsumexp(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure: each row's ``argmax`` (the first maximum, as ``torch.argmax``) and ``logsumexp``,
    ``([R] int64, [R] float32)``."""
    if native_pick(scores):
        return torch.ops.genfn_kernels.max_logsumexp(scores)
    return torch.argmax(scores, dim=-1), torch.logsumexp(scores.float(), dim=-1)


def chosen_logprobs(logits: torch.Tensor, chosen: torch.Tensor, logsumexp: torch.Tensor | None = None) -> torch.Tensor:
    """Pure: ``raw_logprobs(logits)`` at each row's ``chosen`` token, ``[R]``; ``logsumexp``: the
    rows' logsumexp when already known."""
    logits = logits.float()
    if logsumexp is None:
        if not native_pick(logits):
            return raw_logprobs(logits).gather(1, chosen.unsqueeze(1)).squeeze(1)
        _, logsumexp = torch.ops.genfn_kernels.max_logsumexp(logits)
    return logits.gather(1, chosen.unsqueeze(1)).squeeze(1) - logsumexp


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure: the ``k`` most likely tokens of each row, ``(ids [R, k], logprobs [R, k])``, most
    likely first (``k`` is a host int: a static shape)."""
    values, ids = torch.topk(logprobs, k, dim=-1, largest=True, sorted=True)
    return ids, values


def top_pairs(ids: list[int], values: list[float], k: int) -> list[tuple[int, float]]:
    """One row's first ``k`` ``(token_id, logprob)`` pairs (host lists, after the step's sync)."""
    return list(zip(ids[:k], values[:k]))
