"""Beam search and beam sampling: transformers' tokens, scores and beam indices on the same weights."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import genfn
from conftest import tiny_pair
from genfn.generation import prepare_request
from genfn.state.base import tree_flatten
from genfn.strategies import beam

# tiny random models: (architecture, overrides). Small vocabularies and several EOS ids make
# hypotheses finish early, so finished-beam bookkeeping, early stopping and padding all matter.
SMALL = dict(hidden_size=32, intermediate_size=48)
TINY = {
    "llama_eos1": ("LlamaForCausalLM", dict(seed=0, vocab_size=16, eos_token_id=2, **SMALL)),
    "llama_eos2": ("LlamaForCausalLM", dict(seed=1, vocab_size=32, eos_token_id=[2, 5], **SMALL)),
    "llama_tied_mqa": ("LlamaForCausalLM", dict(seed=2, vocab_size=24, eos_token_id=[3, 4, 7], tie_word_embeddings=True,
                                                num_key_value_heads=1, **SMALL)),
    "qwen2": ("Qwen2ForCausalLM", dict(seed=3, vocab_size=20, eos_token_id=2, **SMALL)),
    "no_eos": ("LlamaForCausalLM", dict(seed=4, vocab_size=32, eos_token_id=None, **SMALL)),
}
_PAIRS: dict = {}


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def pair(name):
    if name not in _PAIRS:
        arch, overrides = TINY[name]
        _PAIRS[name] = tiny_pair(arch, **overrides)
    return _PAIRS[name]


def padded_prompts(vocab, batch=3, length=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    if batch > 2:
        mask[2, :3] = 0
    return ids * mask, mask  # padding positions hold token 0 (pad), as a tokenizer would leave them


def assert_same_beams(ref, out, scores_atol=1e-4, scores_rtol=0.0):
    assert out.sequences.shape == ref.sequences.shape
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.equal(out.beam_indices, ref.beam_indices)
    assert out.beam_indices.dtype == ref.beam_indices.dtype
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, atol=scores_atol, rtol=scores_rtol)
    assert len(out.scores) == len(ref.scores)
    for a, b in zip(out.scores, ref.scores):
        finite = torch.isfinite(b)
        assert torch.equal(finite, torch.isfinite(a))
        torch.testing.assert_close(a[finite], b[finite], atol=scores_atol, rtol=0)


def run_both(hf, gm, ids, mask, **kwargs):
    kwargs = dict(return_dict_in_generate=True, output_scores=True, **kwargs)
    with torch.no_grad():
        ref = hf.generate(input_ids=ids, attention_mask=mask, **kwargs)
    out = genfn.generate(gm, ids, attention_mask=mask, **kwargs)
    return ref, out


GRID = list(itertools.product([2, 4], [False, True, "never"], [-1.0, 0.0, 1.0, 2.0], ["one", "all"]))


@pytest.mark.parametrize("num_beams,early_stopping,length_penalty,returns", GRID,
                         ids=[f"k{k}-es{e}-lp{lp:g}-{r}" for k, e, lp, r in GRID])
def test_beam_search_matches_transformers_grid(num_beams, early_stopping, length_penalty, returns):
    hf, gm = pair("llama_eos2")
    ids, mask = padded_prompts(32)
    ref, out = run_both(hf, gm, ids, mask, max_new_tokens=16, num_beams=num_beams, early_stopping=early_stopping,
                        length_penalty=length_penalty, num_return_sequences=1 if returns == "one" else num_beams)
    assert_same_beams(ref, out)


# Every other tiny model on a covering subset, plus processors that read the beam rows.
CASES = [
    dict(num_beams=2),
    dict(num_beams=4, num_return_sequences=4, length_penalty=2.0),
    dict(num_beams=4, num_return_sequences=2, early_stopping=True, length_penalty=-1.0),
    dict(num_beams=2, num_return_sequences=2, early_stopping="never", length_penalty=0.0),
    dict(num_beams=3, early_stopping="never", length_penalty=1.0, min_new_tokens=6),
    dict(num_beams=4, num_return_sequences=3, repetition_penalty=1.3, no_repeat_ngram_size=2),
]
MODEL_CASES = [(m, c) for m in ("llama_eos1", "llama_tied_mqa", "qwen2", "no_eos") for c in range(len(CASES))]


@pytest.mark.parametrize("model,case", MODEL_CASES, ids=[f"{m}-{c}" for m, c in MODEL_CASES])
def test_beam_search_matches_transformers_models(model, case):
    hf, gm = pair(model)
    ids, mask = padded_prompts(gm.vocab_size, seed=case)
    ref, out = run_both(hf, gm, ids, mask, max_new_tokens=14, **CASES[case])
    assert_same_beams(ref, out)


def test_max_length_counts_the_prompt_and_unpadded_batch():
    hf, gm = pair("llama_eos1")
    ids = torch.randint(3, 16, (2, 5), generator=torch.Generator().manual_seed(7))
    ref, out = run_both(hf, gm, ids, torch.ones_like(ids), max_length=17, num_beams=3, num_return_sequences=3)
    assert_same_beams(ref, out)
    assert out.sequences.shape[1] <= 17


def test_early_finishing_is_covered():
    """The grid model really does end hypotheses early (EOS), so the finished-beam paths run."""
    hf, gm = pair("llama_eos2")
    ids, mask = padded_prompts(32)
    out = genfn.generate(gm, ids, attention_mask=mask, max_new_tokens=16, num_beams=4, num_return_sequences=4,
                         return_dict_in_generate=True, output_scores=True)
    assert (out.beam_indices == -1).any()
    ended = (out.beam_indices == -1).any(-1)
    assert bool((out.sequences[ended] == 2).any() | (out.sequences[ended] == 5).any())


def test_without_eos_the_fill_value_is_minus_one_like_transformers():
    hf, gm = pair("no_eos")
    ids, mask = padded_prompts(32)
    ref, out = run_both(hf, gm, ids, mask, max_new_tokens=5, num_beams=2)
    assert_same_beams(ref, out)
    assert out.sequences.shape[1] == ids.shape[1] + 5


def test_plain_tensor_output():
    hf, gm = pair("llama_eos1")
    ids, mask = padded_prompts(16)
    with torch.no_grad():
        ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, num_beams=3)
    out = genfn.generate(gm, ids, attention_mask=mask, max_new_tokens=8, num_beams=3)
    assert isinstance(out, torch.Tensor) and torch.equal(out, ref)


# ---------------------------------------------------------------------------------------------
# SmolLM2


SMOL_CASES = [
    dict(num_beams=2),
    dict(num_beams=4, num_return_sequences=2, length_penalty=2.0, early_stopping=True),
    dict(num_beams=2, num_return_sequences=2, early_stopping="never", length_penalty=-1.0),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(SMOL_CASES)))
def test_beam_search_matches_transformers_smollm2(case, smollm2, hf_smollm2, smollm2_prompts):
    ids = torch.as_tensor(smollm2_prompts["input_ids"])
    mask = torch.as_tensor(smollm2_prompts["attention_mask"])
    ref, out = run_both(hf_smollm2, smollm2, ids, mask, max_new_tokens=12, **SMOL_CASES[case])
    # Tokens and beam indices are exact. The summed scores (~60 in magnitude after 12 steps of a
    # 576-wide model) differ by float32 summation order between genfn's kernels and MKL: up to
    # 1.4e-4 on AMD Zen 4, i.e. 2e-6 relative, hence a relative bound on top of the absolute one.
    assert_same_beams(ref, out, scores_rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# beam sampling


def test_beam_sample_is_a_function_of_the_key():
    _, gm = pair("llama_eos2")
    ids, mask = padded_prompts(32)
    kwargs = dict(max_new_tokens=10, num_beams=3, do_sample=True, num_return_sequences=3, temperature=1.5,
                  return_dict_in_generate=True, output_scores=True)
    a = genfn.generate(gm, ids, attention_mask=mask, key=genfn.random.key(11), **kwargs)
    b = genfn.generate(gm, ids, attention_mask=mask, key=genfn.random.key(11), **kwargs)
    c = genfn.generate(gm, ids, attention_mask=mask, key=genfn.random.key(12), **kwargs)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.sequences_scores, b.sequences_scores)
    assert torch.equal(a.beam_indices, b.beam_indices)
    assert not torch.equal(a.sequences, c.sequences)
    # A prompt's beams depend on its own key only, not on the rest of the batch.
    keys = genfn.random.as_row_keys(genfn.random.key(11), 3)
    alone = genfn.generate(gm, ids[1:2, 2:], key=keys[1:2], **kwargs)
    length = alone.sequences.shape[1]
    assert torch.equal(alone.sequences, a.sequences[3:6, 2 : 2 + length])
    assert torch.equal(alone.beam_indices % 3, a.beam_indices[3:6, : length - 4] % 3)


def _chi_square_threshold(df: int, z: float = 3.29) -> float:
    """Upper quantile of chi-square(df) (Wilson-Hilferty); z=3.29 is the 0.9995 normal quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_beam_sample_distribution_matches_transformers():
    """Gumbel-top-k draws the candidates transformers' multinomial (without replacement) draws.

    Thousands of identical prompts in one batch are thousands of independent runs (transformers:
    one torch seed; genfn: one key, folded per row). The first two generated tokens of both
    returned hypotheses follow the same law: a two-sample chi-square test at 0.9995 and a
    total-variation bound.
    """
    vocab, rows = 12, 3000
    hf, gm = tiny_pair("LlamaForCausalLM", seed=5, vocab_size=vocab, eos_token_id=2, **SMALL)
    prompt = torch.tensor([[5, 7, 3, 9]]).repeat(rows, 1)
    kwargs = dict(num_beams=2, do_sample=True, max_new_tokens=3, temperature=1.5, num_return_sequences=2)
    torch.manual_seed(0)
    with torch.no_grad():
        ref = hf.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    out = genfn.generate(gm, prompt, key=0, **kwargs)
    assert ref.shape == out.shape == (2 * rows, 7)
    for hypothesis, column in itertools.product([0, 1], [4, 5]):
        a = torch.bincount(ref.view(rows, 2, -1)[:, hypothesis, column], minlength=vocab).double()
        b = torch.bincount(out.view(rows, 2, -1)[:, hypothesis, column], minlength=vocab).double()
        used = (a + b) > 10
        chi_square = float((((a - b) ** 2) / (a + b))[used].sum())
        assert chi_square < _chi_square_threshold(int(used.sum()) - 1), (hypothesis, column, a, b)
        assert 0.5 * float((a - b).abs().sum()) / rows < 0.06


