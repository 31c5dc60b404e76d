"""The pure core of assisted decoding: verification, prompt lookup, schedules, the drafter interface.

No model is needed: a toy target (next-token logits from the last two tokens, through fixed
random tables) stands in for one, so the tests can run the speculative loop over many rows and
compare it with plain decoding token for token, or, for sampling, in distribution.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from genfn import random as R
from genfn.strategies.assisted import (
    Draft,
    DraftInput,
    Drafter,
    PromptLookupDrafter,
    check_ensemble_weight,
    confident_length,
    draft_budget,
    draft_keys,
    init_confidence,
    init_stats,
    process_block,
    record,
    init_schedule,
    limit_new_tokens,
    propose_prompt_lookup,
    roc_optimal_threshold,
    schedule_for_next_call,
    update_confidence,
    update_schedule,
    verify_greedy,
    verify_sampling,
)

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- a toy target model

class ToyModel:
    """Next-token logits from the last two tokens: ``last[t_{-1}] + second[t_{-2}]``."""

    def __init__(self, vocab: int, seed: int, scale: float = 3.0):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.last = torch.randn(vocab, vocab, generator=g) * scale
        self.second = torch.randn(vocab, vocab, generator=g) * scale * 0.5

    def logits(self, second_last: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return self.last[last] + self.second[second_last]

    def block_logits(self, tokens: torch.Tensor, cur_len: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
        """``[B, k + 1, V]``: the logits after the row's tokens and after each draft prefix (one forward)."""
        batch, k = draft.shape
        extended = torch.cat([tokens, torch.zeros(batch, k + 1, dtype=torch.int64)], dim=1)
        extended = extended.scatter(1, cur_len.unsqueeze(1) + torch.arange(k), draft)
        at = cur_len.unsqueeze(1) + torch.arange(k + 1)  # the position each logit predicts
        return self.logits(extended.gather(1, at - 2), extended.gather(1, at - 1))


def plain_greedy(model: ToyModel, prompt: list[int], new: int) -> list[int]:
    seq = list(prompt)
    for _ in range(new):
        seq.append(int(model.logits(torch.tensor(seq[-2]), torch.tensor(seq[-1])).argmax()))
    return seq[len(prompt):]


def plain_sampling(model: ToyModel, prompt: list[int], new: int, row_key: torch.Tensor) -> list[int]:
    seq = list(prompt)
    for g in range(new):
        logits = model.logits(torch.tensor([seq[-2]]), torch.tensor([seq[-1]]))
        noise = R.gumbel(row_key.unsqueeze(0), torch.tensor([g]), model.vocab)
        seq.append(int((logits + noise).argmax()))
    return seq[len(prompt):]


def buffer_of(prompts: list[list[int]], width: int):
    tokens = torch.zeros(len(prompts), width, dtype=torch.int64)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p)
    return tokens, torch.tensor([len(p) for p in prompts])


def run_speculative(model, prompts, new, k, propose, verify):
    """The speculative loop with per-row lengths: every row appends ``num_new`` tokens per round.

    ``propose(tokens, cur_len, counter) -> (draft, num_valid, draft_logits)``;
    ``verify(draft, num_valid, target_logits, draft_logits, counter, tokens, cur_len) -> Verified``.
    Returns each row's new tokens and the (proposed, accepted) totals.
    """
    tokens, cur_len = buffer_of(prompts, max(map(len, prompts)) + new + k + 2)
    prompt_len = cur_len.clone()
    proposed_total = accepted_total = 0
    for _ in range(new):
        counter = cur_len - prompt_len
        budget = new - counter
        if bool((budget <= 0).all()):
            break
        draft, num_valid, draft_logits = propose(tokens, cur_len, counter)
        num_valid = torch.minimum(num_valid, (budget - 1).clamp(min=0))
        verified = verify(draft, num_valid, model.block_logits(tokens, cur_len, draft), draft_logits, counter,
                          tokens, cur_len)
        verified = limit_new_tokens(verified, budget=budget.clamp(min=0))
        proposed_total += int(num_valid[budget > 0].sum())
        accepted_total += int(verified.accepted.sum())
        for b in range(len(prompts)):
            n = int(verified.num_new[b])
            tokens[b, cur_len[b]:cur_len[b] + n] = verified.tokens[b, :n]
        cur_len = cur_len + verified.num_new
    outs = [tokens[b, prompt_len[b]:prompt_len[b] + new].tolist() for b in range(len(prompts))]
    assert all(int(c) == new for c in cur_len - prompt_len)
    return outs, proposed_total, accepted_total


def greedy_drafter(model: ToyModel, k: int):
    """Drafts k tokens greedily with ``model`` (the target itself: every draft is right)."""
    def propose(tokens, cur_len, counter):
        batch = tokens.shape[0]
        second = tokens.gather(1, (cur_len - 2).unsqueeze(1)).squeeze(1)
        last = tokens.gather(1, (cur_len - 1).unsqueeze(1)).squeeze(1)
        out = []
        for _ in range(k):
            nxt = model.logits(second, last).argmax(-1)
            out.append(nxt)
            second, last = last, nxt
        return torch.stack(out, 1), torch.full((batch,), k), None
    return propose


