"""``GenerationRequest``: everything ``generate`` resolved, handed to a strategy's ``init``."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["GenerationRequest", "StepTrace"]


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """A fully resolved call: inputs, lengths, special tokens, processors and output flags.

    ``config`` is the resolved ``GenerationConfig`` (defaults applied) for anything a strategy
    needs beyond the fields spelled out here (``num_beams``, ``length_penalty``, ...).
    """

    input_ids: torch.Tensor  # [B, P] left padded
    attention_mask: torch.Tensor  # [B, P]
    config: Any
    max_length: int  # prompt included
    min_length: int
    max_cache_len: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    processors: Any  # ProcessorChain or None (a pytree: its kinds key compiled steps, its numbers are leaves)
    keys: torch.Tensor | None  # [B, 2] when sampling
    output_scores: bool = False
    output_logits: bool = False
    output_attentions: bool = False
    output_hidden_states: bool = False
    stop_strings: Any = None  # genfn.stopping.StopStringMatcher, checked inside the step
    guidance: Any = None  # genfn.strategies.guidance.GuidanceSpec when guidance_scale != 1
    encoder: Any = None  # genfn.strategies.encoder_decoder.EncoderInputs for an encoder-decoder model
    tokenizer_size: int | None = None  # len(tokenizer) when one is known: checked against the logits' width
    # Structured outputs: the host-side matchers (genfn.structured.rows.GrammarRows) and the first
    # token's [B, ceil(V / 32)] int32 mask, or None when no row is constrained.
    grammar: Any = None
    grammar_mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1]


@dataclasses.dataclass
class StepTrace:
    """What the driver collected between steps for the output (only what was asked for)."""

    scores: list = dataclasses.field(default_factory=list)
    logits: list = dataclasses.field(default_factory=list)
    attentions: list = dataclasses.field(default_factory=list)
    hidden_states: list = dataclasses.field(default_factory=list)
    cross_attentions: list = dataclasses.field(default_factory=list)  # encoder-decoder models
