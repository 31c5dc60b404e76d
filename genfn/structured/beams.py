"""Grammar matchers that follow beam search: after every beam step each running beam continues one
of the previous step's beams with one new token, so its matcher is a fork of that beam's matcher
that accepted the token. A beam whose score is -inf took a token its grammar forbids (there were
fewer allowed candidates than beams): it can never beat a live beam, its matcher is dropped and its
mask left open."""

from __future__ import annotations

import math

from genfn.structured.rows import GrammarRows

__all__ = ["BeamGrammarRows"]


class BeamGrammarRows(GrammarRows):
    """``GrammarRows`` over the ``B * K`` beam rows of a ``genfn.state.beam.BeamState``."""

    def __init__(self, *args, prompt_len: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompt_len = int(prompt_len)

    def advance(self, state, lengths):
        cur_len = int(state.cur_len)
        column = cur_len - 1
        rows = self.batch_size
        sources = state.running_beam_indices[:, :, column - self.prompt_len].reshape(rows).tolist()
        tokens = state.running_sequences[:, :, column].reshape(rows).tolist()
        scores = state.running_scores.reshape(rows).tolist()
        matchers = []
        for row in range(rows):
            source = self.matchers[sources[row]] if 0 <= sources[row] < rows else None
            if source is None or math.isinf(scores[row]) or tokens[row] in self.eos[row]:
                matchers.append(None)
                continue
            matcher = source.fork()
            matchers.append(matcher if matcher.accept(tokens[row]) else None)
        self.matchers = matchers
        self.finished = [m is None for m in matchers]
        self.engine_eos = [self.engine_eos[s] if 0 <= s < rows else None for s in sources]
        return state.replace(grammar_mask=self.mask())

    @classmethod
    def from_rows(cls, rows: GrammarRows, prompt_len: int) -> "BeamGrammarRows":
        beams = cls(rows.matchers, rows.vocab_size, rows.consumed, rows.eos, rows.device, prompt_len=prompt_len)
        beams.engine_eos = list(rows.engine_eos)
        return beams
