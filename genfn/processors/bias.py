"""Sequence bias and bad words: add a bias to a token when the tokens before it match a prefix.

The (possibly multi-token) sequences are compiled at construction into constant tables, grouped
by prefix length exactly as transformers groups them (first-appearance order), so the per-token
bias sums are accumulated in the same order and agree bit for bit. ``NoBadWordsLogitsProcessor``
is a sequence bias of ``-inf``.

Per row: the sequence tables are shared by the batch (the union of every row's sequences) and the
biases are ``[B, S]``, zero where a row does not bias a sequence, so rows may bias different
sequences (or none) in one compiled step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from genfn.processors.base import (ProcessorBase, accepts_transformers_arguments, as_id_list, check_vocab, tail_tokens,
                                   uses_keywords)
from genfn.processors.context import LogitsContext
from genfn.processors.rowvalues import evolve, same_value, set_row
from genfn.state.base import pytree_dataclass

__all__ = ["SequenceBiasLogitsProcessor", "NoBadWordsLogitsProcessor"]


def _is_token(t: Any) -> bool:
    return isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0


def _normalize_sequence_bias(sequence_bias: Any) -> dict[tuple[int, ...], float]:
    """Validate transformers' two spellings (dict of tuples, or list of ``[ids, bias]``)."""
    if (not isinstance(sequence_bias, (dict, list))) or len(sequence_bias) == 0:
        raise ValueError(
            f"`sequence_bias` has to be a non-empty dictionary, or non-empty list of lists but is {sequence_bias}."
        )
    if isinstance(sequence_bias, dict):
        if any(not isinstance(ids, tuple) for ids in sequence_bias):
            raise ValueError(f"`sequence_bias` has to be a dict with tuples as keys, but is {sequence_bias}.")
        if any(len(ids) == 0 or not all(_is_token(t) for t in ids) for ids in sequence_bias):
            raise ValueError(
                f"Each key in `sequence_bias` has to be a non-empty tuple of positive integers, but is {sequence_bias}."
            )
        if any(not isinstance(b, float) for b in sequence_bias.values()):
            raise ValueError(f"`sequence_bias` has to be a dict with floats as values, but is {sequence_bias}.")
        return {tuple(int(t) for t in ids): b for ids, b in sequence_bias.items()}
    for item in sequence_bias:
        ok = (
            len(item) == 2
            and isinstance(item[0], list)
            and all(_is_token(t) for t in item[0])
            and isinstance(item[1], float)
        )
        if not ok:
            raise ValueError(
                "Each element in `sequence_bias` has to be a non-empty list of lists of positive integers and "
                f"float, but is {sequence_bias}."
            )
    return {tuple(int(t) for t in ids): b for ids, b in sequence_bias}


def _layout(sequences: list[tuple[int, ...]]) -> tuple[list[tuple[int, ...]], list[list[tuple[int, ...]]]]:
    """One-token sequences, and the longer ones grouped by prefix length in first-appearance order."""
    singles = [s for s in sequences if len(s) == 1]
    by_length: dict[int, list[tuple[int, ...]]] = {}
    for s in sequences:
        if len(s) > 1:
            by_length.setdefault(len(s) - 1, []).append(s)
    return singles, list(by_length.values())


@accepts_transformers_arguments(uses_keywords("sequence_bias", first_type=(list, dict)),
                                lambda cls, sequence_bias: cls.create(sequence_bias),
                                lambda sequence_bias: {"sequence_bias": _normalize_sequence_bias(sequence_bias)})
