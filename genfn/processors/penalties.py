"""Penalties that rescale the logits of particular tokens: repetition, encoder repetition, and
the exponential length penalty on EOS.

Repetition penalties gather the logits of every token id seen so far and scatter the rescaled
values back. Over the static buffer, columns that must not count (garbage past ``cur_len``, the
left padding transformers ignores) are redirected to a spare column ``V`` that is dropped, so
the gather/scatter has a fixed shape and the result equals transformers' on ``input_ids``.

Penalties, lengths and decay settings are per-row values; a penalty of 1 (or a decay factor of
1) leaves a row untouched.
"""

from __future__ import annotations

from typing import Any

import torch

from genfn.processors.base import (ProcessorBase, accepts_transformers_arguments, as_id_list, filled_tokens, per_row_column,
                                   uses_keywords)
from genfn.processors.context import LogitsContext
from genfn.processors.forcing import TokenSetRows
from genfn.processors.rowvalues import RowValue
from genfn.state.base import pytree_dataclass, static_field

__all__ = [
    "RepetitionPenaltyLogitsProcessor",
    "EncoderRepetitionPenaltyLogitsProcessor",
    "ExponentialDecayLengthPenalty",
]


def _rescale_at(logits: torch.Tensor, ids: torch.Tensor, mul: Any, div: Any) -> torch.Tensor:
    """Multiply negative / divide positive logits at ``ids`` (``V`` = ignored), like transformers."""
    vocab = logits.shape[-1]
    padded = torch.nn.functional.pad(logits, (0, 1))
    ids = ids.clamp(max=vocab)
    score = torch.gather(padded, 1, ids)
    score = torch.where(score < 0, score * mul, score / div)
    return padded.scatter(1, ids, score)[..., :vocab]


@pytree_dataclass
class RepetitionPenaltyLogitsProcessor(ProcessorBase):
    """Penalize every token already in the sequence (CTRL-style): ``x * p`` if ``x < 0`` else ``x / p``.

    ``prompt_ignore_length`` skips leading columns: an int for all rows, or a ``[B]`` tensor per
    row. transformers' ``generate`` passes the left-padding length of each row (from the
    attention mask) so that pad tokens are not penalized. ``penalty`` may be a ``[B]`` tensor.
    """

    row_values = {"penalty": RowValue(torch.float32, 1.0), "prompt_ignore_length": RowValue(torch.int64, None, none_as=0)}

    penalty: float | torch.Tensor
    prompt_ignore_length: int | torch.Tensor | None = None

    def __post_init__(self):
        p = self.penalty
        if isinstance(p, torch.Tensor):
            if p.dim() != 1:
                raise ValueError("per-row `penalty` must be 1-D [batch]")
        elif not isinstance(p, float) or not p > 0:
            raise ValueError(f"`penalty` has to be a strictly positive float, but is {p}")
        ign = self.prompt_ignore_length
        if isinstance(ign, int) and ign < 0:
            raise ValueError(f"`prompt_ignore_length` has to be a positive integer, but is {ign}")
        if isinstance(ign, torch.Tensor) and ign.dim() != 1:
            raise ValueError("`prompt_ignore_length` must be 1D")

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        vocab = logits.shape[-1]
        ids = filled_tokens(ctx, vocab, start=self.prompt_ignore_length)
        p = per_row_column(self.penalty, logits.dtype, logits.device)
        return _rescale_at(logits, ids, p, p)


@accepts_transformers_arguments(
    uses_keywords("penalty"),
    lambda cls, penalty, encoder_input_ids=None: cls(encoder_penalty=penalty, encoder_input_ids=encoder_input_ids))
