"""compile_loop: the whole decoding loop as one torch ``while_loop`` graph."""

import pytest
import torch
from torch._dynamo.utils import counters

import genfn
from genfn.streamers import BaseStreamer
from conftest import tiny_pair


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(eos_token_id=None)


def _static(**kw):
    return dict(cache_implementation="static", max_cache_len=96, **kw)


def test_greedy_whole_loop_equals_transformers_and_compiles_once(pair):
    hf_model, model = pair
    gen = torch.Generator().manual_seed(1)
    before = counters["stats"]["unique_graphs"]
    for prompt_len, new_tokens in [(5, 40), (11, 7), (3, 60)]:
        ids = torch.randint(3, 97, (2, prompt_len), generator=gen)
        out = genfn.generate(model, ids, max_new_tokens=new_tokens, compile_loop=True, **_static())
        ref = hf_model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        assert torch.equal(out, ref), (prompt_len, new_tokens)
    # The loop graph (prefill runs eagerly): one compile for every prompt length and step count.
    assert counters["stats"]["unique_graphs"] - before == 1


def test_sampled_whole_loop_equals_stepwise_for_the_same_key(pair):
    _, model = pair
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    kw = dict(max_new_tokens=24, do_sample=True, temperature=0.9, top_k=20, key=123)
    whole = genfn.generate(model, ids, compile_loop=True, **_static(), **kw)
    stepwise = genfn.generate(model, ids, **_static(disable_compile=True), **kw)
    assert torch.equal(whole, stepwise)


def test_whole_loop_stops_when_every_row_hit_eos():
    _, model = tiny_pair(eos_token_id=None)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    free = genfn.generate(model, ids, max_new_tokens=12, pad_token_id=0)
    eos = int(free[0, 8])  # the 4th generated token becomes the end of sequence
    stepwise = genfn.generate(model, ids, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    whole = genfn.generate(model, ids, max_new_tokens=12, eos_token_id=eos, pad_token_id=0, compile_loop=True,
                           **_static(disable_compile=True))
    assert torch.equal(whole, stepwise)
    assert whole.shape[1] <= 9
    assert model.compiled_steps == {}  # disable_compile ran the while_loop eagerly


@pytest.mark.parametrize("kwargs, named", [
    (dict(num_beams=2), "beam"),
    (dict(cache_implementation="dynamic"), "cache_implementation"),
    (dict(output_scores=True, return_dict_in_generate=True), "output_scores"),
    (dict(max_time=5.0), "max_time"),
    (dict(prefix_allowed_tokens_fn=lambda b, ids: [4, 5]), "prefix_allowed_tokens_fn"),
])
def test_whole_loop_rejects_what_needs_the_host(pair, kwargs, named):
    _, model = pair
    settings = dict(cache_implementation="static", max_new_tokens=3)
    settings.update(kwargs)
    with pytest.raises(ValueError, match=named):
        genfn.generate(model, torch.tensor([[5, 6, 7]]), compile_loop=True, **settings)


def test_whole_loop_rejects_a_streamer(pair):
    _, model = pair
    with pytest.raises(ValueError, match="streamer"):
        genfn.generate(model, torch.tensor([[5, 6, 7]]), compile_loop=True, cache_implementation="static",
                       max_new_tokens=3, streamer=BaseStreamer())
