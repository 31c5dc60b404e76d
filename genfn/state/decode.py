"""The state of single-sequence decoding (greedy and multinomial sampling)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from genfn.state.base import pytree_dataclass, static_field

__all__ = ["DecodeOptions", "DecodeState"]


@dataclasses.dataclass(frozen=True, eq=False)
class DecodeOptions:
    """Everything static about a decoding run: it selects code, so it keys compilation.

    ``processors`` is the logits-processor chain (a callable ``(logits, ctx) -> logits``);
    ``processors_key`` is a hashable description of it, used for equality, so two runs with equal
    settings share one compiled step even though their chain objects differ.
    """

    do_sample: bool
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    processors: Callable | None
    processors_key: Any
    output_scores: bool = False
    output_logits: bool = False
    attend_len: int | None = None  # attend over this many cache slots (None: all of them)
    stopping: Callable | None = None  # user stopping criteria, eager only
    stopping_key: Any = None
    # Stop strings: a genfn.stopping.StopStringMatcher (constant tables), checked in the step.
    stop_strings: Any = None
    # Classifier-free guidance scale (None: off); the unconditional branch is DecodeState.guidance.
    guidance_scale: float | None = None

    def _key(self):
        return (self.do_sample, self.pad_token_id, self.eos_token_ids, self.processors_key,
                self.output_scores, self.output_logits, self.attend_len, self.stopping_key,
                None if self.stop_strings is None else self.stop_strings.key, self.guidance_scale)

    def __eq__(self, other):
        return isinstance(other, DecodeOptions) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


@pytree_dataclass
class DecodeState:
    """Greedy/sampling decoding state; every buffer is preallocated to ``max_cache_len``.

    ``tokens[:, :cur_len]`` equals transformers' ``input_ids`` (left-padded prompt, then the
    generated tokens, with ``pad_token_id`` after a row finished).
    """

    tokens: torch.Tensor  # [B, N] int64
    cur_len: torch.Tensor  # [] int64
    prompt_len: torch.Tensor  # [] int64 (padded prompt length)
    max_length: torch.Tensor  # [] int64 (prompt included)
    positions: torch.Tensor  # [B] int64: position id of the most recent token
    done: torch.Tensor  # [B] bool
    keys: torch.Tensor | None  # [B, 2] per-row keys when sampling
    cache: Any
    scores: torch.Tensor | None  # [B, V] processed scores of the latest token (output_scores)
    logits: torch.Tensor | None  # [B, V] raw logits of the latest token (output_logits)
    options: DecodeOptions = static_field()
    # output_attentions / output_hidden_states (None unless asked for): per-layer tuples of the
    # latest step, and the prefill's, which steps pass through so no leaf changes shape.
    attentions: tuple | None = None  # [B, H, 1, attend_len] per layer
    hidden_states: tuple | None = None  # [B, 1, hidden] per layer (+ embeddings)
    prefill_attentions: tuple | None = None
    prefill_hidden_states: tuple | None = None
    # The logits-processor chain's state when it holds a stateful processor (SynthID): the tuple
    # ``options.processors.init_state(B)`` returns, threaded through every step.
    processor_state: Any = None
    # Classifier-free guidance: the unconditional branch (genfn.strategies.guidance.GuidanceState).
    guidance: Any = None

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_cache_len(self) -> int:
        return self.tokens.shape[1]