@pytree_dataclass
class SequenceBiasLogitsProcessor(ProcessorBase):
    """Add ``bias`` to the last token of a sequence whenever the tokens before it were just generated.

    Construct with ``SequenceBiasLogitsProcessor.create(sequence_bias, vocab_size=None,
    device=None)``; the fields are the precomputed tables. Pass ``vocab_size`` to have out-of-range
    ids rejected up front (transformers checks at the first call, which a compiled step cannot).
    The biases are ``[S]`` for one request, ``[B, S]`` per row.
    """

    has_row_off = True  # zero biases

    single_ids: torch.Tensor  # [S1] int64: one-token sequences
    single_bias: torch.Tensor  # [S1] or [B, S1] float32
    group_prefixes: tuple = ()  # ([S, L] int64, ...) one entry per prefix length L
    group_last: tuple = ()  # ([S] int64, ...)
    group_bias: tuple = ()  # ([S] or [B, S] float32, ...)

    @classmethod
    def create(cls, sequence_bias: Any, vocab_size: int | None = None, device: Any = None):
        table = _normalize_sequence_bias(sequence_bias)
        return cls._from_table(table, vocab_size, device, "sequence_bias")

    @classmethod
    def _from_table(cls, table: dict[tuple[int, ...], float], vocab_size: int | None, device: Any, name: str):
        check_vocab([list(ids) for ids in table], vocab_size, name)
        return cls._from_rows(list(table), [table], device)

    @classmethod
    def _from_rows(cls, sequences: list[tuple[int, ...]], rows: list[dict], device: Any, per_row: bool = False):
        """Tables for ``sequences``; biases from ``rows`` (one dict per row, 0 where absent)."""
        singles, groups = _layout(sequences)

        def biases(seqs):
            values = torch.tensor([[row.get(s, 0.0) for s in seqs] for row in rows], dtype=torch.float32,
                                  device=device).reshape(len(rows), len(seqs))
            return values if per_row else values[0]

        return cls(
            single_ids=torch.tensor([s[0] for s in singles], dtype=torch.int64, device=device),
            single_bias=biases(singles),
            group_prefixes=tuple(torch.tensor([s[:-1] for s in g], dtype=torch.int64, device=device) for g in groups),
            group_last=tuple(torch.tensor([s[-1] for s in g], dtype=torch.int64, device=device) for g in groups),
            group_bias=tuple(biases(g) for g in groups),
        )

    # -- rows ------------------------------------------------------------------------------------

    def sequences(self) -> list[tuple[int, ...]]:
        """The biased sequences, in table order (host read: not for inside a step)."""
        out = [(int(i),) for i in self.single_ids.tolist()]
        for prefixes, last in zip(self.group_prefixes, self.group_last):
            out += [(*map(int, p), int(t)) for p, t in zip(prefixes.tolist(), last.tolist())]
        return out

    def row_tables(self) -> list[dict[tuple[int, ...], float]]:
        """One ``{sequence: bias}`` dict per row (a single one for the scalar form), zeros dropped."""
        seqs = self.sequences()
        biases = [self.single_bias, *self.group_bias]
        rows = torch.cat([b.unsqueeze(0) if b.dim() == 1 else b for b in biases], dim=-1)
        return [{s: v for s, v in zip(seqs, row) if v != 0.0} for row in rows.tolist()]

    def per_row(self, batch_size: int, device: Any = None):
        def rows(b: torch.Tensor) -> torch.Tensor:
            b = b.to(device) if device is not None else b
            return b.expand(batch_size, -1).clone() if b.dim() == 1 or b.shape[0] == 1 else b

        moved = ProcessorBase.per_row(self, batch_size, device)
        return evolve(moved, single_bias=rows(moved.single_bias), group_bias=tuple(rows(b) for b in moved.group_bias))

    def off_row(self):
        return evolve(self, single_bias=torch.zeros_like(self.single_bias),
                      group_bias=tuple(torch.zeros_like(b) for b in self.group_bias))

    def with_row(self, slot, row):
        if type(row) is not type(self):
            raise ValueError(f"cannot put a {type(row).__name__} row into a {type(self).__name__}")
        if not (same_value(self.single_ids, row.single_ids) and same_value(self.group_prefixes, row.group_prefixes)
                and same_value(self.group_last, row.group_last)):
            row = type(self).merge_rows([row], like=self)
        row = row.per_row(1, self.single_ids.device)
        return evolve(self, single_bias=set_row(self.single_bias, row.single_bias, slot),
                      group_bias=set_row(self.group_bias, row.group_bias, slot))

    @classmethod
    def merge_rows(cls, entries: list[Any], device: Any = None, like: Any = None):
        tables = [{} if e is None else e.row_tables()[0] for e in entries]
        if any(e is not None and type(e) is not cls for e in entries):
            raise ValueError(f"cannot merge other kinds into a {cls.__name__}")
        if like is not None:
            sequences = like.sequences()
            extra = sorted({s for t in tables for s in t} - set(sequences))
            if extra:
                raise ValueError(f"a row biases {extra}, which the batch's {cls.__name__} does not hold: rebuild "
                                 "the batch chain with this row")
        else:
            sequences = list(dict.fromkeys(s for t in tables for s in t))
        return cls._from_rows(sequences, tables, device, per_row=True)

    # -- the step --------------------------------------------------------------------------------

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        vocab = logits.shape[-1]
        batch = logits.shape[0]
        device = logits.device
        single_bias = self.single_bias.to(device)
        single_ids = self.single_ids.to(device)
        if single_bias.dim() == 1:
            length_1 = torch.zeros((vocab,), dtype=torch.float32, device=device).scatter(0, single_ids, single_bias)
            bias = torch.zeros_like(logits) + length_1
        else:
            index = single_ids.unsqueeze(0).expand(batch, -1)
            bias = torch.zeros_like(logits).scatter(1, index, single_bias.to(logits.dtype))
        cur_len = ctx.row_cur_len().unsqueeze(1)
        for prefixes, last, seq_bias in zip(self.group_prefixes, self.group_last, self.group_bias):
            prefixes, last, seq_bias = prefixes.to(device), last.to(device), seq_bias.to(device)
            length = prefixes.shape[1]
            recent = tail_tokens(ctx, length)  # [B, L]
            matching = (recent.unsqueeze(1) == prefixes).all(dim=-1) & (cur_len >= length)
            bias = bias.index_add(1, last, torch.where(matching, seq_bias, 0.0).to(bias.dtype))
        return logits + bias


