"""Grammar matchers under speculative decoding: the drafts are checked against each row's grammar
on the host before the target verifies them.

A constrained speculative step verifies the drafts proposed at the end of the previous step
(``SpeculativeState.pending``). Between the two, ``advance`` accepts the tokens the step kept, then
walks each row's matcher along its pending drafts: position ``i`` of the block gets the mask after
``drafts[:i]``, the walk stops at the first draft the grammar forbids (the row's ``num_valid`` is
cut there), and the matcher is rolled back to where it was. The target's choice at every position
it can reach is therefore made under the same mask plain decoding would use, so greedy speculative
output equals greedy output under the same grammar.
"""

from __future__ import annotations

import torch

from genfn.processors.grammar import FREE_ROW
from genfn.structured.rows import GrammarRows

__all__ = ["SpeculativeGrammarRows"]


class SpeculativeGrammarRows(GrammarRows):
    """``GrammarRows`` for a ``genfn.strategies.assisted.step.SpeculativeState``."""

    def advance(self, state, lengths):
        state = self.take_new_tokens(state, lengths)
        pending = state.pending
        batch, k = pending.tokens.shape
        drafts, valid = pending.tokens.tolist(), pending.num_valid.tolist()
        masks = torch.full((batch, k + 1, self.width), FREE_ROW, dtype=torch.int32)
        usable = list(valid)
        for b in range(batch):
            if self.finished[b]:
                continue
            usable[b] = self.walk_drafts(b, drafts[b][:max(0, min(valid[b], k))], masks[b])
        return state.replace(grammar_mask=masks.to(state.tokens.device),
                             pending=pending.replace(num_valid=torch.tensor(usable, dtype=pending.num_valid.dtype,
                                                                            device=pending.num_valid.device)))

    @classmethod
    def from_rows(cls, rows: GrammarRows) -> "SpeculativeGrammarRows":
        spec = cls(rows.matchers, rows.vocab_size, rows.start, rows.eos, rows.device)
        spec.engine_eos = list(rows.engine_eos)
        return spec
