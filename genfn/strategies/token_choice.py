"""ONE token choice: processors, greedy or keyed sampling, and the log-probabilities of the choice.

``choose_tokens(logits, processors, ctx, keys=..., sample_mask=...)`` is the pure function every
strategy that picks one token per row and continuous batching's step call:

* the processor chain runs on the logits (with its state, for a stateful chain such as SynthID);
* a row that samples takes ``argmax(scores + gumbel(key, generated count))``: its noise depends
  only on its key and on how many tokens it generated, never on its batch, position or padding;
  the others take ``argmax(scores)``. ``sample_mask [R]`` mixes both in one batch (continuous
  batching); without it every row samples when ``keys`` is given;
* ``logprobs=True`` adds each chosen token's log-probability under the model's *raw*
  distribution (``log_softmax(logits)``, before any processor: what OpenAI's API and vLLM report),
  and ``top_k`` the ``k`` most likely raw tokens of each row. On CPU float32 logits both the argmax
  and the logsumexp come from one native pass (``max_logsumexp``, ``genfn/kernels/token_ops.cpp``),
  and an argmax alone from another (``argmax``: every greedy or keyed pick, and speculative
  verification's).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from genfn import random as grandom
from genfn.kernels import portable_ops_available
from genfn.processors.grammar import apply_token_bitmask

__all__ = ["TokenChoice", "argmax", "choose_tokens", "pick_tokens", "chosen_logprobs", "max_logsumexp", "native_pick", "raw_logprobs",
           "top_logprobs", "top_pairs"]


class TokenChoice(NamedTuple):
    tokens: torch.Tensor  # [R] int64
    scores: torch.Tensor  # [R, V] the processed scores the choice was made on
    processor_state: Any = None  # a stateful chain's new state
    logprobs: torch.Tensor | None = None  # [R] float32 raw log-probability of each chosen token
    top_ids: torch.Tensor | None = None  # [R, k]
    top_logprobs: torch.Tensor | None = None  # [R, k], most likely first


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` float32 log-softmax of the model's logits."""
    return torch.log_softmax(logits.float(), dim=-1)


def native_pick(scores: torch.Tensor) -> bool:
    """Whether :func:`max_logsumexp` reads ``scores`` in one native pass (``token_ops.cpp``)."""
    return (scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.dim() == 2
            and scores.shape[-1] > 0 and scores.is_contiguous() and portable_ops_available())


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """Pure: ``torch.argmax(scores, dim=-1)`` (the first maximum, the first NaN in a row that has
    one), in one native pass a row for CPU float32 scores, where torch's took ~70-95 us of a
    49152-token row: a few % of a small model's decode step."""
    rows = scores.reshape(-1, scores.shape[-1]) if scores.dim() != 2 else scores
    if native_pick(rows):
        return torch.ops.genfn_kernels.argmax_rows(rows).reshape(scores.shape[:-1])
    return torch.argmax(scores, dim=-1)


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


def pick_tokens(scores: torch.Tensor, keys: torch.Tensor | None = None,
                counter: torch.Tensor | None = None) -> torch.Tensor:
    """Pure: ``argmax(scores [N, V])`` per row, or with ``keys [N, 2]`` the keyed sample
    ``argmax(scores + gumbel(keys, counter [N]))``: the draw every sampling row of every strategy
    makes (the drafters of assisted generation call it at ``counter + i`` for their i-th draft)."""
    if keys is None:
        return argmax(scores)
    return argmax(scores + grandom.gumbel(keys, counter, scores.shape[-1]))


def choose_tokens(logits: torch.Tensor, processors=None, ctx=None, *, keys: torch.Tensor | None = None,
                  sample_mask: torch.Tensor | None = None, processor_state=None, logprobs: bool = False,
                  top_k: int = 0, grammar_mask: torch.Tensor | None = None) -> TokenChoice:
    """Pure: each row's next token from ``logits [R, V]`` (see the module's docstring).

    ``processors``: a ``ProcessorChain`` (or None) run with ``ctx`` (a ``LogitsContext``, also
    needed when ``keys`` are given: the noise counter is ``cur_len - prompt_len``);
    ``processor_state``: a stateful chain's state (returned updated). ``keys [R, 2]``: the rows'
    sampling keys; ``sample_mask [R]`` bool: which rows sample (None: all, when keys are given).
    ``grammar_mask [R, ceil(V / 32)]`` int32 (structured outputs; all ones for a free row) rules
    tokens out before the processors, so top-k/top-p choose among allowed tokens.
    """
    scores = logits if grammar_mask is None else apply_token_bitmask(logits, grammar_mask)
    processed = processors is not None or grammar_mask is not None
    if processors is not None:
        if processor_state is not None:
            scores, processor_state = processors.apply(scores, ctx, processor_state)
        else:
            scores = processors(scores, ctx)
    logsumexp = None
    tokens = None
    if keys is None or sample_mask is not None:
        if logprobs and (not processed or native_pick(scores)):
            # One native pass gives the argmax (and, unprocessed, the logsumexp the logprobs need).
            tokens, logsumexp = max_logsumexp(scores)
        else:
            tokens = argmax(scores)
    if keys is not None:
        sampled = pick_tokens(scores, keys, ctx.row_cur_len() - ctx.row_prompt_len())
        tokens = sampled if sample_mask is None else torch.where(sample_mask, sampled, tokens)
    chosen = top_ids = top_values = None
    if logprobs:
        chosen = chosen_logprobs(logits, tokens, None if processed else logsumexp)
    if top_k:
        top_ids, top_values = top_logprobs(raw_logprobs(logits), top_k)
    return TokenChoice(tokens, scores, processor_state, chosen, top_ids, top_values)
