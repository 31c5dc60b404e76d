"""Classifier-free guidance: genfn's two-branch decode state equals transformers' unbatched CFG
processor (tokens and scores), and the stateful pieces (CFG, SynthID, stop strings) compile."""

import itertools

import pytest
import torch

import genfn
from conftest import tiny_pair


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair(eos_token_id=None)


def _prompts():
    ids = torch.tensor([[0, 0, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    return ids, (ids != 0).long()


def _assert_same(out, ref, atol=1e-5):
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores)
    for mine, theirs in zip(out.scores, ref.scores):
        assert torch.equal(torch.isinf(mine), torch.isinf(theirs))
        finite = torch.isfinite(theirs)
        assert torch.allclose(mine[finite], theirs[finite], atol=atol)


@pytest.mark.parametrize("scale", [1.5, 3.0])
@pytest.mark.parametrize("negative", [False, True])
def test_guidance_equals_transformers_on_tiny_model(tiny, scale, negative):
    hf, gm = tiny
    ids, mask = _prompts()
    extra = {}
    if negative:
        neg = torch.tensor([[0, 5, 6], [3, 4, 9]])  # left padded
        extra = dict(negative_prompt_ids=neg, negative_prompt_attention_mask=(neg != 0).long())
    kwargs = dict(attention_mask=mask, max_new_tokens=8, guidance_scale=scale, return_dict_in_generate=True,
                  output_scores=True, pad_token_id=0, **extra)
    out = genfn.generate(gm, ids, **kwargs)
    ref = hf.generate(input_ids=ids, do_sample=False, **kwargs)
    _assert_same(out, ref)


def test_guidance_with_other_processors_and_sampling_scores(tiny):
    """CFG heads the chain: the processed scores under sampling warpers match transformers'."""
    from unittest import mock

    hf, gm = tiny
    ids, mask = _prompts()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, guidance_scale=2.0, repetition_penalty=1.3, do_sample=True,
                  top_k=20, top_p=0.9, return_dict_in_generate=True, output_scores=True, pad_token_id=0)
    out = genfn.generate(gm, ids, key=3, **kwargs)
    # Make transformers draw genfn's tokens, so both score the same prefixes.
    steps = iter(out.sequences[:, ids.shape[1]:].T)
    with mock.patch("torch.multinomial", lambda probs, num_samples=1, **kw: next(steps).unsqueeze(1)):
        ref = hf.generate(input_ids=ids, **kwargs)
    _assert_same(out, ref)


def test_guidance_on_smollm2(smollm2, hf_smollm2):
    tok = smollm2.tokenizer
    batch = tok(["Write a haiku about the sea.", "The capital of France is"])
    neg = tok(["Write something boring.", "Bad"])
    for extra in ({}, dict(negative_prompt_ids=neg["input_ids"],
                           negative_prompt_attention_mask=neg["attention_mask"])):
        kwargs = dict(attention_mask=batch["attention_mask"], max_new_tokens=5, guidance_scale=1.5,
                      return_dict_in_generate=True, output_scores=True, **extra)
        out = genfn.generate(smollm2, batch["input_ids"], **kwargs)
        with torch.no_grad():
            ref = hf_smollm2.generate(input_ids=batch["input_ids"], do_sample=False, **kwargs)
        _assert_same(out, ref, atol=1e-4)


def test_guidance_errors(tiny):
    _, gm = tiny
    ids, mask = _prompts()
    with pytest.raises(ValueError, match="rows"):
        genfn.generate(gm, ids, attention_mask=mask, guidance_scale=2.0, max_new_tokens=2,
                       negative_prompt_ids=torch.tensor([[5, 6]] * 3))
    with pytest.raises(ValueError, match="beam"):
        genfn.generate(gm, ids, attention_mask=mask, guidance_scale=2.0, max_new_tokens=2, num_beams=2)
    # guidance_scale == 1 is no guidance at all (transformers does not build the processor).
    plain = genfn.generate(gm, ids, attention_mask=mask, max_new_tokens=4)
    assert torch.equal(genfn.generate(gm, ids, attention_mask=mask, max_new_tokens=4, guidance_scale=1.0), plain)


class _ToyTokenizer:
    """A plain vocabulary (tokens spell themselves) over the tiny model's 97 ids."""

    def __init__(self, vocab_size=97):
        words = ["".join(p) for n in (1, 2, 3) for p in itertools.product("abcd", repeat=n)]
        self.vocab = {w: i for i, w in enumerate(words[:vocab_size])}

    def get_vocab(self):
        return dict(self.vocab)


def test_compiled_step_with_guidance_synthid_and_stop_strings_equals_eager(tiny):
    """The one compile of this file: every stateful piece of the decode state in one compiled step,
    traced whole (fullgraph) by dynamo and AOT autograd. (inductor also passes, but its codegen for
    this step takes minutes on a 2-core machine.)"""
    _, gm = tiny
    ids, mask = _prompts()
    toy = _ToyTokenizer()
    synthid = genfn.SynthIDTextWatermarkingConfig(ngram_len=3, keys=[654, 400, 836, 123], context_history_size=8)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, guidance_scale=1.5, watermarking_config=synthid,
                  do_sample=True, top_k=0, stop_strings=["dab"], tokenizer=toy, key=11, max_cache_len=24,
                  return_dict_in_generate=True, output_scores=True, pad_token_id=0)
    eager = genfn.generate(gm, ids, **kwargs)
    compile_config = genfn.CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    compiled = genfn.generate(gm, ids, cache_implementation="static", compile_config=compile_config, **kwargs)
    assert torch.equal(eager.sequences, compiled.sequences)
    # Both rows stop on "dab" spread over two tokens ("cad|abb", "dda|bcc"), before max_new_tokens.
    assert eager.sequences.shape[1] < ids.shape[1] + 10 and bool((eager.sequences[1, -2:] == 0).all())
    for a, b in zip(eager.scores, compiled.scores):
        assert torch.allclose(a, b, atol=1e-4)
