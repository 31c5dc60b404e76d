"""Sliding windows over caches with holes: a native Mistral's window spans each row's last real tokens.

A growing cache (dynamic, offloaded, quantized) appends every row at the shared end and rewinds by
truncating to the longest row and masking the shorter rows' tails; joining a shorter row widens it
with masked columns. Either way a row ends up with masked slots *inside* its window, so the window
must be counted in real tokens, not slots. These tests run speculative decoding (which rewinds every
round) at batch 4 with rows of different lengths and a window shorter than the sequences, and
compare logits after a rewind or a join with a fresh forward over the same tokens.
"""

from __future__ import annotations

import pytest
import torch

import genfn
from conftest import tiny_pair
from genfn.cache.base import begin_forward, real_tokens_back

WINDOW = 4  # far shorter than every row's prompt plus its new tokens
NEW = 24
GROWING = {
    "dynamic": dict(cache_implementation="dynamic"),
    "offloaded": dict(cache_implementation="offloaded"),
    # A residual window longer than any sequence keeps every token in full precision, so the
    # tokens must equal transformers' exactly (quantization itself is tested in test_caches.py).
    "quantized": dict(cache_implementation="quantized", cache_config={"residual_length": 128}),
}


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def models():
    """(transformers Mistral, genfn's native Mistral on its weights, a differently seeded native draft model)."""
    hf, target = tiny_pair("MistralForCausalLM", sliding_window=WINDOW)
    _, assistant = tiny_pair("MistralForCausalLM", seed=1, sliding_window=WINDOW)
    assert target.spec.sliding_window == WINDOW
    return hf, target, assistant


def _repetitive_rows(lengths, seed=0):
    """Left-padded rows that repeat their first half, so prompt lookup finds (partly wrong) matches."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for length in lengths:
        head = torch.randint(3, 97, (length,), generator=g)
        rows.append(torch.cat([head, head[: length // 2]]))
    return _left_padded(rows)


def _left_padded(rows):
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.int64), r]) for r in rows])
    real = torch.tensor([len(r) for r in rows])
    mask = (torch.arange(width).unsqueeze(0) >= (width - real).unsqueeze(1)).long()
    return ids, mask


BATCH_4 = _repetitive_rows([5, 9, 12, 16])


@pytest.fixture(scope="module")
def plain_greedy(models):
    """Plain greedy on the native model (static cache: no holes), checked against transformers once."""
    hf, target, _ = models
    ids, mask = BATCH_4
    out = genfn.generate(target, ids, attention_mask=mask, max_new_tokens=NEW, disable_compile=True,
                         cache_implementation="static", max_cache_len=64)
    with torch.no_grad():
        ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, ref)
    return out


def _speculative_kwargs(proposer, assistant):
    if proposer == "prompt_lookup":
        return dict(prompt_lookup_num_tokens=4)
    return dict(assistant_model=assistant, num_assistant_tokens=3)


@pytest.mark.parametrize("cache", list(GROWING))
@pytest.mark.parametrize("proposer", ["prompt_lookup", "draft_model"])
def test_speculative_greedy_on_growing_caches_equals_plain_greedy_and_transformers(models, plain_greedy, proposer,
                                                                                   cache):
    hf, target, assistant = models
    ids, mask = BATCH_4
    out = genfn.generate(target, ids, attention_mask=mask, max_new_tokens=NEW, disable_compile=True,
                         **GROWING[cache], **_speculative_kwargs(proposer, assistant))
    assert torch.equal(out, plain_greedy), f"rows that differ: {(out != plain_greedy).any(1).tolist()}"


def test_plain_greedy_on_the_default_growing_cache_equals_transformers(models, plain_greedy):
    _, target, _ = models
    ids, mask = BATCH_4
    out = genfn.generate(target, ids, attention_mask=mask, max_new_tokens=NEW, disable_compile=True)
    assert torch.equal(out, plain_greedy)


def test_beam_search_on_a_dynamic_cache_equals_transformers(models):
    # Beams reorder rows (their validity moves with them) and rows have different lengths.
    hf, target, _ = models
    ids, mask = _repetitive_rows([4, 10], seed=3)
    settings = dict(max_new_tokens=12, num_beams=3, num_return_sequences=2, return_dict_in_generate=True,
                    output_scores=True)
    with torch.no_grad():
        ref = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, **settings)
    out = genfn.generate(target, ids, attention_mask=mask, disable_compile=True, cache_implementation="dynamic",
                         **settings)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- logits after rewinds and joins

def _forward(model, cache, tokens, positions, mask=None):
    with torch.no_grad():
        return model.apply(tokens, positions, cache, mask)


def _fresh_logits(model, rows):
    """Logits of one forward over ``rows`` (left padded), each row's real positions only, right aligned."""
    ids, mask = _left_padded(rows)
    return model(ids, mask).logits


def _random_tokens(shape, seed):
    return torch.randint(3, 97, shape, generator=torch.Generator().manual_seed(seed))


CACHES = {**{name: (settings["cache_implementation"], settings.get("cache_config")) for name, settings in GROWING.items()},
          "static": ("static", None), "offloaded_static": ("offloaded_static", None)}


