"""generate: greedy parity with transformers, batching with left padding, and clear errors."""

import pytest
import torch

import genfn
from conftest import tiny_pair


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair(eos_token_id=5)


def _padded_batch(vocab=97, lengths=(7, 5, 3), pad=0, seed=1):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(6, vocab, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"])
def test_greedy_tokens_equal_transformers_on_tiny_models(arch):
    hf, gm = tiny_pair(arch, eos_token_id=5)
    ids, mask = _padded_batch()
    ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    out = genfn.generate(gm, ids, attention_mask=mask, max_new_tokens=30)
    assert torch.equal(ref, out)


def test_rows_stop_independently_and_are_padded(tiny):
    hf, gm = tiny
    ids, mask = _padded_batch(seed=3)
    # Make one row's greedy continuation hit EOS early by declaring its first new token EOS.
    first = genfn.generate(gm, ids, attention_mask=mask, max_new_tokens=1)[:, -1]
    eos = int(first[0])
    out = genfn.generate(gm, ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0,
                      do_sample=False)
    assert torch.equal(out, ref)
    assert out[0, ids.shape[1]] == eos and (out[0, ids.shape[1] + 1:] == 0).all()


def test_greedy_smollm2_matches_transformers_64_tokens(smollm2, hf_smollm2, smollm2_prompts):
    ids, mask = smollm2_prompts["input_ids"], smollm2_prompts["attention_mask"]
    assert len(set(mask.sum(-1).tolist())) == 3, "prompts must have different lengths"
    out = genfn.generate(smollm2, ids, attention_mask=mask, max_new_tokens=64)
    with torch.no_grad():
        ref = hf_smollm2.generate(input_ids=ids, attention_mask=mask, max_new_tokens=64, do_sample=False)
    assert torch.equal(out, ref)


def test_model_generate_method_and_list_input(tiny):
    _, gm = tiny
    ids = [7, 8, 9, 10]
    a = gm.generate(ids, max_new_tokens=5)
    b = genfn.generate(gm, torch.tensor([ids]), max_new_tokens=5)
    assert torch.equal(a, b) and a.shape == (1, 9)


def test_return_dict_scores_match_transformers(tiny):
    hf, gm = tiny
    ids, mask = _padded_batch()
    out = genfn.generate(gm, ids, attention_mask=mask, max_new_tokens=6, return_dict_in_generate=True,
                         output_scores=True, output_logits=True, repetition_penalty=1.3)
    ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, return_dict_in_generate=True,
                      output_scores=True, output_logits=True, repetition_penalty=1.3, do_sample=False)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 6
    for mine, theirs in zip(out.scores + out.logits, ref.scores + ref.logits):
        assert torch.allclose(mine, theirs, atol=1e-5)


def test_max_length_includes_prompt(tiny):
    _, gm = tiny
    out = genfn.generate(gm, torch.tensor([[7, 8, 9]]), max_length=10, eos_token_id=None)
    assert out.shape == (1, 10)


@pytest.mark.parametrize("bad_ids,error,match", [
    (torch.zeros(1, 0, dtype=torch.long), ValueError, "empty"),
    ([], ValueError, "empty"),
    (torch.ones(2, 3), TypeError, "integer"),
    (torch.tensor([[1, 2, 500]]), ValueError, "vocabulary"),
    (None, ValueError, "input_ids"),
])
def test_bad_input_ids(tiny, bad_ids, error, match):
    _, gm = tiny
    with pytest.raises(error, match=match):
        genfn.generate(gm, bad_ids, max_new_tokens=2)


def test_prompt_longer_than_cache_or_context(tiny):
    _, gm = tiny
    ids = torch.randint(6, 97, (1, 20))
    with pytest.raises(ValueError, match="max_cache_len"):
        genfn.generate(gm, ids, max_new_tokens=5, max_cache_len=16)
    with pytest.raises(ValueError, match="max_cache_len"):
        genfn.generate(gm, ids, max_new_tokens=50, max_cache_len=32)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        genfn.generate(gm, torch.randint(6, 97, (1, 300)), max_new_tokens=5)


@pytest.mark.parametrize("kwargs,field", [
    (dict(do_sample=True, temperature=-1.0), "temperature"),
    (dict(do_sample=True, top_p=1.5), "top_p"),
    (dict(do_sample=True, top_k=-3), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_invalid_sampling_values_are_named(tiny, kwargs, field):
    _, gm = tiny
    with pytest.raises(ValueError, match=field):
        genfn.generate(gm, torch.tensor([[7, 8]]), **kwargs)


def test_unknown_kwarg_and_bad_mask(tiny):
    _, gm = tiny
    with pytest.raises(ValueError, match="not_a_setting"):
        genfn.generate(gm, torch.tensor([[7, 8]]), not_a_setting=3)
    with pytest.raises(ValueError, match="left padding"):
        genfn.generate(gm, torch.tensor([[7, 8, 0]]), attention_mask=torch.tensor([[1, 1, 0]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="attention_mask shape"):
        genfn.generate(gm, torch.tensor([[7, 8]]), attention_mask=torch.tensor([[1, 1, 1]]), max_new_tokens=2)


def test_streamer_receives_prompt_then_each_token(tiny):
    from genfn.streamers import BaseStreamer

    class Recorder(BaseStreamer):
        def __init__(self):
            self.calls, self.ended = [], False

        def put(self, value):
            self.calls.append(value.clone())

        def end(self):
            self.ended = True

    _, gm = tiny
    rec = Recorder()
    out = genfn.generate(gm, torch.tensor([[7, 8, 9]]), max_new_tokens=5, eos_token_id=None, streamer=rec)
    assert rec.ended and torch.equal(rec.calls[0], torch.tensor([[7, 8, 9]]))
    assert torch.equal(torch.cat([c.reshape(-1) for c in rec.calls[1:]]), out[0, 3:])


def test_user_stopping_criteria_and_max_time(tiny):
    _, gm = tiny

    class StopAtLength(genfn.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 6)

    out = genfn.generate(gm, torch.tensor([[7, 8, 9]]), max_new_tokens=10, eos_token_id=None,
                         stopping_criteria=[StopAtLength()])
    assert out.shape == (1, 6)
    out = genfn.generate(gm, torch.tensor([[7, 8, 9]]), max_new_tokens=50, eos_token_id=None, max_time=1e-9)
    assert out.shape[1] < 53