PROMPTS = [[3, 5, 7], [1, 2, 3, 4, 5, 6, 1, 2], [9, 9], [4, 0, 4, 0, 4]]


# --------------------------------------------------------------------------- greedy verification

@FUZZ
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 5), k=st.integers(1, 5), vocab=st.integers(2, 9))
def test_greedy_keeps_the_drafts_that_equal_the_argmax(seed, batch, k, vocab):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, k + 1, vocab, generator=g)
    best = logits.argmax(-1)
    agree = torch.randint(0, k + 1, (batch,), generator=g)  # the first draft that differs from the argmax
    num_valid = torch.randint(0, k + 1, (batch,), generator=g)
    wrong = (best[:, :k] + torch.randint(1, max(vocab, 2), (batch, k), generator=g)) % vocab
    draft = torch.where(torch.arange(k) < agree.unsqueeze(1), best[:, :k], wrong)
    verified = verify_greedy(draft, num_valid, logits)
    expected = torch.minimum(agree, num_valid)
    assert torch.equal(verified.accepted, expected)
    assert torch.equal(verified.num_new, expected + 1)
    for b in range(batch):
        n = int(verified.num_new[b])
        assert verified.tokens[b, :n].tolist() == best[b, :n].tolist()
        assert verified.tokens[b, :n - 1].tolist() == draft[b, :n - 1].tolist()


@pytest.mark.parametrize("drafter", ["target", "never_right", "noisy", "prompt_lookup"])
def test_greedy_speculation_equals_plain_greedy_at_every_batch(drafter):
    model, k, new = ToyModel(vocab=10, seed=1), 4, 17
    if drafter == "target":
        propose = greedy_drafter(model, k)
    elif drafter == "noisy":
        noisy = ToyModel(vocab=10, seed=1)
        noisy.last = noisy.last + torch.randn(10, 10, generator=torch.Generator().manual_seed(5)) * 2.5
        propose = greedy_drafter(noisy, k)
    elif drafter == "never_right":
        right = greedy_drafter(model, 1)

        def propose(tokens, cur_len, counter):
            first, valid, _ = right(tokens, cur_len, counter)
            return ((first + 1) % 10).expand(-1, k).contiguous(), torch.full_like(valid, k), None
    else:
        def propose(tokens, cur_len, counter):
            return (*propose_prompt_lookup(tokens, cur_len, k, 2), None)

    def verify(draft, num_valid, target_logits, *_):
        return verify_greedy(draft, num_valid, target_logits)

    outs, proposed, accepted = run_speculative(model, PROMPTS, new, k, propose, verify)
    for prompt, out in zip(PROMPTS, outs):
        assert out == plain_greedy(model, prompt, new)
    alone = [run_speculative(model, [p], new, k, propose, verify)[0][0] for p in PROMPTS]
    assert alone == outs
    if drafter == "target":
        assert accepted == proposed > 0
    if drafter == "never_right":
        assert accepted == 0 and proposed > 0
    if drafter == "noisy":
        assert 0 < accepted < proposed


class CountPenalty:
    """A per-row processor: each earlier occurrence of a token in the row lowers its logit by 1.5."""

    def __call__(self, logits, ctx):
        filled = torch.arange(ctx.tokens.shape[1]).unsqueeze(0) < ctx.cur_len.unsqueeze(1)
        vocab = logits.shape[-1]
        counts = torch.zeros(logits.shape[0], vocab + 1).scatter_add(
            1, torch.where(filled, ctx.tokens, vocab), torch.ones(ctx.tokens.shape))[:, :vocab]
        return logits - 1.5 * counts


def test_block_processing_gives_each_position_the_drafts_before_it():
    from genfn.processors.context import LogitsContext

    model, k, new, penalty = ToyModel(vocab=10, seed=4), 3, 14, CountPenalty()

    def plain(prompt):
        seq = list(prompt)
        for _ in range(new):
            ctx = LogitsContext(tokens=torch.tensor([seq]), cur_len=torch.tensor([len(seq)]),
                                prompt_len=torch.tensor([len(prompt)]))
            logits = penalty(model.logits(torch.tensor([seq[-2]]), torch.tensor([seq[-1]])), ctx)
            seq.append(int(logits.argmax()))
        return seq[len(prompt):]

    def propose(tokens, cur_len, counter):
        return (*propose_prompt_lookup(tokens, cur_len, k, 2), None)

    prompt_len = torch.tensor([len(p) for p in PROMPTS])

    def verify(draft, num_valid, target_logits, draft_logits, counter, tokens, cur_len):
        before = tokens.clone()
        processed = process_block(penalty, target_logits, tokens, cur_len, prompt_len, draft)
        assert torch.equal(tokens, before)  # the buffer is read, never written
        return verify_greedy(draft, num_valid, processed)

    outs, proposed, accepted = run_speculative(model, PROMPTS, new, k, propose, verify)
    assert outs == [plain(p) for p in PROMPTS]
    assert accepted > 0
    # Without per-position processing the tokens differ: the test sees the processor.
    unprocessed = run_speculative(model, PROMPTS, new, k, propose,
                                  lambda d, n, t, *_: verify_greedy(d, n, t))[0]
    assert unprocessed != outs