def test_beam_sample_processors_follow_transformers_settings():
    """Beam sampling keeps num_eos + 1 tokens through the warpers (min_tokens_to_keep), as transformers."""
    _, gm = pair("llama_eos2")
    request, strategy = prepare_request(gm, torch.tensor([[4, 6, 8]]), **dict(
        num_beams=2, do_sample=True, top_k=1, max_new_tokens=4))
    assert strategy is beam.BEAM
    top_k = [p for p in request.processors if type(p).__name__ == "TopKLogitsWarper"][0]
    assert top_k.min_tokens_to_keep == 3  # num_eos + 1
    assert request.input_ids.shape == (2, 3) and request.keys.shape == (1, 2)
    out = genfn.generate(gm, torch.tensor([[4, 6, 8]]), num_beams=2, do_sample=True, top_k=1, max_new_tokens=4, key=1)
    assert out.shape == (1, 7)


# ---------------------------------------------------------------------------------------------
# state and cache


def test_beam_state_shapes_are_static():
    """No leaf of the state changes shape or dtype between the first step and the last one, and
    the KV cache is reordered in place (its buffers never move)."""
    _, gm = pair("llama_eos2")
    ids, mask = padded_prompts(32)
    request, _ = prepare_request(gm, ids, attention_mask=mask, **dict(
        num_beams=3, max_new_tokens=10, return_dict_in_generate=True, output_scores=True, output_logits=True,
        output_attentions=True, output_hidden_states=True, do_sample=True, cache_implementation="static"))
    state = beam.init(gm, request)
    leaves, treedef = tree_flatten(state)
    signature = [(tuple(t.shape), t.dtype) if t is not None else None for t in leaves]
    pointers = (state.cache.keys.data_ptr(), state.cache.values.data_ptr())
    assert state.running_sequences.shape == (3, 3, ids.shape[1] + 10)
    assert state.hits.shape == (3, 3 * 3)  # (1 + two EOS ids) * num_beams candidates
    for _ in range(8):
        state = beam.step(gm, state)
        new_leaves, new_treedef = tree_flatten(state)
        assert new_treedef == treedef
        assert [(tuple(t.shape), t.dtype) if t is not None else None for t in new_leaves] == signature
    assert (state.cache.keys.data_ptr(), state.cache.values.data_ptr()) == pointers
    assert int(state.cur_len) == ids.shape[1] + 9  # beams move in lockstep: one length for all


