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
from genfn.structured.rows import GrammarRows, mask_allows

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
            usable[b] = self._walk(b, drafts[b][:max(0, min(valid[b], k))], masks[b])
        return state.replace(grammar_mask=masks.to(state.tokens.device),
                             pending=pending.replace(num_valid=torch.tensor(usable, dtype=pending.num_valid.dtype,
                                                                            device=pending.num_valid.device)))

    def _walk(self, b: int, drafts: list[int], masks: torch.Tensor) -> int:
        """Fill ``masks[i]`` along ``drafts``; return how many drafts the grammar allows."""
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

    @classmethod
    def from_rows(cls, rows: GrammarRows) -> "SpeculativeGrammarRows":
        spec = cls(rows.matchers, rows.vocab_size, rows.start, rows.eos, rows.device)
        spec.engine_eos = list(rows.engine_eos)
        return spec
