"""Sequence bias and bad words: add a bias to a token when the tokens before it match a prefix.

The (possibly multi-token) sequences are compiled at construction into constant tables, grouped
by prefix length exactly as transformers groups them (first-appearance order), so the per-token
bias sums are accumulated in the same order and agree bit for bit. ``NoBadWordsLogitsProcessor``
is a sequence bias of ``-inf``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from genfn.processors.base import ProcessorBase, as_id_list, tail_tokens
from genfn.processors.context import LogitsContext
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


@pytree_dataclass
class SequenceBiasLogitsProcessor(ProcessorBase):
    """Add ``bias`` to the last token of a sequence whenever the tokens before it were just generated.

    Construct with ``SequenceBiasLogitsProcessor.create(sequence_bias, vocab_size=None,
    device=None)``; the fields are the precomputed tables. Pass ``vocab_size`` to have out-of-range
    ids rejected up front (transformers checks at the first call, which a compiled step cannot).
    """

    single_ids: torch.Tensor  # [S1] int64: one-token sequences
    single_bias: torch.Tensor  # [S1] float32
    groups: tuple  # ((prefixes [S, L] int64, last [S] int64, bias [S] float32), ...) per prefix length L

    @classmethod
    def create(cls, sequence_bias: Any, vocab_size: int | None = None, device: Any = None):
        table = _normalize_sequence_bias(sequence_bias)
        return cls._from_table(table, vocab_size, device)

    @classmethod
    def _from_table(cls, table: dict[tuple[int, ...], float], vocab_size: int | None, device: Any):
        if vocab_size is not None:
            invalid = [t for ids in table for t in ids if t >= vocab_size]
            if invalid:
                raise ValueError(
                    f"The model vocabulary size is {vocab_size}, but the following tokens were being biased: {invalid}"
                )
        singles = [(ids[0], b) for ids, b in table.items() if len(ids) == 1]
        single_ids = torch.tensor([i for i, _ in singles], dtype=torch.int64, device=device)
        single_bias = torch.tensor([b for _, b in singles], dtype=torch.float32, device=device)
        by_length: dict[int, list[tuple[tuple[int, ...], float]]] = {}
        for ids, b in table.items():
            if len(ids) > 1:
                by_length.setdefault(len(ids) - 1, []).append((ids, b))
        groups = tuple(
            (
                torch.tensor([ids[:-1] for ids, _ in group], dtype=torch.int64, device=device),
                torch.tensor([ids[-1] for ids, _ in group], dtype=torch.int64, device=device),
                torch.tensor([b for _, b in group], dtype=torch.float32, device=device),
            )
            for group in by_length.values()
        )
        return cls(single_ids, single_bias, groups)

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        vocab = logits.shape[-1]
        device = logits.device
        length_1 = torch.zeros((vocab,), dtype=torch.float32, device=device)
        length_1 = length_1.scatter(0, self.single_ids.to(device), self.single_bias.to(device))
        bias = torch.zeros_like(logits) + length_1
        for prefixes, last, seq_bias in self.groups:
            prefixes, last, seq_bias = prefixes.to(device), last.to(device), seq_bias.to(device)
            length = prefixes.shape[1]
            recent = tail_tokens(ctx, length)  # [B, L]
            matching = (recent.unsqueeze(1) == prefixes).all(dim=-1) & (ctx.cur_len >= length)
            bias = bias.index_add(1, last, torch.where(matching, seq_bias, 0.0).to(bias.dtype))
        return logits + bias


@pytree_dataclass
class NoBadWordsLogitsProcessor(SequenceBiasLogitsProcessor):
    """Forbid (``-inf``) the last token of any bad-word sequence whose prefix was just generated.

    One-token bad words equal to an EOS id are dropped, as in transformers (banning EOS would make
    generation never end). Construct with ``NoBadWordsLogitsProcessor.create(bad_words_ids,
    eos_token_id=None, vocab_size=None, device=None)``.
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
        if not table:
            raise ValueError(
                f"`sequence_bias` has to be a non-empty dictionary, or non-empty list of lists but is {table}."
            )
        return cls._from_table(table, vocab_size, device)
