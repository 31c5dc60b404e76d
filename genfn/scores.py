"""``compute_transition_scores``: the score of each chosen token, from a generation's per-step scores."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["compute_transition_scores"]


def compute_transition_scores(
    sequences: torch.Tensor,
    scores: Sequence[torch.Tensor],
    beam_indices: torch.Tensor | None = None,
    normalize_logits: bool = False,
) -> torch.Tensor:
    """``[rows, steps]``: ``scores[t][row_of(t), sequences[:, prompt + t]]`` for every generated token.

    Same contract as transformers' ``GenerationMixin.compute_transition_scores``:

    ``sequences`` ``[rows, prompt + steps]`` are the returned sequences; ``scores`` one tensor
    ``[rows', V]`` per generation step (``output_scores`` or ``output_logits``); ``beam_indices``
    ``[rows, steps]`` (beam search: ``output.beam_indices``) names the row of ``scores`` each token
    was chosen from, ``-1`` after a hypothesis ended (those positions score 0); without it, row
    ``i`` of ``sequences`` reads row ``i`` of every step (greedy search, sampling).
    ``normalize_logits`` log-softmaxes each step's scores over the vocabulary first.

    For beam search, ``transition_scores.sum(1) / generated_len ** length_penalty`` recovers
    ``sequences_scores`` (with ``normalize_logits=False``).
    """
    if len(scores) == 0:
        raise ValueError("scores is empty: generate with return_dict_in_generate=True and output_scores=True "
                         "(or output_logits=True)")
    vocab = scores[0].shape[-1]
    steps = len(scores)
    if beam_indices is None:
        beam_indices = torch.arange(scores[0].shape[0], device=sequences.device).view(-1, 1).expand(-1, steps)
    # [rows' * V, steps]: column t holds step t's scores, row r * V + v the score of token v in row r.
    stacked = torch.stack(tuple(scores)).reshape(steps, -1).transpose(0, 1)
    if normalize_logits:
        stacked = torch.log_softmax(stacked.reshape(-1, vocab, steps), dim=1).reshape(-1, steps)

    ended = beam_indices < 0
    length = int((~ended).long().sum(-1).max())
    beam_indices = beam_indices[:, :length].clone()
    ended = ended[:, :length]
    beam_indices[ended] = 0  # any row will do: these positions are zeroed below

    first = sequences.shape[-1] - length
    indices = sequences[:, first:].to(stacked.device) + beam_indices.to(stacked.device).long() * vocab
    transition_scores = stacked.gather(0, indices)
    transition_scores[ended.to(transition_scores.device)] = 0
    return transition_scores
