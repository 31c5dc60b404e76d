"""Rich generation outputs (scores, logits, attentions, hidden states, cache) and compute_transition_scores."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import genfn
from conftest import tiny_pair

SMALL = dict(hidden_size=32, intermediate_size=48)
RICH = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, output_attentions=True,
            output_hidden_states=True)
MODES = {"greedy": dict(), "beam": dict(num_beams=3, num_return_sequences=2)}


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def models():
    hf, gm = tiny_pair("LlamaForCausalLM", seed=1, vocab_size=32, eos_token_id=[2, 5], **SMALL)
    hf.set_attn_implementation("eager")  # the attention maps transformers reports
    return hf, gm


def prompts(vocab=32, batch=3, length=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :4] = 0
    return ids * mask, mask


def assert_close_finite(a, b, atol=1e-4):
    assert a.shape == b.shape
    finite = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), finite)
    torch.testing.assert_close(a[finite], b[finite], atol=atol, rtol=0)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("mode", list(MODES))
def test_rich_outputs_match_transformers(models, mode, cache):
    """Every output field has transformers' type, keys, shapes and values.

    At the prefill, the maps of *padding* query positions are garbage in both libraries and
    differ (transformers spreads a fully masked row uniformly, genfn lets it see itself); every
    real query position matches.
    """
    hf, gm = models
    ids, mask = prompts()
    kwargs = dict(max_new_tokens=8, **RICH, **MODES[mode])
    with torch.no_grad():
        ref = hf.generate(input_ids=ids, attention_mask=mask, **kwargs)
    # A static cache has more slots than tokens: the maps are still cut to the real key length.
    cache_settings = dict(cache_implementation="static", max_cache_len=32, disable_compile=True) if cache == "static" else {}
    out = genfn.generate(gm, ids, attention_mask=mask, **cache_settings, **kwargs)
    assert type(out).__name__ == type(ref).__name__
    assert list(out.keys()) == list(ref.keys())
    assert torch.equal(out.sequences, ref.sequences)
    steps = len(ref.scores)
    for name in ("scores", "logits", "attentions", "hidden_states"):
        assert isinstance(getattr(out, name), tuple) and len(getattr(out, name)) == steps, name
    for a, b in zip(out.scores, ref.scores):
        assert_close_finite(a, b)
    for a, b in zip(out.logits, ref.logits):
        assert_close_finite(a, b)

    rows = ref.scores[0].shape[0]
    real = mask.bool().repeat_interleave(rows // ids.shape[0], dim=0)  # [rows, P]
    for t in range(steps):
        assert len(out.attentions[t]) == len(ref.attentions[t]) == gm.spec.num_layers
        assert len(out.hidden_states[t]) == len(ref.hidden_states[t]) == gm.spec.num_layers + 1
        for a, b in zip(out.attentions[t], ref.attentions[t]):
            assert a.shape == b.shape == (rows, gm.spec.num_heads, ids.shape[1] if t == 0 else 1, ids.shape[1] + t)
            if t == 0:
                a, b = a.transpose(1, 2)[real], b.transpose(1, 2)[real]
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        for a, b in zip(out.hidden_states[t], ref.hidden_states[t]):
            assert a.shape == b.shape == (rows, ids.shape[1] if t == 0 else 1, gm.spec.hidden_size)
            if t == 0:
                a, b = a[real], b[real]
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert out.past_key_values is out.cache and out.cache.keys.shape[1] == rows
    # The newest token is not in the cache yet.
    assert out.cache.length.tolist() == [out.sequences.shape[1] - 1] * rows


def test_sampling_output_shapes(models):
    _, gm = models
    ids, mask = prompts()
    ids, mask = ids[[0, 2]], mask[[0, 2]]
    out = genfn.generate(gm, ids, attention_mask=mask, max_new_tokens=6, do_sample=True, num_return_sequences=3, key=4,
                         **RICH)
    assert type(out).__name__ == "GenerateDecoderOnlyOutput"
    rows, prompt_len = 6, ids.shape[1]
    steps = out.sequences.shape[1] - prompt_len
    assert out.sequences.shape[0] == rows and 1 <= steps <= 6
    assert len(out.scores) == len(out.logits) == len(out.attentions) == len(out.hidden_states) == steps
    for t in range(steps):
        q = prompt_len if t == 0 else 1
        assert out.scores[t].shape == out.logits[t].shape == (rows, gm.vocab_size)
        assert [tuple(a.shape) for a in out.attentions[t]] == [(rows, gm.spec.num_heads, q, prompt_len + t)] * 2
        assert [tuple(h.shape) for h in out.hidden_states[t]] == [(rows, q, gm.spec.hidden_size)] * 3
    # the expanded rows of one prompt are different samples of it
    assert not torch.equal(out.sequences[0], out.sequences[1]) or not torch.equal(out.sequences[1], out.sequences[2])
    again = genfn.generate(gm, ids, attention_mask=mask, max_new_tokens=6, do_sample=True, num_return_sequences=3,
                           key=4, return_dict_in_generate=True)
    assert torch.equal(again.sequences, out.sequences)
    assert again.scores is None and again.attentions is None and "scores" not in again


def test_beam_outputs_without_output_scores(models):
    """As transformers: sequences_scores only with output_scores; beam_indices always."""
    hf, gm = models
    ids, mask = prompts()
    kwargs = dict(max_new_tokens=6, num_beams=2, return_dict_in_generate=True)
    with torch.no_grad():
        ref = hf.generate(input_ids=ids, attention_mask=mask, **kwargs)
    out = genfn.generate(gm, ids, attention_mask=mask, **kwargs)
    assert list(out.keys()) == list(ref.keys()) == ["sequences", "beam_indices", "cache"]
    assert torch.equal(out.beam_indices, ref.beam_indices)


# ---------------------------------------------------------------------------------------------
# compute_transition_scores


@pytest.mark.parametrize("length_penalty", [-1.0, 0.0, 1.0, 2.0])
def test_beam_transition_scores_rebuild_sequence_scores(models, length_penalty):
    hf, gm = models
    ids, mask = prompts()
    out = genfn.generate(gm, ids, attention_mask=mask, max_new_tokens=12, num_beams=4, num_return_sequences=4,
                         length_penalty=length_penalty, return_dict_in_generate=True, output_scores=True)
    if length_penalty <= 1.0:
        assert (out.beam_indices == -1).any()  # some hypotheses ended early: the masking matters
    scores = genfn.compute_transition_scores(out.sequences, out.scores, out.beam_indices, normalize_logits=False)
    assert scores.shape == out.beam_indices.shape
    assert torch.equal(scores, hf.compute_transition_scores(out.sequences, out.scores, out.beam_indices))
    assert torch.equal(scores, gm.compute_transition_scores(out.sequences, out.scores, out.beam_indices))
    length = (out.beam_indices >= 0).sum(1).numpy()
    rebuilt = scores.sum(1).numpy() / (length**length_penalty)
    assert np.allclose(out.sequences_scores.numpy(), rebuilt)
    assert (scores[out.beam_indices < 0] == 0).all()


def test_greedy_transition_scores_are_chosen_log_probs(models):
    hf, gm = models
    ids, mask = prompts()
    out = genfn.generate(gm, ids, attention_mask=mask, max_new_tokens=8, return_dict_in_generate=True,
                         output_scores=True, output_logits=True)
    generated = out.sequences[:, ids.shape[1]:]
    for per_step in (out.scores, out.logits):
        scores = genfn.compute_transition_scores(out.sequences, per_step, normalize_logits=True)
        want = torch.stack([torch.log_softmax(s, -1).gather(1, generated[:, t : t + 1]).squeeze(1)
                            for t, s in enumerate(per_step)], dim=1)
        torch.testing.assert_close(scores, want)
        torch.testing.assert_close(scores, hf.compute_transition_scores(out.sequences, per_step, normalize_logits=True))
    raw = genfn.compute_transition_scores(out.sequences, out.logits)
    torch.testing.assert_close(raw, torch.stack([s.gather(1, generated[:, t : t + 1]).squeeze(1)
                                                 for t, s in enumerate(out.logits)], dim=1))


def test_transition_scores_of_sampled_rows(models):
    """Without beam_indices each sequence row reads the same row of every step's scores."""
    _, gm = models
    ids, mask = prompts()
    out = genfn.generate(gm, ids, attention_mask=mask, max_new_tokens=5, do_sample=True, num_return_sequences=2, key=9,
                         return_dict_in_generate=True, output_scores=True)
    scores = genfn.compute_transition_scores(out.sequences, out.scores)
    generated = out.sequences[:, ids.shape[1]:]
    for t, s in enumerate(out.scores):
        torch.testing.assert_close(scores[:, t], s.gather(1, generated[:, t : t + 1]).squeeze(1))


