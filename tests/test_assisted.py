"""Speculative decoding end to end: every proposer gives plain greedy's tokens, at batch 1 and at batch 4
with rows of different lengths (left padded), eagerly and compiled, and when every draft is kept or
every draft is rejected; sampling with a deterministic drafter reproduces plain sampling."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import genfn
from conftest import tiny_pair
from genfn.strategies.assisted.block import BlockDrafter
from genfn.strategies.assisted.drafter import Draft
from genfn.strategies.assisted import step as speculative
from genfn.strategies.assisted.drafter import PromptLookupDrafter
from genfn.strategies.assisted.step import speculative_strategy

MAX_CACHE = 64
NEW = 30
STATIC = dict(cache_implementation="static", max_cache_len=MAX_CACHE)
# Inductor without max-autotune: the same fullgraph compile the driver does, at a fraction of the build time.
COMPILED = dict(STATIC, compile_config=genfn.CompileConfig(fullgraph=True, mode="default"))
# Two proposers of each kind that the tests compile (one compile each, shared through the module's model).
PROPOSERS = {
    "prompt_lookup": dict(prompt_lookup_num_tokens=4),
    "early_exit": dict(assistant_early_exit=1, num_assistant_tokens=3),
    "draft_model": dict(num_assistant_tokens=3),  # assistant_model added by the test
}


@pytest.fixture(scope="module", autouse=True)
def many_compiled_steps():
    """Dynamo counts compiles per code object, and every compiled step runs the driver's one
    ``tensors_to_tensors``: this module compiles more distinct strategies than its default limit of 8."""
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 64
    yield
    torch._dynamo.config.recompile_limit = limit


@pytest.fixture(scope="module")
def models():
    """The target and a differently seeded assistant of the same shape (it drafts, often wrongly)."""
    _, target = tiny_pair()
    _, assistant = tiny_pair(seed=1)
    return target, assistant


def _repetitive_rows(lengths, seed=0):
    """Rows that repeat their first half, so prompt lookup finds matches; left padded with a mask."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for length in lengths:
        head = torch.randint(3, 97, (length,), generator=g)
        rows.append(torch.cat([head, head[: length // 2]]))
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.int64), r]) for r in rows])
    real = torch.tensor([len(r) for r in rows])
    mask = (torch.arange(width).unsqueeze(0) >= (width - real).unsqueeze(1)).long()
    return ids, mask


BATCH_1 = _repetitive_rows([11])
BATCH_4 = _repetitive_rows([5, 9, 12, 16])


def _kwargs(name, assistant):
    kwargs = dict(PROPOSERS[name])
    if name == "draft_model":
        kwargs["assistant_model"] = assistant
    return kwargs


def _plain(model, ids, mask):
    return genfn.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, disable_compile=True, **STATIC)


@pytest.mark.parametrize("batch", ["batch1", "batch4"])
@pytest.mark.parametrize("name", list(PROPOSERS))
def test_greedy_assisted_equals_plain_greedy_eager(models, name, batch):
    target, assistant = models
    ids, mask = BATCH_1 if batch == "batch1" else BATCH_4
    out = genfn.generate(target, ids, attention_mask=mask, max_new_tokens=NEW, return_dict_in_generate=True,
                         disable_compile=True, **STATIC, **_kwargs(name, assistant))
    assert torch.equal(out.sequences, _plain(target, ids, mask))
    stats = out.acceptance
    assert stats["total_rounds"] > 0 and stats["total_accepted"] <= stats["total_proposed"]
    # Every row gains its accepted drafts plus one target token a round, until it is done.
    gained = (stats["accepted"] + stats["rounds"]).tolist()
    assert gained == [NEW - 1] * ids.shape[0]


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_greedy_assisted_equals_plain_greedy_compiled_batch4(models, name):
    target, assistant = models
    ids, mask = BATCH_4
    before = set(target.compiled_steps)
    out = genfn.generate(target, ids, attention_mask=mask, max_new_tokens=NEW, **COMPILED, **_kwargs(name, assistant))
    compiled = set(target.compiled_steps) - before
    # Prompt lookup's rounds in which no row finds an earlier n-gram run the one-token step.
    expected = ["step", "step_without_drafts"] if name == "prompt_lookup" else ["step"]
    assert sorted(key[1].__name__ for key in compiled) == expected, "the speculative steps were not compiled"
    assert torch.equal(out, _plain(target, ids, mask))
    # A second call with other prompts of the same shape reuses the compiled steps.
    ids2, mask2 = _repetitive_rows([6, 10, 13, 16], seed=3)
    again = genfn.generate(target, ids2, attention_mask=mask2, max_new_tokens=NEW, **COMPILED,
                           **_kwargs(name, assistant))
    assert set(target.compiled_steps) - before == compiled
    assert torch.equal(again, _plain(target, ids2, mask2))