@pytest.mark.parametrize("cache_name", list(CACHES))
def test_logits_after_rewind_and_reappend_equal_a_fresh_forward(models, cache_name):
    _, target, _ = models
    implementation, cache_config = CACHES[cache_name]
    prompts = [_random_tokens((n,), seed=n) for n in (3, 6, 8, 5)]
    ids, mask = _left_padded(prompts)
    width, batch = ids.shape[1], ids.shape[0]
    real = mask.sum(1)
    cache = target.init_cache(batch, 40, implementation, cache_config)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    _, cache = _forward(target, cache, ids, positions, mask)

    # A 6-token draft per row, then each row keeps a different number of them (the longest keeps all).
    draft = _random_tokens((batch, 6), seed=100)
    _, cache = _forward(target, cache, draft, real.unsqueeze(1) + torch.arange(6))
    kept = torch.tensor([0, 2, 6, 1])
    cache = cache.rewind(width + kept)
    follow = _random_tokens((batch, 5), seed=200)
    logits, cache = _forward(target, cache, follow, (real + kept).unsqueeze(1) + torch.arange(5))

    rows = [torch.cat([prompts[b], draft[b, :kept[b]], follow[b]]) for b in range(batch)]
    fresh = _fresh_logits(target, rows)[:, -5:]
    torch.testing.assert_close(logits, fresh, atol=1e-5, rtol=1e-5)


def test_logits_of_a_row_joined_into_a_longer_dynamic_batch_equal_a_fresh_forward(models):
    # Joining widens the shorter row with masked columns: holes between its prompt and its next tokens.
    _, target, _ = models
    running = [_random_tokens((n,), seed=10 + n) for n in (9, 7)]
    ids, mask = _left_padded(running)
    cache = target.init_cache(2, 0, "dynamic")
    _, cache = _forward(target, cache, ids, (mask.cumsum(1) - 1).clamp(min=0), mask)
    joining = _random_tokens((3,), seed=30)
    joined = target.init_cache(1, 0, "dynamic")
    _, joined = _forward(target, joined, joining.unsqueeze(0), torch.arange(3).unsqueeze(0))
    cache = cache.with_rows([1], joined)

    follow = _random_tokens((2, 6), seed=40)
    lengths = torch.tensor([len(running[0]), 3])
    logits, _ = _forward(target, cache, follow, lengths.unsqueeze(1) + torch.arange(6))
    fresh = _fresh_logits(target, [torch.cat([running[0], follow[0]]), torch.cat([joining, follow[1]])])[:, -6:]
    torch.testing.assert_close(logits, fresh, atol=1e-5, rtol=1e-5)


def test_real_tokens_back_counts_real_tokens_not_slots():
    valid = torch.tensor([[False, True, True, False, False, True, True],
                          [True, True, True, True, True, True, True]])
    slots = torch.tensor([[5, 6], [5, 6]])
    back = real_tokens_back(valid, slots, attend_len=7)
    # Row 0: the holes at slots 3-4 are not counted; slot 2 is one real token behind slot 5.
    assert back[0, 0, :6].tolist() == [3, 2, 1, 1, 1, 0]
    assert back[0, 1, :7].tolist() == [4, 3, 2, 2, 2, 1, 0]
    assert back[1, 1].tolist() == [6, 5, 4, 3, 2, 1, 0]


@pytest.mark.parametrize("implementation", ["static", "offloaded_static"])
def test_fixed_size_caches_keep_rows_gapless_so_slot_and_token_windows_agree(models, implementation):
    # Why the fixed-size caches may keep the cheaper slot-distance window: after left padding, a
    # rewind and a re-append, every row's real tokens are still contiguous.
    _, target, _ = models
    ids, mask = _left_padded([_random_tokens((n,), seed=n) for n in (2, 7, 4)])
    cache = target.init_cache(3, 32, implementation)
    assert not cache.rows_have_holes
    _, cache = _forward(target, cache, ids, (mask.cumsum(1) - 1).clamp(min=0), mask)
    _, cache = _forward(target, cache, _random_tokens((3, 5), seed=1), torch.arange(5).expand(3, 5))
    cache = cache.rewind(torch.tensor([8, 10, 12]))
    cache, slots, attend_len = begin_forward(cache, _random_tokens((3, 4), seed=2))
    columns = torch.arange(attend_len)
    seen = (columns <= slots.unsqueeze(2)) & cache.valid[:, :attend_len].unsqueeze(1)
    by_slots = slots.unsqueeze(2) - columns < WINDOW
    by_tokens = real_tokens_back(cache.valid, slots, attend_len) < WINDOW
    assert torch.equal(seen & by_slots, seen & by_tokens)
    assert (seen & ~by_slots).any()  # the window does cut keys off here


def test_growing_caches_declare_holes(models):
    _, target, _ = models
    for name, (implementation, cache_config) in CACHES.items():
        cache = target.init_cache(2, 16, implementation, cache_config)
        assert cache.rows_have_holes == (name in GROWING), name


# --------------------------------------------------------------------------- compiled

def test_compiled_static_prompt_lookup_equals_eager_dynamic_and_the_holes_mask_traces(models, plain_greedy):
    _, target, _ = models
    ids, mask = BATCH_4
    compiled = genfn.generate(target, ids, attention_mask=mask, max_new_tokens=NEW, prompt_lookup_num_tokens=4,
                              cache_implementation="static", max_cache_len=64,
                              compile_config=genfn.CompileConfig(fullgraph=True, mode="default"))
    eager = genfn.generate(target, ids, attention_mask=mask, max_new_tokens=NEW, prompt_lookup_num_tokens=4,
                           disable_compile=True, cache_implementation="dynamic")
    assert torch.equal(compiled, plain_greedy) and torch.equal(eager, plain_greedy)

    # The token-counted window is pure (no host sync): it traces into one graph.
    cache = target.init_cache(2, 0, "dynamic")
    cache, slots, attend_len = begin_forward(cache, torch.ones(2, 5, dtype=torch.int64),
                                             torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]))
    cache = cache.rewind(torch.tensor([3, 5]))
    cache, slots, attend_len = begin_forward(cache, torch.ones(2, 2, dtype=torch.int64))
    traced = torch.compile(real_tokens_back, fullgraph=True, backend="eager")
    assert torch.equal(traced(cache.valid, slots, attend_len), real_tokens_back(cache.valid, slots, attend_len))