def test_transition_scores_needs_scores():
    with pytest.raises(ValueError, match="output_scores"):
        genfn.compute_transition_scores(torch.zeros(1, 3, dtype=torch.long), ())


# ---------------------------------------------------------------------------------------------
# SmolLM2


@pytest.mark.slow
def test_smollm2_greedy_and_beam_scores_match_transformers(smollm2, hf_smollm2, smollm2_prompts):
    ids = torch.as_tensor(smollm2_prompts["input_ids"])
    mask = torch.as_tensor(smollm2_prompts["attention_mask"])
    for mode in (dict(), dict(num_beams=2, num_return_sequences=2)):
        kwargs = dict(max_new_tokens=12, return_dict_in_generate=True, output_scores=True, output_logits=True, **mode)
        with torch.no_grad():
            ref = hf_smollm2.generate(input_ids=ids, attention_mask=mask, **kwargs)
        out = genfn.generate(smollm2, ids, attention_mask=mask, **kwargs)
        assert torch.equal(out.sequences, ref.sequences)
        assert len(out.scores) == len(ref.scores) and len(out.logits) == len(ref.logits)
        for a, b in zip(out.scores + out.logits, ref.scores + ref.logits):
            assert_close_finite(a, b)
        if mode:
            assert torch.equal(out.beam_indices, ref.beam_indices)
            scores = genfn.compute_transition_scores(out.sequences, out.scores, out.beam_indices)
            length = (out.beam_indices >= 0).sum(1)
            torch.testing.assert_close(scores.sum(1) / length, out.sequences_scores)