def _bad_words_readback(bad_words_ids, eos_token_id=None) -> dict:
    """transformers' public attributes of a NoBadWordsLogitsProcessor: the bad words as given, and
    the ``-inf`` biases of those that are not a one-token EOS."""
    eos = as_id_list(eos_token_id, "eos_token_id")
    kept = [list(ids) for ids in bad_words_ids if all(list(ids) != [e] for e in eos)]
    return {"bad_word_ids": [list(ids) for ids in bad_words_ids],
            "sequence_bias": {tuple(ids): float("-inf") for ids in kept}}


@accepts_transformers_arguments(uses_keywords("bad_words_ids", first_type=list),
                                lambda cls, bad_words_ids, eos_token_id=None: cls.create(bad_words_ids, eos_token_id),
                                _bad_words_readback)
@pytree_dataclass
class NoBadWordsLogitsProcessor(SequenceBiasLogitsProcessor):
    """Forbid (``-inf``) the last token of any bad-word sequence whose prefix was just generated.

    One-token bad words equal to an EOS id are dropped, as in transformers (banning EOS would make
    generation never end); if nothing is left the processor does nothing. Construct with
    ``NoBadWordsLogitsProcessor.create(bad_words_ids, eos_token_id=None, vocab_size=None,
    device=None)``.
    """

    @classmethod
    def create(cls, bad_words_ids: Any, eos_token_id: Any = None, vocab_size: int | None = None, device: Any = None):
        if not isinstance(bad_words_ids, list) or len(bad_words_ids) == 0:
            raise ValueError(f"`bad_words_ids` has to be a non-empty list, but is {bad_words_ids}.")
        if any(not isinstance(ids, list) for ids in bad_words_ids):
            raise ValueError(f"`bad_words_ids` has to be a list of lists, but is {bad_words_ids}.")
        if any(not all(_is_token(t) for t in ids) for ids in bad_words_ids):
            raise ValueError(
                f"Each list in `bad_words_ids` has to be a list of positive integers, but is {bad_words_ids}."
            )
        eos = as_id_list(eos_token_id, "eos_token_id")
        kept = [ids for ids in bad_words_ids if all(ids != [e] for e in eos)]
        table = {tuple(int(t) for t in ids): float("-inf") for ids in kept}
        return cls._from_table(table, vocab_size, device, "bad_words_ids")