def test_default_dynamic_cache_and_eos_stop_rows_early(models):
    """The default (dynamic) cache rewinds too; a row that emits EOS gets padding after it."""
    target, _ = models
    ids, mask = BATCH_4
    plain_long = _plain(target, ids, mask)
    # Make a token the target actually emits mid-way in row 1 the EOS, so that row stops early.
    eos = int(plain_long[1, ids.shape[1] + 7])
    plain = genfn.generate(target, ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    out = genfn.generate(target, ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0,
                         prompt_lookup_num_tokens=5)
    assert (plain == 0).any(), "no row stopped early: the test did not exercise EOS"
    assert torch.equal(out, plain)


@dataclasses.dataclass(frozen=True, eq=False)
class OracleDrafter:
    """Drafts the known plain-greedy continuation (all kept), or it plus one (all rejected)."""

    continuation: torch.Tensor  # [B, W] the plain output, padded
    num_tokens: int = 4
    shift: int = 0

    @property
    def gives_logits(self) -> bool:
        return False

    def prefill(self, model, request):
        return self.continuation.clone()  # a leaf of the state, so the compiled step reads it as input

    def draft(self, model, state, view, cache):
        columns = view.cur_len.unsqueeze(1) + torch.arange(self.num_tokens)
        tokens = (state.gather(1, columns.clamp(max=state.shape[1] - 1)) + self.shift) % 97
        return Draft(tokens=tokens, num_valid=view.budget), state, cache

    def commit(self, state, verified, view):
        return state


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("outcome", ["all_kept", "all_rejected"])
def test_all_kept_and_all_rejected_drafts(models, outcome, compiled):
    target, _ = models
    ids, mask = BATCH_4
    plain = _plain(target, ids, mask)
    oracle = torch.cat([plain, torch.zeros(plain.shape[0], 16, dtype=torch.int64)], dim=1)
    drafter = OracleDrafter(oracle, shift=0 if outcome == "all_kept" else 1)
    settings = dict(COMPILED) if compiled else dict(STATIC, disable_compile=True)
    out = genfn.generate(target, ids, attention_mask=mask, max_new_tokens=NEW, return_dict_in_generate=True,
                         strategy=speculative_strategy(drafter), **settings)
    assert torch.equal(out.sequences, plain)
    stats = out.acceptance
    if outcome == "all_kept":
        assert torch.equal(stats["accepted"], stats["proposed"])
        # 29 tokens after the first, 5 a round: 6 rounds (the last one cut by max_length).
        assert stats["rounds"].tolist() == [6] * 4
    else:
        assert stats["total_accepted"] == 0 and stats["total_proposed"] > 0
        assert stats["rounds"].tolist() == [NEW - 1] * 4


def test_same_model_as_assistant_keeps_every_draft(models):
    target, _ = models
    ids, mask = BATCH_4
    out = genfn.generate(target, ids, attention_mask=mask, max_new_tokens=NEW, return_dict_in_generate=True,
                         disable_compile=True, assistant_model=target, num_assistant_tokens=3,
                         assistant_confidence_threshold=0.0, **STATIC)
    assert torch.equal(out.sequences, _plain(target, ids, mask))
    assert out.acceptance["acceptance_rate"] > 0.99


def test_sampling_with_prompt_lookup_reproduces_plain_sampling(models):
    """A drafter without logits is verified by matching the plain-sampling noise: same key, same tokens."""
    target, _ = models
    ids, mask = BATCH_4
    settings = dict(do_sample=True, top_k=None, key=7, max_new_tokens=NEW, disable_compile=True, **STATIC)
    plain = genfn.generate(target, ids, attention_mask=mask, **settings)
    out = genfn.generate(target, ids, attention_mask=mask, prompt_lookup_num_tokens=4, **settings)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_rounds_without_drafts_run_the_one_token_step_and_change_nothing(models, do_sample):
    """Where no row's n-gram occurs earlier, the round runs ``step_without_drafts`` (a one-token
    forward) instead of the ``k + 1``-wide one; tokens, acceptance statistics and sampled draws are
    those of the wide round on every state."""
    target, _ = models
    ids, mask = BATCH_4
    picked = []

    def counting(state):
        chosen = speculative.pick_step(state)
        picked.append(chosen.__name__)
        return chosen

    narrow = dataclasses.replace(speculative_strategy(PromptLookupDrafter(num_tokens=4)), pick_step=counting)
    wide = dataclasses.replace(narrow, pick_step=None)
    settings = dict(max_new_tokens=NEW, return_dict_in_generate=True, disable_compile=True, **STATIC)
    if do_sample:
        settings.update(do_sample=True, top_k=None, key=11)
    out = genfn.generate(target, ids, attention_mask=mask, strategy=narrow, **settings)
    reference = genfn.generate(target, ids, attention_mask=mask, strategy=wide, **settings)
    assert "step_without_drafts" in picked and "step" in picked
    assert torch.equal(out.sequences, reference.sequences)
    for name in ("proposed", "accepted", "rounds"):
        assert torch.equal(out.acceptance[name], reference.acceptance[name]), name
    if not do_sample:
        assert torch.equal(out.sequences, _plain(target, ids, mask))


def test_pick_step_reads_the_pending_block(models):
    def state_with(num_valid):
        pending = Draft(tokens=torch.zeros(len(num_valid), 4, dtype=torch.int64), num_valid=torch.tensor(num_valid))
        return types.SimpleNamespace(pending=pending)

    assert speculative.pick_step(state_with([0, 2])) is speculative.step
    assert speculative.pick_step(state_with([0, 0])) is speculative.step_without_drafts
    assert speculative.pick_step(types.SimpleNamespace(pending=None)) is speculative.step
    with pytest.raises(ValueError, match="pending block"):
        speculative.step_without_drafts(None, types.SimpleNamespace(pending=None))
    assert speculative_strategy(PromptLookupDrafter(num_tokens=4)).pick_step is speculative.pick_step
    # A model drafter drafts while its budget lasts: its strategy always runs the wide step.
    plain = _plain(*models[:1], *BATCH_1)
    assert speculative_strategy(OracleDrafter(plain, shift=0)).pick_step is None


def test_sampled_drafts_from_a_draft_model_give_valid_keyed_sequences(models):
    target, assistant = models
    ids, mask = BATCH_4
    settings = dict(do_sample=True, top_k=None, key=11, max_new_tokens=NEW, disable_compile=True,
                    assistant_model=assistant, num_assistant_tokens=3, **STATIC)
    first = genfn.generate(target, ids, attention_mask=mask, **settings)
    second = genfn.generate(target, ids, attention_mask=mask, **settings)
    assert torch.equal(first, second)
    assert first.shape == (4, ids.shape[1] + NEW)
    assert torch.equal(first[:, : ids.shape[1]], ids)


def test_heuristic_schedule_grows_on_full_acceptance_and_carries_across_calls(models):
    from genfn.generation import prepare_request
    from genfn.strategies.assisted.build import carried_schedules

    target, _ = models
    ids, mask = BATCH_1
    # The target drafting for itself with no confidence stop: every draft is kept, so "heuristic"
    # adds 2 after every round.
    settings = dict(max_new_tokens=NEW, disable_compile=True, assistant_model=target, num_assistant_tokens=3,
                    assistant_confidence_threshold=0.0, **STATIC)
    out = genfn.generate(target, ids, attention_mask=mask, return_dict_in_generate=True,
                         num_assistant_tokens_schedule="heuristic", **settings)
    carried = carried_schedules[target]
    rounds = int(out.acceptance["total_rounds"])
    assert carried.kind == "heuristic" and int(carried.num_tokens[0]) == 3 + 2 * rounds
    request, strategy = prepare_request(target, ids, attention_mask=mask, num_assistant_tokens_schedule="heuristic",
                                        **settings)
    assert int(strategy.init(target, request).schedule.num_tokens[0]) == 3 + 2 * rounds
    # "heuristic_transient" starts every call afresh.
    request, strategy = prepare_request(target, ids, attention_mask=mask,
                                        num_assistant_tokens_schedule="heuristic_transient", **settings)
    assert int(strategy.init(target, request).schedule.num_tokens[0]) == 3
    carried_schedules.pop(target)


def test_errors_name_the_argument(models):
    target, assistant = models
    ids, mask = BATCH_1
    with pytest.raises(ValueError, match="assistant_ensemble_weight"):
        genfn.generate(target, ids, max_new_tokens=4, prompt_lookup_num_tokens=3, assistant_ensemble_weight=0.5)
    with pytest.raises(ValueError, match="assistant_early_exit"):
        genfn.generate(target, ids, max_new_tokens=4, assistant_early_exit=2)  # the tiny model has 2 layers
    with pytest.raises(ValueError, match="use_mtp"):
        genfn.generate(target, ids, max_new_tokens=4, use_mtp=True)
    with pytest.raises(ValueError, match="num_layers"):
        target.apply(ids, torch.arange(ids.shape[1]).unsqueeze(0), target.init_cache(1, 32), num_layers=3)


def test_smollm2_prompt_lookup_equals_greedy(smollm2):
    text = ("Rewrite the passage in plain words.\nPassage: The committee met on Tuesday and agreed that the "
            "new library will open in the spring, after the roof repairs are finished.\nRewrite:")
    ids = torch.tensor([smollm2.tokenizer.encode(text)])
    plain = genfn.generate(smollm2, ids, max_new_tokens=24)
    out = genfn.generate(smollm2, ids, max_new_tokens=24, prompt_lookup_num_tokens=8, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.acceptance["total_rounds"] < 23 or out.acceptance["total_accepted"] == 0


@pytest.fixture(scope="module")
def small_vocab():
    """A target and a draft model over 16 tokens, different enough that drafts get rejected."""
    _, target = tiny_pair(vocab_size=16, seed=2)
    _, assistant = tiny_pair(vocab_size=16, seed=3)
    for model in (target, assistant):
        # Random init gives near-uniform next-token distributions; sharper ones make p, q and their
        # mixtures easy to tell apart, so the test has power.
        model.params["lm_head"] = model.params["lm_head"] * 8
    return target, assistant


def _second_token_distribution(model, sequences, prompt_len):
    """``[B, V]`` the model's next-token distribution after each row's prompt and first new token."""
    context = sequences[:, : prompt_len + 1]
    positions = torch.arange(context.shape[1]).expand_as(context)
    logits, _ = model.apply(context, positions, model.init_cache(context.shape[0], context.shape[1] + 1))
    return logits[:, -1].softmax(dim=-1).double()


def _goodness_of_fit(tokens, expected_probs) -> float:
    from scipy import stats

    counts = torch.bincount(tokens, minlength=expected_probs.shape[1]).double()
    expected = expected_probs.sum(dim=0)
    keep = expected > 5  # Pearson's approximation needs enough expected counts per cell
    return float(stats.chisquare(counts[keep], expected[keep] * counts[keep].sum() / expected[keep].sum()).pvalue)


@pytest.mark.parametrize("ensemble_weight", [None, 0.4], ids=["speculative", "ensemble"])
def test_speculative_sampling_keeps_the_target_distribution(small_vocab, ensemble_weight):
    """Over 4000 keyed rows, the first speculatively chosen token follows the target's distribution
    (or the ensemble's mixture ``w p + (1 - w) q``) given each row's context, and not the drafter's."""
    target, assistant = small_vocab
    rows, prompt = 4000, torch.tensor([[5, 9, 3]])
    out = genfn.generate(target, prompt.expand(rows, -1), do_sample=True, top_k=None, key=123, max_new_tokens=3,
                         assistant_model=assistant, num_assistant_tokens=2, assistant_confidence_threshold=0.0,
                         assistant_ensemble_weight=ensemble_weight, return_dict_in_generate=True,
                         disable_compile=True, **STATIC)
    sequences = out.sequences
    real = sequences[:, 3] != 2  # rows whose first token was EOS stop there
    p = _second_token_distribution(target, sequences[real], 3)
    q = _second_token_distribution(assistant, sequences[real], 3)
    second = sequences[real, 4]
    assert out.acceptance["acceptance_rate"] < 0.95, "the drafter agrees too often to test the rejection path"
    w = 1.0 if ensemble_weight is None else ensemble_weight
    assert _goodness_of_fit(second, w * p + (1 - w) * q) > 1e-3
    assert _goodness_of_fit(second, q) < 1e-6
    if ensemble_weight is not None:
        assert _goodness_of_fit(second, p) < 1e-6


def test_sampled_assisted_rows_do_not_depend_on_the_batch(small_vocab):
    """The same per-row key gives the same tokens alone and inside a batch."""
    from genfn import random as grandom

    target, assistant = small_vocab
    ids = torch.tensor([[5, 9, 3, 7], [4, 4, 11, 6], [8, 1, 12, 3]])
    keys = grandom.as_row_keys(grandom.key(5), 3)
    settings = dict(do_sample=True, top_k=None, max_new_tokens=12, assistant_model=assistant, num_assistant_tokens=3,
                    disable_compile=True, **STATIC)
    together = genfn.generate(target, ids, key=keys, **settings)
    for b in range(3):
        alone = genfn.generate(target, ids[b: b + 1], key=keys[b: b + 1], **settings)
        assert torch.equal(alone[0], together[b, : alone.shape[1]])


@dataclasses.dataclass(frozen=True, eq=False)
class CheckingBlockDrafter(BlockDrafter):
    """A block drafter whose state records, per row, whether the hidden state it was given is the one
    whose logits chose the newest token (the target's LM head on it gives back that token)."""

    lm_head: torch.Tensor = None

    def prefill(self, model, request):
        return torch.ones(request.batch_size, dtype=torch.bool)

    def draft(self, model, state, view, cache):
        draft, _, cache = super().draft(model, None, view, cache)
        newest = view.tokens.gather(1, (view.cur_len - 1).unsqueeze(1)).squeeze(1)
        chosen = (view.target_hidden[:, -1] @ self.lm_head.T).argmax(dim=-1)
        return draft, state & (chosen == newest), cache


def _random_block_head(params, hidden, newest):
    """A tiny random block drafter: k logit rows from the hidden state and the newest token's embedding."""
    mixed = hidden[:, -1] + params["embed"][newest]
    return torch.einsum("bh,khv->bkv", mixed, params["proj"])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_block_drafter_equals_plain_greedy_and_reads_the_right_hidden_state(models, compiled):
    from genfn import driver
    from genfn.generation import prepare_request

    target, _ = models
    ids, mask = BATCH_4
    g = torch.Generator().manual_seed(4)
    params = {"embed": target.params["embed"], "proj": torch.randn(3, 64, 97, generator=g)}
    drafter = CheckingBlockDrafter(head=_random_block_head, params=params, num_tokens=3,
                                   lm_head=target.params["lm_head"])
    settings = dict(COMPILED) if compiled else dict(STATIC, disable_compile=True)
    request, strategy = prepare_request(target, ids, attention_mask=mask, max_new_tokens=NEW,
                                        speculation_type="dflash", assistant_model=drafter, **settings)
    options = driver.compile_options_for(request.config, target.device)
    assert (options is not None) == compiled
    state = driver.run(strategy, target, strategy.init(target, request), num_steps=NEW - 1, compile_options=options)
    assert torch.equal(state.tokens[:, : int(state.cur_len.max())], _plain(target, ids, mask))
    assert bool(state.drafter_state.all())


def test_mtp_heads_draft_and_greedy_equals_plain():
    _, model = tiny_pair()
    g = torch.Generator().manual_seed(5)
    hidden = model.spec.hidden_size
    model.params["mtp"] = [{"enorm": torch.ones(hidden), "hnorm": torch.ones(hidden),
                            "eh_proj": torch.randn(hidden, 2 * hidden, generator=g) / (2 * hidden) ** 0.5}
                           for _ in range(2)]
    for ids, mask in (BATCH_1, BATCH_4):
        out = genfn.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, use_mtp=True,
                             return_dict_in_generate=True, disable_compile=True, **STATIC)
        assert torch.equal(out.sequences, _plain(model, ids, mask))
        # Two heads: at most two drafts a round.
        assert int(out.acceptance["proposed"].max()) <= 2 * int(out.acceptance["rounds"].max())