def test_block_processing_refuses_stateful_chains():
    class Stateful:
        stateful = True

    with pytest.raises(TypeError, match="stateful"):
        process_block(Stateful(), torch.zeros(1, 3, 4), torch.zeros(1, 8, dtype=torch.int64), torch.tensor([2]),
                      torch.tensor([2]), torch.zeros(1, 2, dtype=torch.int64))


def test_acceptance_statistics_count_per_row():
    stats = init_stats(3)
    stats = record(stats, torch.tensor([4, 4, 2]), torch.tensor([4, 1, 0]))
    stats = record(stats, torch.tensor([4, 3, 2]), torch.tensor([2, 3, 2]), active=torch.tensor([True, True, False]))
    assert stats.proposed.tolist() == [8, 7, 2] and stats.accepted.tolist() == [6, 4, 0]
    assert stats.rounds.tolist() == [2, 2, 1]
    totals = stats.totals()
    assert totals["proposed"] == 17 and totals["accepted"] == 10 and totals["acceptance_rate"] == 10 / 17
    assert totals["tokens_per_round"] == (10 + 5) / 5


def test_greedy_ensemble_compares_drafts_with_the_mixtures_argmax():
    g = torch.Generator().manual_seed(3)
    batch, k, vocab = 64, 3, 5
    target, draft_logits = torch.randn(batch, k + 1, vocab, generator=g), torch.randn(batch, k, vocab, generator=g)
    weight = torch.rand(batch, generator=g) * 0.8 + 0.1
    mixture = weight.view(-1, 1, 1) * target[:, :k].softmax(-1) + (1 - weight.view(-1, 1, 1)) * draft_logits.softmax(-1)
    draft = draft_logits.argmax(-1)
    num_valid = torch.randint(0, k + 1, (batch,), generator=g)
    verified = verify_greedy(draft, num_valid, target, draft_logits, ensemble_weight=weight)
    for b in range(batch):
        n = int(num_valid[b])
        choice = mixture[b, :n].argmax(-1).tolist() + target[b, n:].argmax(-1).tolist()
        agree = 0
        while agree < n and choice[agree] == int(draft[b, agree]):
            agree += 1
        assert int(verified.accepted[b]) == agree
        assert verified.tokens[b, :agree + 1].tolist() == choice[:agree + 1]
    # The mixture changes decisions somewhere (else this test would prove nothing).
    assert not torch.equal(verified.accepted, verify_greedy(draft, num_valid, target).accepted)


# --------------------------------------------------------------------------- sampling verification

def test_sampling_with_a_deterministic_drafter_is_plain_sampling_token_for_token():
    model, k, new = ToyModel(vocab=10, seed=2, scale=1.0), 3, 15
    keys = R.as_row_keys(R.key(7), len(PROMPTS))

    def propose(tokens, cur_len, counter):
        return (*propose_prompt_lookup(tokens, cur_len, k, 2), None)

    def verify_rows(row_keys):
        def verify(draft, num_valid, target_logits, draft_logits, counter, *_):
            return verify_sampling(draft, num_valid, target_logits, row_keys, counter)
        return verify

    outs, proposed, accepted = run_speculative(model, PROMPTS, new, k, propose, verify_rows(keys))
    for b, prompt in enumerate(PROMPTS):
        assert outs[b] == plain_sampling(model, prompt, new, keys[b])
    assert accepted > 0  # some drafts were kept, so the match path ran
    alone = run_speculative(model, PROMPTS[1:2], new, k, propose, verify_rows(keys[1:2]))[0][0]
    assert alone == outs[1]


def markov_tables(vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, vocab, generator=g) * 1.2, torch.randn(vocab, vocab, generator=g) * 1.2


def speculative_markov(target, drafter, rows: int, new: int, k: int, seed: int, ensemble_weight=None,
                       use_draft_logits=True, vary_valid=True):
    """Sample ``new`` tokens for ``rows`` independent rows of a Markov chain, speculatively.

    The drafter samples from its table with ``draft_keys``; verification is speculative sampling.
    Returns ``[rows, new]`` tokens.
    """
    vocab = target.shape[0]
    keys = R.as_row_keys(R.key(seed), rows)
    dump = new + k + 1  # a spill column for the tokens a row does not keep
    out = torch.zeros(rows, dump + 1, dtype=torch.int64)
    count = torch.zeros(rows, dtype=torch.int64)
    last = torch.zeros(rows, dtype=torch.int64)  # every chain starts after token 0
    for round_ in range(new):
        if bool((count >= new).all()):
            break
        drafts, draft_logits, prev = [], [], last
        for i in range(k):
            logits = drafter[prev]
            token = (logits + R.gumbel(draft_keys(keys), count + i, vocab)).argmax(-1)
            drafts.append(token)
            draft_logits.append(logits)
            prev = token
        draft = torch.stack(drafts, 1)
        context = torch.cat([last.unsqueeze(1), draft], 1)  # the token before each verified position
        if vary_valid:
            num_valid = (torch.arange(rows) * 7 + round_ * 3) % (k + 1)
        else:
            num_valid = torch.full((rows,), k)
        verified = verify_sampling(draft, num_valid, target[context], keys, count,
                                   torch.stack(draft_logits, 1) if use_draft_logits else None,
                                   ensemble_weight=ensemble_weight)
        columns = count.unsqueeze(1) + torch.arange(k + 1)
        keep = (torch.arange(k + 1) < verified.num_new.unsqueeze(1)) & (columns < dump)
        out.scatter_(1, torch.where(keep, columns, dump), verified.tokens)
        last = verified.tokens.gather(1, (verified.num_new - 1).unsqueeze(1)).squeeze(1)
        count = count + verified.num_new
    assert bool((count >= new).all())
    return out[:, :new]


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double().numpy()
    expected = probs.double().numpy() * len(samples)
    assert counts[expected == 0].sum() == 0
    keep = expected > 0
    return float(stats.chisquare(counts[keep], expected[keep] * counts[keep].sum() / expected[keep].sum()).pvalue)


