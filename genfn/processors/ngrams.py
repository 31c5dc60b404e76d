"""N-gram bans: never repeat an n-gram of the sequence, or of the encoder input.

Both compare the last ``n - 1`` tokens of each row with every ``(n - 1)``-gram of a source (the
buffer itself, or the encoder ids) and ban the token that followed a match. The comparison is
right-aligned on the banned position ``e``: the window before it matches when
``source[e - 1 - i] == tokens[cur_len - 1 - i]`` for every ``i < n - 1``. That is one shifted
comparison per ``i < max_ngram_size - 1`` over the whole static buffer, so ``n`` can be a per-row
value (``0`` = off) under a static maximum, and positions past ``cur_len`` are masked out, which
reproduces transformers' dictionary lookup without a Python loop.
"""

from __future__ import annotations

import torch

from genfn.processors.base import ProcessorBase, accepts_transformers_arguments, token_set_mask, uses_keywords
from genfn.processors.context import LogitsContext
from genfn.processors.rowvalues import RowValue, evolve
from genfn.state.base import pytree_dataclass, static_field

__all__ = ["NoRepeatNGramLogitsProcessor", "EncoderNoRepeatNGramLogitsProcessor"]


def _check_size(value, name: str) -> None:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise ValueError(f"per-row `{name}` must be 1-D [batch], got shape {tuple(value.shape)}")
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{name}` has to be a strictly positive integer, but is {value}")


def _banned_after_matches(
    logits: torch.Tensor,
    source: torch.Tensor,
    source_len: torch.Tensor,
    ctx: LogitsContext,
    n: torch.Tensor,
    max_n: int,
) -> torch.Tensor:
    """``[B, V]`` bool: tokens ``source[b, e]`` whose ``n[b] - 1`` predecessors equal the last
    ``n[b] - 1`` tokens of row ``b``, for ``n[b] - 1 <= e < source_len[b]`` (``n[b] <= 0``: none).

    ``source`` is ``[B, L]``; ``n`` and ``source_len`` are ``[B]``.
    """
    vocab = logits.shape[-1]
    batch, width = source.shape
    cur_len = ctx.row_cur_len()
    n = n.to(device=source.device, dtype=torch.int64)
    pos = torch.arange(width, device=source.device).unsqueeze(0)
    match = (pos >= (n - 1).unsqueeze(1)) & (pos < source_len.reshape(-1, 1)) & (n > 0).unsqueeze(1)
    last = ctx.tokens.shape[1] - 1
    for i in range(max_n - 1):
        before = torch.nn.functional.pad(source, (i + 1, 0), value=-1)[:, :width]  # source[e - 1 - i]
        recent = ctx.tokens.gather(1, (cur_len - 1 - i).clamp(min=0, max=last).unsqueeze(1))  # [B, 1]
        needed = (i < n - 1).unsqueeze(1)
        match = match & ((before == recent) | ~needed)
    banned_ids = torch.where(match, source.clamp(min=0, max=vocab), vocab)
    return token_set_mask(banned_ids, vocab)


def _as_rows(value, batch: int, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.int64).reshape(-1).expand(batch)
    return torch.full((batch,), value, dtype=torch.int64, device=device)


class _NGramRows:
    """``max_ngram_size`` is static (it sets the number of comparisons): merged rows take the
    largest, and a row replaced by ``with_row`` must fit under it."""

    def __post_init__(self):
        _check_size(self.ngram_size, self._size_name)
        if self.max_ngram_size is None:
            if isinstance(self.ngram_size, torch.Tensor):
                raise ValueError(f"a per-row `{self._size_name}` needs a static `max_ngram_size`")
            object.__setattr__(self, "max_ngram_size", int(self.ngram_size))

    @classmethod
    def merge_rows(cls, entries, device=None, like=None):
        present = [e for e in entries if e is not None]
        largest = max((e.max_ngram_size for e in present), default=1)
        if like is not None:
            if largest > like.max_ngram_size:
                raise ValueError(f"a row's n-gram size {largest} exceeds the batch's max_ngram_size "
                                 f"{like.max_ngram_size}")
            largest = like.max_ngram_size
        widened = [None if e is None else evolve(e, max_ngram_size=largest) for e in entries]
        return ProcessorBase.merge_rows.__func__(cls, widened, device, like)

    def with_row(self, slot, row):
        if row.max_ngram_size > self.max_ngram_size:
            raise ValueError(f"the row's n-gram size {row.max_ngram_size} exceeds the batch's max_ngram_size "
                             f"{self.max_ngram_size}")
        return ProcessorBase.with_row(self, slot, evolve(row, max_ngram_size=self.max_ngram_size))


@pytree_dataclass
class NoRepeatNGramLogitsProcessor(_NGramRows, ProcessorBase):
    """Forbid any token that would repeat an n-gram already present in the sequence.

    ``ngram_size`` is a number, or a ``[B]`` tensor (``0`` = off for a row) under the static
    ``max_ngram_size``.
    """

    _size_name = "ngram_size"
    row_values = {"ngram_size": RowValue(torch.int64, 0)}

    ngram_size: int | torch.Tensor
    max_ngram_size: int | None = static_field(None)

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        batch = logits.shape[0]
        n = _as_rows(self.ngram_size, batch, logits.device)
        banned = _banned_after_matches(logits, ctx.tokens, ctx.row_cur_len(), ctx, n, self.max_ngram_size)
        return logits.masked_fill(banned, -float("inf"))


@accepts_transformers_arguments(
    uses_keywords("encoder_ngram_size"),
    lambda cls, encoder_ngram_size, encoder_input_ids: cls(encoder_ngram_size, encoder_input_ids),
    lambda encoder_ngram_size, encoder_input_ids: {"batch_size": encoder_input_ids.reshape(-1, encoder_input_ids.shape[-1]).shape[0]})
@pytree_dataclass
class EncoderNoRepeatNGramLogitsProcessor(_NGramRows, ProcessorBase):
    """Forbid completing any n-gram that occurs in the encoder input (used to stop a summarizer
    from copying long spans).

    ``encoder_input_ids`` is a constant ``[B_enc, L]`` tensor (rows map to the beam-expanded batch
    as ``row // (B // B_enc)``), or ``None`` to use each row's prompt columns of the buffer, which
    is what transformers passes for a decoder-only model.
    """

    _size_name = "encoder_ngram_size"
    row_values = {"ngram_size": RowValue(torch.int64, 0)}

    ngram_size: int | torch.Tensor
    encoder_input_ids: torch.Tensor | None = None
    max_ngram_size: int | None = static_field(None)

    def __post_init__(self):
        _NGramRows.__post_init__(self)
        enc = self.encoder_input_ids
        if enc is not None and enc.dim() == 1:
            object.__setattr__(self, "encoder_input_ids", enc.unsqueeze(0))

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        batch = logits.shape[0]
        n = _as_rows(self.ngram_size, batch, logits.device)
        enc = self.encoder_input_ids
        if enc is None:
            source, source_len = ctx.tokens, ctx.row_prompt_len()
        else:
            source = enc.to(logits.device).repeat_interleave(batch // enc.shape[0], dim=0)
            source_len = torch.full((batch,), source.shape[1], dtype=torch.int64, device=logits.device)
        # transformers looks up a prefix of exactly n - 1 tokens: none exists before then.
        n = torch.where(ctx.row_cur_len() < n - 1, 0, n)
        banned = _banned_after_matches(logits, source, source_len, ctx, n, self.max_ngram_size)
        return logits.masked_fill(banned, -float("inf"))
