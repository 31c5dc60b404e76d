"""The state of beam search and beam sampling.

Every buffer has a static shape fixed at ``init``: ``B`` prompts, ``K = num_beams`` beams,
``N = max_cache_len`` token columns, ``K2 = max(2, 1 + num_eos) * K`` candidates per step. The
layout follows transformers' vectorized ``_beam_search``: running beams ``[B, K, N]`` with their
accumulated log-probabilities, and the ``K`` best finished hypotheses per prompt with their
length-penalized scores, both kept sorted by score. The KV cache holds ``B * K`` rows (row
``b * K + k`` is beam ``k`` of prompt ``b``), reordered by beam index at the end of every step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from genfn.state.base import pytree_dataclass, static_field

__all__ = ["BeamOptions", "BeamState"]


@dataclasses.dataclass(frozen=True)
class BeamOptions:
    """Everything static about a beam-search run (it selects code, so it keys compilation).

    Equality and hashing come from the fields; the processors' numbers are leaves of the state.

    ``fill_token_id`` is what the token buffers hold past a hypothesis' end: transformers fills
    with ``pad_token_id or eos_token_id[0]`` when there is an EOS token, else ``-1``.
    """

    num_beams: int
    num_return_sequences: int
    length_penalty: float
    early_stopping: bool | str
    do_sample: bool
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    fill_token_id: int
    output_scores: bool = False
    output_logits: bool = False
    output_attentions: bool = False
    output_hidden_states: bool = False
    # Record prompts whose raw logits hold NaN/inf (the driver raises); off under remove_invalid_values.
    check_finite: bool = True

    @property
    def beams_to_keep(self) -> int:
        """Candidates kept per step: enough that ``num_beams`` survive even if the best all end."""
        return max(2, 1 + len(self.eos_token_ids)) * self.num_beams


@pytree_dataclass
class BeamState:
    """Beam-search state; no field changes shape from one step to the next.

    ``running_sequences[..., :cur_len]`` are the live beams (prompt included); the rest of each
    row holds ``fill_token_id``. ``*_beam_indices[..., t]`` is the cache row (``b * K + k``) the
    token generated at step ``t`` was appended to, ``-1`` where there is none yet.
    """

    running_sequences: torch.Tensor  # [B, K, N] int64
    running_scores: torch.Tensor  # [B, K] float32: accumulated log-probs (-1e9 marks a dead beam)
    running_beam_indices: torch.Tensor  # [B, K, N] int32
    sequences: torch.Tensor  # [B, K, N] int64: finished hypotheses, best first
    beam_scores: torch.Tensor  # [B, K] float32: their length-penalized scores (-1e9: empty slot)
    beam_indices: torch.Tensor  # [B, K, N] int32
    is_sent_finished: torch.Tensor  # [B, K] bool: slot holds a real finished hypothesis
    improvable: torch.Tensor  # [B, 1] bool: running beams may still beat the worst finished one
    hits: torch.Tensor  # [B, K2] bool: candidates of the latest step that hit a stopping criterion
    cur_len: torch.Tensor  # [] int64: filled columns of running_sequences
    prompt_len: torch.Tensor  # [] int64: padded prompt length
    max_length: torch.Tensor  # [] int64 (prompt included)
    positions: torch.Tensor  # [B * K] int64: position id of each row's newest token
    done: torch.Tensor  # [] bool: the search is over (transformers' ``this_peer_finished``)
    keys: torch.Tensor | None  # [B, 2] per-prompt keys (beam sampling)
    cache: Any  # B * K rows
    scores: torch.Tensor | None  # [B * K, V] processed log-probs of the latest step (output_scores)
    logits: torch.Tensor | None  # [B * K, V] raw logits of the latest step (output_logits)
    attentions: tuple | None  # per layer [B * K, H, 1, attend_len] of the latest step
    hidden_states: tuple | None  # per layer (+ embeddings) [B * K, 1, hidden] of the latest step
    prefill_attentions: tuple | None  # the prefill's, passed through unchanged so shapes stay fixed
    prefill_hidden_states: tuple | None
    nonfinite: torch.Tensor  # [B] bool: a beam of the prompt saw NaN or inf logits at some step
    options: BeamOptions = static_field()
    # The logits-processor chain (a pytree: kinds static, numbers leaves), as in DecodeState.
    processors: Any = None
    # Structured outputs: [B * K, ceil(V / 32)] int32, each beam row's allowed next tokens
    # (genfn.structured.beams.BeamGrammarRows fills it between steps, following the beams).
    grammar_mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.running_sequences.shape[0]

    @property
    def num_beams(self) -> int:
        return self.running_sequences.shape[1]

    @property
    def max_cache_len(self) -> int:
        return self.running_sequences.shape[2]