def chain_probs(table: torch.Tensor, length: int) -> torch.Tensor:
    """Exact probabilities of every sequence of ``length`` tokens after token 0, in ``sequence_ids`` order."""
    probs = table.double().softmax(-1)
    out = []
    for seq in itertools.product(range(table.shape[0]), repeat=length):
        p, prev = 1.0, 0
        for t in seq:
            p, prev = p * float(probs[prev, t]), t
        out.append(p)
    return torch.tensor(out, dtype=torch.float64)


def sequence_ids(samples: torch.Tensor, vocab: int) -> torch.Tensor:
    ids = torch.zeros(samples.shape[0], dtype=torch.int64)
    for j in range(samples.shape[1]):
        ids = ids * vocab + samples[:, j]
    return ids


def test_speculative_sampling_keeps_the_target_distribution():
    vocab, k, new, rows = 3, 2, 3, 12_000
    target, drafter = markov_tables(vocab, seed=11)
    samples = speculative_markov(target, drafter, rows, new, k, seed=1)
    ids = sequence_ids(samples, vocab)
    assert chi_square_pvalue(ids, chain_probs(target, new)) > 1e-3
    # The test can fail: the drafter's own chain is told apart from the target's.
    assert chi_square_pvalue(ids, chain_probs(drafter, new)) < 1e-6


def test_speculative_sampling_without_draft_logits_keeps_the_target_distribution():
    vocab, k, new, rows = 3, 2, 2, 8_000
    target, drafter = markov_tables(vocab, seed=12)
    samples = speculative_markov(target, drafter, rows, new, k, seed=2, use_draft_logits=False)
    assert chi_square_pvalue(sequence_ids(samples, vocab), chain_probs(target, new)) > 1e-3


def test_drafts_from_the_target_itself_are_all_accepted():
    vocab, k, rows = 5, 4, 256
    target, _ = markov_tables(vocab, seed=13)
    keys = R.as_row_keys(R.key(3), rows)
    count = torch.randint(0, 50, (rows,))
    prev, drafts = torch.zeros(rows, dtype=torch.int64), []
    for i in range(k):
        prev = (target[prev] + R.gumbel(draft_keys(keys), count + i, vocab)).argmax(-1)
        drafts.append(prev)
    draft = torch.stack(drafts, 1)
    context = torch.cat([torch.zeros(rows, 1, dtype=torch.int64), draft], 1)
    num_valid = torch.randint(0, k + 1, (rows,))
    verified = verify_sampling(draft, num_valid, target[context], keys, count, target[context[:, :k]])
    assert torch.equal(verified.accepted, num_valid)
    assert torch.equal(verified.tokens[:, :k][torch.arange(k) < num_valid.unsqueeze(1)],
                       draft[torch.arange(k) < num_valid.unsqueeze(1)])


@pytest.mark.parametrize("weights", [(0.3, 0.8)])
def test_ensemble_weight_samples_the_mixture(weights):
    vocab, k, rows = 4, 2, 16_000
    target, drafter = markov_tables(vocab, seed=14)
    weight = torch.tensor([weights[b % 2] for b in range(rows)])
    first = speculative_markov(target, drafter, rows, 1, k, seed=3, ensemble_weight=weight, vary_valid=False)[:, 0]
    p, q = target[0].double().softmax(-1), drafter[0].double().softmax(-1)
    for parity, w in enumerate(weights):
        mine = first[parity::2]
        assert chi_square_pvalue(mine, w * p + (1 - w) * q) > 1e-3
        assert chi_square_pvalue(mine, p) < 1e-6  # the mixture is not the target


def test_same_key_same_tokens_whatever_the_batch():
    vocab, k, new = 5, 3, 6
    target, drafter = markov_tables(vocab, seed=15)
    batched = speculative_markov(target, drafter, 8, new, k, seed=4, vary_valid=False)
    keys = R.as_row_keys(R.key(4), 8)
    # Row 5 alone with its own key: rebuild the loop for one row through the same function.
    alone = speculative_markov_one(target, drafter, keys[5:6], new, k)
    assert torch.equal(batched[5:6], alone)
    assert not torch.equal(batched[5], batched[6])