@pytree_dataclass
class EncoderRepetitionPenaltyLogitsProcessor(ProcessorBase):
    """The opposite of the repetition penalty, over the encoder (or prompt) ids: it *boosts*
    tokens of the source, to favour copying.

    Built as transformers builds it, ``(penalty, encoder_input_ids)``. ``penalty`` then reads back
    transformers' value, ``1 / penalty`` (transformers stores the inverse); the value as given is
    the field ``encoder_penalty``, the per-row number a chain carries (``[B]`` per row, 1 = off).

    ``encoder_input_ids`` is a constant ``[B_enc, L]`` tensor (rows are repeated to the
    beam-expanded batch), or ``None`` to read the prompt columns ``< ctx.prompt_len`` of the
    buffer, which is what transformers passes for a decoder-only model.
    """

    row_values = {"encoder_penalty": RowValue(torch.float64, 1.0)}

    encoder_penalty: float | torch.Tensor
    encoder_input_ids: torch.Tensor | None = None

    def __post_init__(self):
        if isinstance(self.encoder_penalty, torch.Tensor):
            if self.encoder_penalty.dim() != 1:
                raise ValueError("per-row `penalty` must be 1-D [batch]")
        elif not isinstance(self.encoder_penalty, float) or not self.encoder_penalty > 0:
            raise ValueError(f"`penalty` has to be a strictly positive float, but is {self.encoder_penalty}")

    @property
    def penalty(self) -> float | torch.Tensor:
        """transformers' attribute: the inverse of the penalty given (per row when that is ``[B]``)."""
        if isinstance(self.encoder_penalty, torch.Tensor):
            return 1 / self.encoder_penalty.to(torch.float64)
        return 1 / self.encoder_penalty

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        # transformers stores 1 / penalty as a Python float (double) and multiplies in float32.
        inv = self.penalty
        if isinstance(inv, torch.Tensor):
            inv = inv.to(device=logits.device).to(logits.dtype).unsqueeze(1)
        enc = self.encoder_input_ids
        if enc is None:
            n = ctx.tokens.shape[1]
            pos = torch.arange(n, device=ctx.tokens.device).unsqueeze(0)
            in_prompt = pos < ctx.row_prompt_len().unsqueeze(1)
            ids = torch.where(in_prompt, ctx.tokens, torch.full_like(ctx.tokens, logits.shape[-1]))
        else:
            ids = enc.to(logits.device)
            if logits.shape[0] > ids.shape[0]:
                ids = ids.repeat_interleave(logits.shape[0] // ids.shape[0], dim=0)
        return _rescale_at(logits, ids, inv, inv)


@accepts_transformers_arguments(
    uses_keywords("exponential_decay_length_penalty", "input_ids_seq_length", first_type=(tuple, list)),
    lambda cls, exponential_decay_length_penalty, eos_token_id, input_ids_seq_length: cls.from_config(
        exponential_decay_length_penalty, eos_token_id, input_ids_seq_length),
    lambda exponential_decay_length_penalty, eos_token_id, input_ids_seq_length: {
        "regulation_start": int(exponential_decay_length_penalty[0]) + int(input_ids_seq_length),
        "regulation_factor": float(exponential_decay_length_penalty[1])})
@pytree_dataclass
class ExponentialDecayLengthPenalty(TokenSetRows, ProcessorBase):
    """After ``start_index`` generated tokens, raise the EOS logits by ``|x| * (factor**i - 1)``
    where ``i`` counts the steps past the start, so ending becomes ever more likely.

    ``prompt_len`` is the prompt length the start is relative to (transformers'
    ``input_ids_seq_length``); ``None`` reads ``ctx.prompt_len`` so the compiled step does not
    depend on it.
    """

    _ids_field, _mask_field = "eos_token_id", "eos_rows"
    row_values = {
        "start_index": RowValue(torch.int64, None),
        "decay_factor": RowValue(torch.float64, 1.0),
        "prompt_len": RowValue(torch.int64, None),
    }

    start_index: int | torch.Tensor
    decay_factor: float | torch.Tensor
    eos_token_id: tuple[int, ...] = static_field()
    prompt_len: int | torch.Tensor | None = None
    eos_rows: torch.Tensor | None = None  # [B, E] bool: which of the EOS ids are each row's

    def __post_init__(self):
        object.__setattr__(self, "eos_token_id", as_id_list(self.eos_token_id, "eos_token_id"))
        if not self.eos_token_id:
            raise ValueError("`eos_token_id` has to be a list of positive integers, but is empty")

    @classmethod
    def from_config(cls, exponential_decay_length_penalty, eos_token_id, input_ids_seq_length=None):
        """Build from transformers' ``(start_index, decay_factor)`` tuple."""
        start, factor = exponential_decay_length_penalty
        return cls(int(start), float(factor), as_id_list(eos_token_id, "eos_token_id"), input_ids_seq_length)

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        device = logits.device
        if self.prompt_len is None:
            prompt_len = ctx.row_prompt_len().unsqueeze(1)
        else:
            prompt_len = per_row_column(self.prompt_len, torch.int64, device)
        regulation_start = per_row_column(self.start_index, torch.int64, device) + prompt_len
        cur_len = ctx.row_cur_len().unsqueeze(1)
        active = cur_len > regulation_start
        steps = (cur_len - regulation_start).to(torch.float64)
        # Python evaluates pow(factor, i) - 1 in double; the product with float32 logits then
        # happens in float32.
        factor = self.decay_factor
        if isinstance(factor, torch.Tensor):
            factor = factor.to(device=device, dtype=torch.float64).unsqueeze(1)
        else:
            factor = torch.full((), factor, dtype=torch.float64, device=device)
        coef = (torch.pow(factor, steps) - 1).to(logits.dtype)
        eos = torch.tensor(self.eos_token_id, device=logits.device).unsqueeze(0).expand(logits.shape[0], -1)
        eos_scores = logits.gather(1, eos)
        penalty = torch.abs(eos_scores) * coef
        penalty = penalty.masked_fill(~torch.isfinite(eos_scores), 0.0)
        if self.eos_rows is not None:
            penalty = penalty.masked_fill(~self.eos_rows.to(logits.device), 0.0)
        penalties = torch.zeros_like(logits).scatter(1, eos, penalty)
        return torch.where(active, logits + penalties, logits)
