"""Processors that force or forbid tokens depending on the position only.

Minimum lengths forbid EOS, forced BOS/EOS leave a single allowed token, suppression forbids a
fixed set. In transformers each checks ``input_ids.shape[-1]`` with a Python ``if``; here the
condition is a 0-d bool tensor of ``ctx.cur_len`` and the choice a ``torch.where``, so one compiled
step serves every position.

Positions relative to the prompt (min new tokens, begin suppression) take the prompt length as a
static int, or ``None`` to read ``ctx.prompt_len`` so the compiled step does not depend on it.
"""

from __future__ import annotations

import math

import torch

from genfn.processors.base import ProcessorBase, as_id_list, vocab_mask
from genfn.processors.context import LogitsContext
from genfn.state.base import pytree_dataclass, static_field

__all__ = [
    "MinLengthLogitsProcessor",
    "MinNewTokensLengthLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor",
    "SuppressTokensLogitsProcessor",
    "SuppressTokensAtBeginLogitsProcessor",
]


def _ids_tensor(ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64, device=device)


def _only(ids: tuple[int, ...], logits: torch.Tensor) -> torch.Tensor:
    """``[1, V]`` a row that is 0 at ``ids`` and ``-inf`` elsewhere."""
    allowed = vocab_mask(_ids_tensor(ids, logits.device), logits.shape[-1], logits.device)
    return torch.where(allowed, 0.0, -math.inf).to(logits.dtype).unsqueeze(0)


def _forbid(ids: tuple[int, ...], logits: torch.Tensor, when: torch.Tensor | bool = True) -> torch.Tensor:
    mask = vocab_mask(_ids_tensor(ids, logits.device), logits.shape[-1], logits.device)
    return torch.where(mask & when, -math.inf, logits)


def _check_non_negative(value: int, name: str, what: str = "a non-negative") -> None:
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"`{name}` has to be {what} integer, but is {value}")


@pytree_dataclass
class MinLengthLogitsProcessor(ProcessorBase):
    """Forbid EOS while the whole sequence (prompt included) is shorter than ``min_length``."""

    min_length: int = static_field()
    eos_token_id: tuple[int, ...] = static_field()

    def __post_init__(self):
        _check_non_negative(self.min_length, "min_length")
        object.__setattr__(self, "eos_token_id", as_id_list(self.eos_token_id, "eos_token_id"))

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        return _forbid(self.eos_token_id, logits, ctx.cur_len < self.min_length)


@pytree_dataclass
class MinNewTokensLengthLogitsProcessor(ProcessorBase):
    """Forbid EOS until ``min_new_tokens`` tokens were generated after the prompt."""

    min_new_tokens: int = static_field()
    eos_token_id: tuple[int, ...] = static_field()
    prompt_length_to_skip: int | None = static_field(None)

    def __post_init__(self):
        _check_non_negative(self.min_new_tokens, "min_new_tokens", "a positive")
        if self.prompt_length_to_skip is not None:
            _check_non_negative(self.prompt_length_to_skip, "prompt_length_to_skip", "a positive")
        object.__setattr__(self, "eos_token_id", as_id_list(self.eos_token_id, "eos_token_id"))

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        skip = ctx.prompt_len if self.prompt_length_to_skip is None else self.prompt_length_to_skip
        return _forbid(self.eos_token_id, logits, ctx.cur_len - skip < self.min_new_tokens)


@pytree_dataclass
class ForcedBOSTokenLogitsProcessor(ProcessorBase):
    """At the first generated position of a one-token (decoder start) sequence, allow only BOS."""

    bos_token_id: int = static_field()

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        return torch.where(ctx.cur_len == 1, _only((self.bos_token_id,), logits), logits)


@pytree_dataclass
class ForcedEOSTokenLogitsProcessor(ProcessorBase):
    """When the next token is the last one ``max_length`` allows, allow only EOS."""

    max_length: int = static_field()
    eos_token_id: tuple[int, ...] = static_field()

    def __post_init__(self):
        object.__setattr__(self, "eos_token_id", as_id_list(self.eos_token_id, "eos_token_id"))

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        return torch.where(ctx.cur_len == self.max_length - 1, _only(self.eos_token_id, logits), logits)


@pytree_dataclass
class SuppressTokensLogitsProcessor(ProcessorBase):
    """Forbid a fixed set of tokens at every step."""

    suppress_tokens: tuple[int, ...] = static_field()

    def __post_init__(self):
        object.__setattr__(self, "suppress_tokens", as_id_list(list(self.suppress_tokens), "suppress_tokens"))

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        return _forbid(self.suppress_tokens, logits)


@pytree_dataclass
class SuppressTokensAtBeginLogitsProcessor(ProcessorBase):
    """Forbid a set of tokens at the first generated position only (e.g. a blank or EOS first).

    The position is ``begin_index`` if given, else ``ctx.prompt_len + begin_offset`` (transformers
    uses the prompt length, plus one when a forced BOS fills the first slot of a one-token prompt).
    """

    begin_suppress_tokens: tuple[int, ...] = static_field()
    begin_index: int | None = static_field(None)
    begin_offset: int = static_field(0)

    def __post_init__(self):
        object.__setattr__(
            self, "begin_suppress_tokens", as_id_list(list(self.begin_suppress_tokens), "begin_suppress_tokens")
        )

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        begin = ctx.prompt_len + self.begin_offset if self.begin_index is None else self.begin_index
        return _forbid(self.begin_suppress_tokens, logits, ctx.cur_len == begin)