def speculative_markov_one(target, drafter, keys, new, k):
    vocab = target.shape[0]
    out, count, last = [], torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    while len(out) < new:
        drafts, logits, prev = [], [], last
        for i in range(k):
            token = (drafter[prev] + R.gumbel(draft_keys(keys), count + i, vocab)).argmax(-1)
            drafts.append(token)
            logits.append(drafter[prev])
            prev = token
        draft = torch.stack(drafts, 1)
        context = torch.cat([last.unsqueeze(1), draft], 1)
        verified = verify_sampling(draft, torch.full((1,), k), target[context], keys, count, torch.stack(logits, 1))
        n = int(verified.num_new[0])
        out += verified.tokens[0, :n].tolist()
        last, count = verified.tokens[:, n - 1], count + n
    return torch.tensor([out[:new]])


def test_ensemble_weight_without_draft_logits_is_refused_clearly():
    draft, valid, logits = torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, dtype=torch.int64), torch.zeros(1, 3, 4)
    keys, counter = R.as_row_keys(R.key(0), 1), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="prompt lookup"):
        verify_sampling(draft, valid, logits, keys, counter, ensemble_weight=0.5)
    with pytest.raises(ValueError, match="prompt lookup"):
        verify_greedy(draft, valid, logits, ensemble_weight=0.5)
    with pytest.raises(ValueError, match="assistant_ensemble_weight"):
        check_ensemble_weight(PromptLookupDrafter(num_tokens=3), 0.5)
    check_ensemble_weight(PromptLookupDrafter(num_tokens=3), None)


def test_verification_reports_bad_arguments():
    draft, valid, logits = torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, dtype=torch.int64), torch.zeros(2, 4, 5)
    keys, counter = R.as_row_keys(R.key(0), 2), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="target_logits"):
        verify_greedy(draft, valid, torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="num_valid"):
        verify_greedy(draft, torch.ones(3, dtype=torch.int64), logits)
    with pytest.raises(TypeError, match="draft"):
        verify_greedy(draft.float(), valid, logits)
    with pytest.raises(ValueError, match="draft_logits"):
        verify_sampling(draft, valid, logits, keys, counter, torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="ensemble_weight"):
        verify_sampling(draft, valid, logits, keys, counter, torch.zeros(2, 3, 5), ensemble_weight=1.5)
    with pytest.raises(TypeError, match="keys"):
        verify_sampling(draft, valid, logits, R.key(0), counter)
    with pytest.raises(ValueError, match="counter"):
        verify_sampling(draft, valid, logits, keys, torch.zeros(3, dtype=torch.int64))


def test_limit_new_tokens_cuts_after_eos_and_at_the_budget():
    logits = torch.full((3, 4, 6), -5.0)
    chosen = torch.tensor([[1, 2, 3, 4], [1, 5, 2, 3], [5, 1, 1, 1]])
    logits.scatter_(2, chosen.unsqueeze(-1), 5.0)
    draft = chosen[:, :3]
    verified = verify_greedy(draft, torch.full((3,), 3), logits)
    assert verified.num_new.tolist() == [4, 4, 4]
    limited = limit_new_tokens(verified, budget=torch.tensor([2, 9, 0]), eos_token_ids=(5,))
    assert limited.num_new.tolist() == [2, 2, 0]
    assert limited.accepted.tolist() == [1, 1, 0]


# --------------------------------------------------------------------------- prompt lookup

def lookup_reference(row: list[int], k: int, max_ngram: int, occurrence: str, eos: tuple, first: int = 0):
    """Per row, as transformers' PromptLookupCandidateGenerator (any occurrence order)."""
    row = row[first:]
    length = len(row)
    for n in range(min(max_ngram, length - 1), 0, -1):
        tail = row[length - n:]
        starts = [j for j in range(length - n) if row[j:j + n] == tail]
        if starts:
            j = starts[-1] if occurrence == "latest" else starts[0]
            chosen = row[j + n:min(j + n + k, length)]
            for i, t in enumerate(chosen):
                if t in eos:
                    return chosen[:i]
            return chosen
    return []


@FUZZ
@given(data=st.data(), batch=st.integers(1, 4), width=st.integers(2, 24), vocab=st.integers(2, 5),
       k=st.integers(1, 5), max_ngram=st.integers(1, 3), occurrence=st.sampled_from(["latest", "earliest"]),
       eos=st.sampled_from([(), (1,), (0, 2)]))
def test_prompt_lookup_equals_a_per_row_reference(data, batch, width, vocab, k, max_ngram, occurrence, eos):
    rows = [data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=width)) for _ in range(batch)]
    firsts = [data.draw(st.integers(0, len(r) - 1)) for r in rows]
    tokens = torch.full((batch, width), vocab - 1, dtype=torch.int64)  # garbage past cur_len
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = torch.tensor(r)
    cur_len = torch.tensor([len(r) for r in rows])
    draft, num_valid = propose_prompt_lookup(tokens, cur_len, k, max_ngram, occurrence=occurrence,
                                             eos_token_ids=eos, first_column=torch.tensor(firsts))
    plain_draft, plain_valid = propose_prompt_lookup(tokens, cur_len, k, max_ngram, occurrence=occurrence,
                                                     eos_token_ids=eos)
    for b, r in enumerate(rows):
        assert draft[b, :num_valid[b]].tolist() == lookup_reference(r, k, max_ngram, occurrence, eos, firsts[b])
        assert plain_draft[b, :plain_valid[b]].tolist() == lookup_reference(r, k, max_ngram, occurrence, eos)


