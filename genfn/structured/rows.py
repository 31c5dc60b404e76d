"""The host side of a constrained batch: one matcher per row, and the bitmask the next step reads.

``GrammarRows`` is what the driver (and the batching manager) holds beside a decoding state.
Between steps it reads each row's new tokens, lets the row's matcher accept them, and fills the
``[B, ceil(V / 32)]`` int32 mask of the next step (:func:`genfn.processors.grammar.apply_token_bitmask`
applies it inside the step). A free row (no grammar) and a finished row get all ones, so the
constraint never changes what a free row computes.

EOS: a grammar's engine knows one end token (the tokenizer's); a request may stop on several
(``eos_token_id`` lists). Each row's mask allows all of the request's EOS ids exactly when its
matcher can terminate, and none otherwise; a complete grammar that admits nothing more leaves
only EOS, so the row ends on the next token (or at once when the request has no EOS id).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from genfn.processors.grammar import FREE_ROW
from genfn.structured import Grammar, Matcher, bitmask_width

__all__ = ["GrammarRows", "GrammarViolation", "constraint_for_rows", "mask_allows"]


class GrammarViolation(RuntimeError):
    """A row produced a token its grammar does not allow (a processor forced it past the mask)."""


def mask_allows(row: torch.Tensor, token: int) -> bool:
    """Whether the host mask ``row`` ([W] int32) allows ``token``."""
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def _set_bit(row: torch.Tensor, token: int, on: bool) -> None:
    word, bit = divmod(token, 32)
    value = int(row[word]) & 0xFFFFFFFF
    value = value | (1 << bit) if on else value & ~(1 << bit)
    row[word] = value - (1 << 32) if value >= 1 << 31 else value


class GrammarRows:
    """Matchers for the rows of a batch (``None``: a free row), their consumed lengths and the mask.

    ``start[b]``: the column of row ``b``'s first generated token (its prompt's end). ``eos_token_ids``:
    the request's end tokens (one tuple for every row, or one per row).
    """

    def __init__(self, matchers: Sequence[Matcher | None], vocab_size: int, start: Sequence[int],
                 eos_token_ids: Sequence[int] | Sequence[Sequence[int]], device: Any = None):
        self.matchers = list(matchers)
        self.vocab_size = int(vocab_size)
        self.width = bitmask_width(vocab_size)
        self.start = [int(s) for s in start]
        self.consumed = list(self.start)
        batch = len(self.matchers)
        if eos_token_ids and isinstance(next(iter(eos_token_ids)), (list, tuple)):
            self.eos = [tuple(int(t) for t in ids) for ids in eos_token_ids]
        else:
            self.eos = [tuple(int(t) for t in eos_token_ids)] * batch
        self.finished = [m is None for m in self.matchers]
        self.device = device
        self.engine_eos = [None] * batch

    @classmethod
    def for_grammars(cls, grammars: Sequence[Grammar | None], vocab_size: int, start: Sequence[int],
                     eos_token_ids, device: Any = None) -> GrammarRows:
        rows = cls([None if g is None else g.matcher() for g in grammars], vocab_size, start, eos_token_ids, device)
        rows.engine_eos = [None if g is None else g.eos_token_id for g in grammars]
        return rows

    @property
    def batch_size(self) -> int:
        return len(self.matchers)

    @property
    def constrained(self) -> bool:
        return any(m is not None for m in self.matchers)

    # -- the mask -----------------------------------------------------------------------------------

    def fill(self, rows: Sequence[int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``[B, W]`` int32 CPU mask for the next token of every row (or of ``rows``, others all ones)."""
        mask = torch.full((self.batch_size, self.width), FREE_ROW, dtype=torch.int32) if out is None else out
        for b in range(self.batch_size) if rows is None else rows:
            if not self.finished[b]:
                self.fill_row(b, mask[b])
        return mask

    def fill_row(self, b: int, row: torch.Tensor) -> None:
        """Row ``b``'s next-token mask into ``row`` ([W] int32, contiguous, CPU)."""
        matcher = self.matchers[b]
        matcher.fill_bitmask(row)
        end_allowed = matcher.can_terminate()
        engine_eos = self.engine_eos[b]
        if engine_eos is not None and 0 <= engine_eos < self.vocab_size and engine_eos not in self.eos[b]:
            _set_bit(row, engine_eos, False)
        for token in self.eos[b]:
            if 0 <= token < self.vocab_size:
                _set_bit(row, token, end_allowed)

    def walk_drafts(self, b: int, drafts: Sequence[int], masks: torch.Tensor) -> int:
        """Fill ``masks[i]`` ([k + 1, W] int32, CPU) with row ``b``'s mask after ``drafts[:i]``; return
        how many drafts the grammar allows (the walk stops at the first it refuses, and after an EOS).
        The matcher ends where it started: speculative decoding verifies the drafts under these masks."""
        matcher, accepted, usable = self.matchers[b], 0, len(drafts)
        for i in range(len(drafts) + 1):
            self.fill_row(b, masks[i])
            if i == len(drafts):
                break
            token = drafts[i]
            if not mask_allows(masks[i], token):
                usable = i
                break
            if token in self.eos[b]:
                usable = i + 1  # the row ends here if the target agrees; later positions are never read
                break
            if not matcher.accept(token):
                usable = i
                break
            accepted += 1
        matcher.rollback(accepted)
        return usable

    def mask(self) -> torch.Tensor:
        """The next mask on the batch's device."""
        mask = self.fill()
        return mask if self.device is None else mask.to(self.device)

    # -- tokens -------------------------------------------------------------------------------------

    def accept(self, b: int, tokens: Sequence[int]) -> None:
        """Row ``b`` appended ``tokens``: its matcher takes them; an EOS finishes the row."""
        matcher = self.matchers[b]
        for token in tokens:
            if self.finished[b]:
                return
            if token in self.eos[b]:
                self.finished[b] = True
                return
            if not matcher.accept(token):
                raise GrammarViolation(f"row {b} produced token {token}, which its grammar does not allow "
                                       f"({matcher.error() or 'not in the mask'}); a logits processor or a forced "
                                       "token overrode the grammar mask")
        self.consumed[b] += len(tokens)

    def sync(self, b: int, generated: Sequence[int]) -> None:
        """Bring row ``b``'s matcher to exactly ``generated`` (the row's generated tokens, its source
        of truth): accept what it has not seen, roll back what was dropped. Continuous batching calls
        this before each mask, so a preempted, recomputed or trimmed request never desynchronizes."""
        seen = self.consumed[b] - self.start[b]
        if len(generated) < seen:
            self.matchers[b].rollback(seen - len(generated))
            self.consumed[b] = self.start[b] + len(generated)
            self.finished[b] = False
        elif len(generated) > seen:
            self.accept(b, list(generated[seen:]))

    def new_tokens(self, state, lengths: Sequence[int]) -> list[list[int]]:
        """Each row's tokens from its consumed length up to ``lengths`` (read from ``state.tokens``)."""
        rows = [b for b in range(self.batch_size) if not self.finished[b] and lengths[b] > self.consumed[b]]
        if not rows:
            return [[] for _ in range(self.batch_size)]
        tokens = state.tokens
        out: list[list[int]] = [[] for _ in range(self.batch_size)]
        if all(lengths[b] - self.consumed[b] == 1 for b in rows):
            columns = torch.tensor([self.consumed[b] for b in rows], device=tokens.device)
            picked = tokens[torch.tensor(rows, device=tokens.device), columns].tolist()
            for b, token in zip(rows, picked):
                out[b] = [token]
        else:
            for b in rows:
                out[b] = tokens[b, self.consumed[b]:lengths[b]].tolist()
        return out

    def advance(self, state, lengths: Sequence[int]):
        """Between steps: accept every row's new tokens and hand the step its next mask.

        Returns ``state`` with ``grammar_mask`` replaced (and ``done`` set for a row whose grammar
        is complete when the request has no EOS id to end it with)."""
        return self.take_new_tokens(state, lengths).replace(grammar_mask=self.mask())

    def take_new_tokens(self, state, lengths: Sequence[int]):
        """Accept every row's new tokens; ``state`` with ``done`` set for rows that ended here."""
        done = state.done.reshape(-1).tolist()
        for b, tokens in enumerate(self.new_tokens(state, lengths)):
            if tokens:
                self.accept(b, tokens)
            if done[b]:
                self.finished[b] = True
        ended = [b for b in range(self.batch_size)
                 if not self.finished[b] and not self.eos[b] and self.matchers[b].can_terminate()
                 and self.matchers[b].is_terminated()]
        for b in ended:
            self.finished[b] = True
        if ended:
            ended_rows = torch.zeros_like(state.done.reshape(-1))
            ended_rows[ended] = True
            state = state.replace(done=state.done | ended_rows.reshape(state.done.shape))
        return state