def test_static_cache_reorder_is_in_place():
    from genfn.cache.static import init_static_cache

    cache = init_static_cache(2, 4, 1, 5, 3)
    cache.keys.copy_(torch.arange(4).view(1, 4, 1, 1, 1).expand_as(cache.keys).float())
    cache.values.copy_(-cache.keys)
    cache.valid[:, :2] = torch.tensor([[True, False], [True, True], [False, True], [True, True]])
    before_keys, before_valid = cache.keys.clone(), cache.valid.clone()
    pointer = cache.keys.data_ptr()
    order = torch.tensor([2, 2, 0, 1])
    out = cache.reorder(order)
    assert out.keys.data_ptr() == pointer
    assert torch.equal(out.keys, before_keys[:, order]) and torch.equal(out.values, -before_keys[:, order])
    assert torch.equal(out.valid, before_valid[order])


def test_beam_search_rejects_what_transformers_rejects():
    _, gm = pair("llama_eos1")
    with pytest.raises(ValueError, match="num_return_sequences"):
        genfn.generate(gm, torch.tensor([[4, 5]]), num_beams=2, num_return_sequences=3)
    with pytest.raises(ValueError, match="streamer"):
        genfn.generate(gm, torch.tensor([[4, 5]]), num_beams=2, streamer=object())
    with pytest.raises(ValueError, match="stopping_criteria"):
        genfn.generate(gm, torch.tensor([[4, 5]]), num_beams=2, stopping_criteria=[lambda ids, scores: False])