@FUZZ
@given(row=st.lists(st.integers(0, 4), min_size=2, max_size=30), k=st.integers(1, 6), max_ngram=st.integers(1, 3),
       eos=st.sampled_from([None, 3]))
def test_prompt_lookup_earliest_equals_transformers(row, k, max_ngram, eos):
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    ids = torch.tensor([row])
    reference = PromptLookupCandidateGenerator(
        eos_token_id=None if eos is None else torch.tensor([eos]), num_output_tokens=k,
        max_matching_ngram_size=max_ngram, max_length=len(row) + 50)
    candidates, _ = reference.get_candidates(ids)
    expected = candidates[0, len(row):].tolist()
    draft, num_valid = propose_prompt_lookup(ids, torch.tensor([len(row)]), k, max_ngram, occurrence="earliest",
                                             eos_token_ids=() if eos is None else (eos,))
    assert draft[0, :num_valid[0]].tolist() == expected


def test_prompt_lookup_stops_when_only_the_targets_token_fits():
    ids = torch.tensor([[1, 2, 3, 1, 2]])
    _, full = propose_prompt_lookup(ids, torch.tensor([5]), 4, max_length=torch.tensor([9]))
    _, none = propose_prompt_lookup(ids, torch.tensor([5]), 4, max_length=torch.tensor([6]))
    assert full.tolist() == [3] and none.tolist() == [0]  # "3 1 2": the tokens after the earlier "1 2"


def test_prompt_lookup_prefers_the_longer_ngram_and_the_chosen_occurrence():
    ids = torch.tensor([[5, 1, 2, 7, 3, 2, 8, 1, 2, 9, 9, 1, 2]])
    length = torch.tensor([13])
    latest, _ = propose_prompt_lookup(ids, length, 2, 2, occurrence="latest")
    earliest, _ = propose_prompt_lookup(ids, length, 2, 2, occurrence="earliest")
    unigram, _ = propose_prompt_lookup(ids, length, 2, 1, occurrence="latest")
    assert latest[0].tolist() == [9, 9] and earliest[0].tolist() == [7, 3] and unigram[0].tolist() == [9, 9]
    ids2 = torch.tensor([[4, 2, 6, 3, 2, 6, 1, 2]])  # bigram "1 2" never repeats: the unigram "2" decides
    latest2, valid2 = propose_prompt_lookup(ids2, torch.tensor([8]), 2, 2, occurrence="latest")
    assert latest2[0].tolist() == [6, 1] and valid2.tolist() == [2]


def test_prompt_lookup_reports_bad_arguments():
    ids, length = torch.zeros(1, 4, dtype=torch.int64), torch.tensor([4])
    with pytest.raises(ValueError, match="num_output_tokens"):
        propose_prompt_lookup(ids, length, 0)
    with pytest.raises(ValueError, match="max_matching_ngram_size"):
        propose_prompt_lookup(ids, length, 3, 0)
    with pytest.raises(ValueError, match="occurrence"):
        propose_prompt_lookup(ids, length, 3, occurrence="first")
    with pytest.raises(ValueError, match="cur_len"):
        propose_prompt_lookup(ids, torch.tensor(4), 3)
    with pytest.raises(TypeError, match="tokens"):
        propose_prompt_lookup(ids.float(), length, 3)
    with pytest.raises(ValueError, match="num_tokens"):
        PromptLookupDrafter(num_tokens=0)


def test_prompt_lookup_drafter_implements_the_drafter_interface():
    drafter = PromptLookupDrafter(num_tokens=3)
    assert isinstance(drafter, Drafter) and not drafter.gives_logits and hash(drafter) == hash(PromptLookupDrafter(3))
    tokens = torch.tensor([[1, 2, 3, 4, 1, 2, 0, 0], [7, 7, 7, 7, 0, 0, 0, 0]])
    view = DraftInput(tokens=tokens, cur_len=torch.tensor([6, 4]), budget=torch.tensor([3, 1]))
    state = drafter.init_state(2, tokens.device)
    draft, state = drafter.propose(state, view)
    assert isinstance(draft, Draft)
    tokens_out, num_valid, logits = draft
    assert tokens_out[0].tolist() == [3, 4, 1] and num_valid.tolist() == [3, 1] and logits is None
    verified = verify_greedy(tokens_out, num_valid, torch.zeros(2, 4, 8))
    assert drafter.commit(state, verified, view) is None


# --------------------------------------------------------------------------- schedules

def transformers_schedule(kind: str, start: int):
    """transformers' own update_candidate_strategy, on a generator built without a model."""
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    gen = object.__new__(AssistedCandidateGenerator)
    gen.assistant_generation_config = GenerationConfig(num_assistant_tokens_schedule=kind,
                                                       num_assistant_tokens=start,
                                                       assistant_confidence_threshold=0)
    gen.num_assistant_tokens = start
    return gen


@FUZZ
@given(kind=st.sampled_from(["constant", "heuristic", "heuristic_transient"]), start=st.integers(1, 8),
       rounds=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=12))