def constraint_for_rows(tokenizer, formats: Sequence[Any], *, vocab_size: int, start: Sequence[int], eos_token_ids,
                        device: Any = None, engine: str | None = None) -> GrammarRows | None:
    """The ``GrammarRows`` for a batch whose row ``b`` asks for ``formats[b]`` (a ``response_format``
    value; None or ``{"type": "text"}`` for a free row), or None when no row is constrained.
    Grammars are compiled once per (tokenizer, spec) and shared by the rows asking for the same one;
    a bad spec raises ``ValueError`` naming the row and the path at fault."""
    from genfn.config.response_format import parse_response_format
    from genfn.structured import compile as compile_grammar

    specs = []
    for b, value in enumerate(formats):
        specs.append(parse_response_format(value, "response_format" if len(formats) == 1 else f"response_format[{b}]"))
    if all(spec is None for spec in specs):
        return None
    if tokenizer is None:
        raise ValueError("response_format needs the model's tokenizer: pass tokenizer= (a genfn.Tokenizer), or load "
                         "the model with genfn.load so that model.tokenizer is set")
    grammars = [None if spec is None else compile_grammar(tokenizer, spec, vocab_size=vocab_size, engine=engine)
                for spec in specs]
    return GrammarRows.for_grammars(grammars, vocab_size, start, eos_token_ids, device)
