"""OpenAI's sampling parameters that transformers has no processor for: presence and frequency
penalties, and ``logit_bias``.

OpenAI defines, for each token ``t`` with ``count[t]`` occurrences among the tokens generated so
far (the prompt does not count)::

    logits[t] -= presence_penalty * (count[t] > 0) + frequency_penalty * count[t]

and ``logit_bias`` adds a bias in [-100, 100] to chosen token ids before sampling. Both are
per-row values (0 means off), so requests with different settings share one batch step.
``openai_processors`` validates the user's values and builds the processors a request needs.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import torch

from genfn.processors.base import ProcessorBase, filled_tokens, per_row_column
from genfn.processors.bias import SequenceBiasLogitsProcessor
from genfn.processors.context import LogitsContext
from genfn.processors.rowvalues import RowValue
from genfn.state.base import pytree_dataclass

__all__ = ["LogitBiasLogitsProcessor", "PresenceFrequencyPenaltyLogitsProcessor", "openai_processors"]

PENALTY_RANGE = (-2.0, 2.0)
BIAS_RANGE = (-100.0, 100.0)


def _check_real(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a number in [{low:g}, {high:g}], got {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"`{name}` must be in [{low:g}, {high:g}], got {value!r}")
    return value


@pytree_dataclass
class PresenceFrequencyPenaltyLogitsProcessor(ProcessorBase):
    """Subtract ``presence * [count > 0] + frequency * count`` from each token's logit, where
    ``count`` is how often the token occurs in the row's generated tokens (``ctx.prompt_len``
    onwards; the prompt is not counted, as OpenAI specifies). Both values are in [-2, 2] and may
    be ``[B]`` tensors; 0 leaves a row untouched."""

    row_values = {"presence_penalty": RowValue(torch.float32, 0.0), "frequency_penalty": RowValue(torch.float32, 0.0)}

    presence_penalty: float | torch.Tensor = 0.0
    frequency_penalty: float | torch.Tensor = 0.0

    def __post_init__(self):
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                if value.dim() != 1:
                    raise ValueError(f"per-row `{name}` must be 1-D [batch]")
            else:
                object.__setattr__(self, name, _check_real(name, value, *PENALTY_RANGE))

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        vocab = logits.shape[-1]
        generated = filled_tokens(ctx, vocab, start=ctx.row_prompt_len())  # the rest lands in column V
        counts = torch.zeros((logits.shape[0], vocab + 1), dtype=logits.dtype, device=logits.device)
        counts = counts.scatter_add(1, generated, torch.ones_like(generated, dtype=logits.dtype))[:, :vocab]
        frequency = per_row_column(self.frequency_penalty, logits.dtype, logits.device)
        presence = per_row_column(self.presence_penalty, logits.dtype, logits.device)
        return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


@pytree_dataclass
class LogitBiasLogitsProcessor(SequenceBiasLogitsProcessor):
    """OpenAI's ``logit_bias``: add ``bias[t]`` to the logit of token ``t``.

    A sequence bias of one-token sequences (its own kind, so a request may carry both, and rows
    merge their token sets as sequence bias rows do). Build with ``create(logit_bias,
    vocab_size)``: ``logit_bias`` maps token ids to biases in [-100, 100].
    """

    @classmethod
    def create(cls, logit_bias: Any, vocab_size: int | None = None, device: Any = None):
        if not isinstance(logit_bias, dict):
            raise TypeError(f"`logit_bias` must be a dict of token id -> bias, got {type(logit_bias).__name__}")
        if not logit_bias:
            raise ValueError("`logit_bias` is empty: pass None for no bias")
        table = {}
        for token, bias in logit_bias.items():
            if isinstance(token, bool):
                raise TypeError(f"`logit_bias` keys must be int token ids, got {token!r}")
            try:
                token_id = operator.index(token)
            except TypeError:
                raise TypeError(f"`logit_bias` keys must be int token ids, got {token!r}") from None
            if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                raise ValueError(f"`logit_bias` token id {token_id} is outside the vocabulary [0, {vocab_size})")
            table[(token_id,)] = _check_real(f"logit_bias[{token_id}]", bias, *BIAS_RANGE)
        return cls._from_table(table, vocab_size, device, "logit_bias")


def openai_processors(presence_penalty: Any = 0.0, frequency_penalty: Any = 0.0, logit_bias: Any = None,
                      vocab_size: int | None = None, device: Any = None) -> list:
    """The processors a request's OpenAI settings need (none at their defaults), validated:
    ``TypeError``/``ValueError`` naming the argument and its allowed range."""
    presence = _check_real("presence_penalty", presence_penalty, *PENALTY_RANGE)
    frequency = _check_real("frequency_penalty", frequency_penalty, *PENALTY_RANGE)
    out: list = []
    if presence != 0.0 or frequency != 0.0:
        out.append(PresenceFrequencyPenaltyLogitsProcessor(presence, frequency))
    if logit_bias is not None:
        bias = LogitBiasLogitsProcessor.create(logit_bias, vocab_size, device)
        if any(v != 0.0 for v in bias.row_tables()[0].values()):
            out.append(bias)
    return out