def test_schedule_moves_as_transformers_does(kind, start, rounds):
    reference = transformers_schedule(kind, start)
    schedule = init_schedule(start, 1, kind)
    for proposed, accepted in rounds:
        accepted = min(accepted, proposed)
        reference.update_candidate_strategy(None, torch.zeros(1, proposed + 1, 3), accepted)
        schedule = update_schedule(schedule, torch.tensor([accepted]), torch.tensor([proposed]))
        assert schedule.num_tokens.tolist() == [reference.num_assistant_tokens]


def test_schedule_rows_move_independently_and_across_calls():
    schedule = init_schedule(5, 3, "heuristic")
    schedule = update_schedule(schedule, torch.tensor([4, 2, 0]), torch.tensor([4, 4, 4]),
                               active=torch.tensor([True, True, False]))
    assert schedule.num_tokens.tolist() == [7, 4, 5]
    for _ in range(6):
        schedule = update_schedule(schedule, torch.tensor([0, 0, 0]), torch.tensor([3, 3, 3]))
    assert schedule.num_tokens.tolist() == [1, 1, 1]
    one = init_schedule(5, 1, "heuristic")
    one = update_schedule(one, torch.tensor([5]), torch.tensor([5]))
    assert schedule_for_next_call(one, 5, 1, "heuristic").num_tokens.tolist() == [7]
    transient = update_schedule(init_schedule(5, 1, "heuristic_transient"), torch.tensor([5]), torch.tensor([5]))
    assert transient.num_tokens.tolist() == [7]
    assert schedule_for_next_call(transient, 5, 2, "heuristic_transient").num_tokens.tolist() == [5, 5]
    constant = update_schedule(init_schedule(5, 1, "constant"), torch.tensor([5]), torch.tensor([5]))
    assert constant.num_tokens.tolist() == [5]
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule"):
        init_schedule(5, 1, "adaptive")
    with pytest.raises(ValueError, match="num_assistant_tokens"):
        init_schedule(0, 1)


def test_draft_budget_leaves_room_for_the_targets_token():
    schedule = init_schedule(20, 3)
    budget = draft_budget(schedule, torch.tensor([5, 15, 19]), torch.tensor([30, 20, 20]))
    assert budget.tolist() == [20, 4, 0]  # min(num_assistant_tokens, max_length - cur_len - 1), as transformers


def test_confident_length_keeps_the_first_unsure_token():
    probs = torch.tensor([[0.9, 0.8, 0.3, 0.9], [0.1, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.2]])
    threshold = torch.tensor([0.4, 0.4, 0.4, 0.0], dtype=torch.float64)
    assert confident_length(probs, threshold, torch.tensor([4, 4, 2, 4])).tolist() == [3, 1, 2, 4]


def sklearn_roc_curve(y_true, y_score):
    """scikit-learn's roc_curve(drop_intermediate=True), restated with numpy (scikit-learn is not installed)."""
    y_true, y_score = np.asarray(y_true, dtype=bool), np.asarray(y_score, dtype=np.float64)
    order = np.argsort(y_score, kind="mergesort")[::-1]
    score, truth = y_score[order], y_true[order]
    ends = np.r_[np.where(np.diff(score))[0], truth.size - 1]
    tps = np.cumsum(truth)[ends]
    fps = 1 + ends - tps
    thresholds = score[ends]
    if len(fps) > 2:
        keep = np.where(np.r_[True, np.logical_or(np.diff(fps, 2), np.diff(tps, 2)), True])[0]
        fps, tps, thresholds = fps[keep], tps[keep], thresholds[keep]
    tps, fps, thresholds = np.r_[0, tps], np.r_[0, fps], np.r_[np.inf, thresholds]
    return fps / fps[-1], tps / tps[-1], thresholds


def transformers_threshold(matches, probs):
    fpr, tpr, thresholds = sklearn_roc_curve(matches, probs)
    return thresholds[np.argmin(fpr + 3 * (1 - tpr))]


@FUZZ
@given(data=st.data(), batch=st.integers(1, 4), capacity=st.integers(2, 20), levels=st.sampled_from([3, 5, 1000]))
def test_roc_threshold_equals_the_scikit_learn_computation(data, batch, capacity, levels):
    probs = torch.zeros(batch, capacity, dtype=torch.float64)
    matches = torch.zeros(batch, capacity, dtype=torch.bool)
    counts = []
    for b in range(batch):
        count = data.draw(st.integers(2, capacity))
        hits = data.draw(st.lists(st.booleans(), min_size=count, max_size=count).filter(lambda m: 0 < sum(m) < len(m)))
        # Few levels make ties and collinear runs, the cases that decide which points are thinned.
        scores = data.draw(st.lists(st.integers(0, levels), min_size=count, max_size=count))
        probs[b, :count] = torch.tensor(scores, dtype=torch.float64) / levels
        probs[b, count:] = torch.rand(capacity - count, dtype=torch.float64)  # garbage past count
        matches[b, :count] = torch.tensor(hits)
        counts.append(count)
    got = roc_optimal_threshold(probs, matches, torch.tensor(counts))
    for b, count in enumerate(counts):
        assert got[b].item() == transformers_threshold(matches[b, :count].numpy(), probs[b, :count].numpy())


