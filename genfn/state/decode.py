"""The state of single-sequence decoding (greedy and multinomial sampling), one row per request.

Rows move independently: lengths, positions, limits and done flags are ``[B]`` tensors, so a
request can join a running batch (``genfn.strategies.sample.insert``) and rows of different
lengths share one compiled step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from genfn.state.base import pytree_dataclass, static_field

__all__ = ["DecodeOptions", "DecodeState"]


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """Everything static about a decoding run: it selects code, so it keys compilation.

    Equality and hashing come from the fields, so two runs with equal settings share one compiled
    step and a field added here can never be forgotten by a hand-written key. The numbers the
    processors use are not here: they are tensor leaves of the state (``DecodeState.processors``).
    """

    do_sample: bool
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    output_scores: bool = False
    output_logits: bool = False
    # Classifier-free guidance scale (None: off); the unconditional branch is DecodeState.guidance.
    guidance_scale: float | None = None
    # Record rows whose raw logits hold NaN/inf (the driver raises); off under remove_invalid_values.
    check_finite: bool = True


@pytree_dataclass
class DecodeState:
    """Greedy/sampling decoding state; every buffer is preallocated to ``max_cache_len``.

    ``tokens[b, :cur_len[b]]`` is row ``b``'s transformers ``input_ids``: its prompt (left padded
    when ``generate`` was given a padded batch), then the generated tokens, with ``pad_token_id``
    after the row finished (as transformers keeps appending padding to finished rows).
    """

    tokens: torch.Tensor  # [B, N] int64
    cur_len: torch.Tensor  # [B] int64: filled columns of each row
    prompt_len: torch.Tensor  # [B] int64: cur_len at the row's first generated token
    max_length: torch.Tensor  # [B] int64: the row is done once cur_len reaches it (prompt included)
    positions: torch.Tensor  # [B] int64: position id of the most recent token
    done: torch.Tensor  # [B] bool
    keys: torch.Tensor | None  # [B, 2] per-row keys when sampling
    cache: Any
    scores: torch.Tensor | None  # [B, V] processed scores of the latest token (output_scores)
    logits: torch.Tensor | None  # [B, V] raw logits of the latest token (output_logits)
    nonfinite: torch.Tensor  # [B] bool: the row's raw logits held NaN or inf at some step
    options: DecodeOptions = static_field()
    # The logits-processor chain (a pytree: which processors run is its static structure, their
    # numbers are leaves, so one compiled step serves every value).
    processors: Any = None
    # The chain's state when it holds a stateful processor (SynthID): the tuple
    # ``processors.init_state(B)`` returns, threaded through every step.
    processor_state: Any = None
    # Stop strings: a genfn.stopping.StopStringMatcher (its tables are leaves), checked in the step.
    stop_strings: Any = None
    # output_attentions / output_hidden_states (None unless asked for): per-layer tuples of the
    # latest step, and the prefill's, which steps pass through so no leaf changes shape.
    attentions: tuple | None = None  # [B, H, 1, attend_len] per layer
    hidden_states: tuple | None = None  # [B, 1, hidden] per layer (+ embeddings)
    prefill_attentions: tuple | None = None
    prefill_hidden_states: tuple | None = None
    # Classifier-free guidance: the unconditional branch (genfn.strategies.guidance.GuidanceState).
    guidance: Any = None
    # Structured outputs: [B, ceil(V / 32)] int32, the tokens each row's grammar allows next (all
    # ones for a free row); filled on the host between steps (genfn.structured.rows.GrammarRows).
    grammar_mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_cache_len(self) -> int:
        return self.tokens.shape[1]