class ListedConfidence:
    """transformers' bookkeeping of ``probs`` / ``matches`` (AssistedCandidateGenerator), for one row."""

    def __init__(self, threshold):
        self.threshold, self.probs, self.matches = threshold, [], []

    def draft(self, probs):
        self.probs.extend(probs)

    def update(self, num_matches):
        self.matches.extend([1] * num_matches)
        if len(self.probs) > len(self.matches):
            self.matches.append(0)
        excess = len(self.probs) - len(self.matches)
        if excess > 0:
            del self.probs[-excess:]
        if len(self.probs) > 5 and {0, 1}.issubset(self.matches):
            self.threshold = transformers_threshold(self.matches, self.probs)


@FUZZ
@given(data=st.data(), batch=st.integers(1, 3), k=st.integers(1, 5))
def test_confidence_threshold_adapts_as_transformers_does(data, batch, k):
    rounds = data.draw(st.integers(1, 10))
    state = init_confidence(0.4, batch, capacity=rounds * (k + 1))
    references = [ListedConfidence(0.4) for _ in range(batch)]
    for _ in range(rounds):
        probs = torch.tensor([data.draw(st.lists(st.integers(1, 8), min_size=k, max_size=k)) for _ in range(batch)],
                             dtype=torch.float32) / 8
        proposed = torch.tensor([data.draw(st.integers(0, k)) for _ in range(batch)])
        accepted = torch.tensor([data.draw(st.integers(0, int(p))) for p in proposed])
        for b, ref in enumerate(references):
            ref.draft(probs[b, :proposed[b]].tolist())
            ref.update(int(accepted[b]))
        state = update_confidence(state, probs, proposed, accepted)
        for b, ref in enumerate(references):
            assert state.threshold[b].item() == ref.threshold
            assert state.probs[b, :state.count[b]].tolist() == ref.probs
            assert state.matches[b, :state.count[b]].long().tolist() == ref.matches


def test_confidence_does_not_adapt_when_off_and_reports_bad_values():
    state = init_confidence(0.0, 1, capacity=8)
    assert not state.adaptive
    after = update_confidence(state, torch.rand(1, 4), torch.tensor([4]), torch.tensor([1]))
    assert after is state
    with pytest.raises(ValueError, match="assistant_confidence_threshold"):
        init_confidence(1.5, 1, 8)
    with pytest.raises(ValueError, match="capacity"):
        init_confidence(0.4, 1, 0)


# --------------------------------------------------------------------------- compile safety

def test_the_pure_functions_trace_whole_under_torch_compile():
    """fullgraph=True fails on any graph break: a host sync, .item(), or branching on a tensor value."""
    torch._dynamo.reset()
    compile_ = lambda fn: torch.compile(fn, fullgraph=True, backend="eager", dynamic=False)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    batch, k, vocab = 3, 4, 9
    draft = torch.randint(0, vocab, (batch, k), generator=g)
    valid = torch.tensor([4, 2, 0])
    target, draft_logits = torch.randn(batch, k + 1, vocab, generator=g), torch.randn(batch, k, vocab, generator=g)
    keys, counter = R.as_row_keys(R.key(1), batch), torch.tensor([0, 5, 9])
    weight = torch.tensor([1.0, 0.5, 0.2])

    def both(*args):
        sampled = verify_sampling(*args[:5], draft_logits=args[5], ensemble_weight=args[6])
        matched = verify_sampling(*args[:5])
        greedy = limit_new_tokens(verify_greedy(*args[:3], args[5], args[6]), budget=args[4], eos_token_ids=(3,))
        return sampled.tokens, sampled.num_new, matched.tokens, matched.num_new, greedy.tokens, greedy.num_new

    args = (draft, valid, target, keys, counter, draft_logits, weight)
    for got, want in zip(compile_(both)(*args), both(*args)):
        assert torch.equal(got, want)

    tokens = torch.randint(0, 3, (batch, 20), generator=g)
    lengths = torch.tensor([20, 11, 3])
    lookup = lambda t, n, f: propose_prompt_lookup(t, n, 4, 2, eos_token_ids=(2,), first_column=f)  # noqa: E731
    for got, want in zip(compile_(lookup)(tokens, lengths, torch.tensor([0, 2, 1])),
                         lookup(tokens, lengths, torch.tensor([0, 2, 1]))):
        assert torch.equal(got, want)

    def adapt(state, probs, proposed, accepted):
        return update_confidence(state, probs, proposed, accepted).threshold

    state = init_confidence(0.4, batch, capacity=16)
    probs = torch.rand(batch, k, generator=g)
    proposed, accepted = torch.tensor([4, 4, 3]), torch.tensor([1, 4, 0])
    for _ in range(3):
        want = update_confidence(state, probs, proposed, accepted)
        assert torch.equal(compile_(adapt)(state, probs, proposed, accepted), want.threshold)
        state = want
    schedule = init_schedule(5, batch, "heuristic")
    moved = compile_(lambda s, a, p: update_schedule(s, a, p).num_tokens)(schedule, accepted, proposed)
    assert moved.tolist() == [4, 7, 4]
