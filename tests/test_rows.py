"""Rows move independently: rows of different lengths in one batch, requests inserted into a running
batch, cache rewind, non-finite logits, and failures that still end the streamer."""

from __future__ import annotations

import threading

import pytest
import torch

import genfn
from conftest import tiny_pair
from genfn import driver
from genfn.generation import prepare_request
from genfn.strategies import sample
from genfn.strategies.rows import insert
from genfn.streamers import TextIteratorStreamer

MAX_CACHE = 48
STATIC = dict(cache_implementation="static", max_cache_len=MAX_CACHE)


@pytest.fixture(scope="module")
def models():
    return tiny_pair()


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 97, (1, length), generator=torch.Generator().manual_seed(seed))


REQUESTS = [(_prompt(4, 1), 9, 11), (_prompt(9, 2), 5, 12), (_prompt(6, 3), 12, 13)]  # (ids, new tokens, seed)


def _alone(gm, ids, new, seed, sampled, **settings):
    kwargs = dict(do_sample=True, key=seed, temperature=0.8) if sampled else {}
    return genfn.generate(gm, ids, max_new_tokens=new, **kwargs, **settings)[0]


def _prefill(gm, ids, new, seed, sampled, **settings):
    kwargs = dict(do_sample=True, key=seed, temperature=0.8) if sampled else {}
    request, strategy = prepare_request(gm, ids, max_new_tokens=new, **kwargs, **settings)
    return strategy.init(gm, request)


def _run(gm, state, steps, compiled):
    options = driver.compile_options_for(genfn.GenerationConfig(**STATIC), gm.device) if compiled else None
    return driver.run(sample.SAMPLE, gm, state, num_steps=steps, compile_options=options)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_rows_of_different_lengths_and_late_inserts_give_each_request_its_own_tokens(models, sampled, compiled):
    _, gm = models
    alone = [_alone(gm, ids, new, seed, sampled, **STATIC, disable_compile=True) for ids, new, seed in REQUESTS]
    prefixes = [_prefill(gm, ids, new, seed, sampled, **STATIC) for ids, new, seed in REQUESTS]
    # A batch of three rows, all holding request 0; request 1 replaces row 1 at once, request 2
    # joins row 2 after three steps (while rows 0 and 1 are mid-generation).
    (ids0, new0, seed0) = REQUESTS[0]
    batch = _prefill(gm, ids0.expand(3, -1), new0, seed0, sampled, **STATIC)
    batch = batch.replace(keys=None if batch.keys is None else prefixes[0].keys.expand(3, 2).clone())
    batch = insert(prefixes[1], batch, 1)
    batch = _run(gm, batch, 3, compiled)
    batch = insert(prefixes[2], batch, [2])
    batch = _run(gm, batch, 40, compiled)
    assert bool(batch.done.all())
    for row, want in enumerate(alone):
        got = batch.tokens[row, : want.shape[0]]
        assert torch.equal(got, want), (row, got.tolist(), want.tolist())


def test_insert_refuses_what_does_not_fit(models):
    _, gm = models
    a = _prefill(gm, _prompt(4, 1), 5, 0, False, **STATIC)
    batch = _prefill(gm, _prompt(4, 1).expand(2, -1), 5, 0, False, **STATIC)
    with pytest.raises(ValueError, match="max_cache_len"):
        insert(_prefill(gm, _prompt(4, 1), 5, 0, False, cache_implementation="static", max_cache_len=32), batch, 0)
    with pytest.raises(ValueError, match="rows"):
        insert(a, batch, 2)
    with pytest.raises(ValueError, match="options"):
        insert(_prefill(gm, _prompt(4, 1), 5, 0, True, **STATIC), batch, 0)


CACHES = [("static", None), ("offloaded_static", None), ("dynamic", None), ("offloaded", None),
          ("quantized", {"nbits": 8, "q_group_size": 16, "residual_length": 64})]


@pytest.mark.parametrize(("implementation", "cache_config"), CACHES, ids=[c[0] for c in CACHES])
def test_rewind_forgets_appended_tokens(models, implementation, cache_config):
    """Append k tokens, rewind row b to keep j_b of them, decode again: the logits equal a run that
    only ever appended the kept tokens."""
    _, gm = models
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 97, (2, 5), generator=g)
    draft = torch.randint(3, 97, (2, 4), generator=g)
    nxt = torch.randint(3, 97, (2, 1), generator=g)
    keep = torch.tensor([1, 3])  # row 0 keeps 1 of the 4 drafted tokens, row 1 keeps 3

    def positions(start, count):
        return (start.unsqueeze(1) + torch.arange(count)).expand(2, count)

    cache = gm.init_cache(2, 32, implementation, cache_config)
    _, cache = gm.apply(prompt, positions(torch.zeros(2, dtype=torch.int64), 5), cache)
    _, cache = gm.apply(draft, positions(torch.full((2,), 5), 4), cache)
    cache = cache.rewind(torch.full((2,), 5) + keep)
    logits, _ = gm.apply(nxt, (5 + keep).unsqueeze(1), cache)
    for row in range(2):
        ref_cache = gm.init_cache(1, 32, implementation, cache_config)
        seq = torch.cat([prompt[row], draft[row, : int(keep[row])], nxt[row]]).unsqueeze(0)
        ref, _ = gm.apply(seq, torch.arange(seq.shape[1]).unsqueeze(0), ref_cache)
        torch.testing.assert_close(logits[row, -1], ref[0, -1], atol=1e-5, rtol=1e-5)


def test_nonfinite_logits_raise_naming_remove_invalid_values(models):
    _, gm = models
    broken = genfn.Model(gm.spec, {**gm.params, "norm": torch.full_like(gm.params["norm"], float("nan"))},
                         gm.apply_fn, gm.init_cache_fn, generation_config=gm.generation_config)
    ids = _prompt(4, 1)
    with pytest.raises(RuntimeError, match="remove_invalid_values=True"):
        genfn.generate(broken, ids, max_new_tokens=3)
    out = genfn.generate(broken, ids, max_new_tokens=3, remove_invalid_values=True)
    assert out.shape == (1, 7)


class _Iterating:
    """A consumer thread iterating a TextIteratorStreamer, with a bounded wait."""

    def __init__(self, streamer):
        self.texts, self.finished = [], threading.Event()
        self.thread = threading.Thread(target=self._run, args=(streamer,), daemon=True)
        self.thread.start()

    def _run(self, streamer):
        for text in streamer:
            self.texts.append(text)
        self.finished.set()


def test_a_failure_inside_generate_ends_the_streamer(models):
    _, gm = models
    tok = _ByteTokenizer()
    streamer = TextIteratorStreamer(tok, timeout=30)
    consumer = _Iterating(streamer)

    def failing_criterion(input_ids, scores):
        if input_ids.shape[1] > 6:
            raise KeyError("criterion failed")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    with pytest.raises(KeyError, match="criterion failed"):
        genfn.generate(gm, _prompt(4, 1), max_new_tokens=8, streamer=streamer, stopping_criteria=[failing_criterion])
    assert consumer.finished.wait(30), "the iterating thread was left waiting"


def test_an_exception_inside_a_compiled_step_reaches_the_caller_as_itself(models):
    _, gm = models

    def step(model, state):
        if state.tokens.shape[1] == MAX_CACHE:
            raise LookupError("raised inside the step")
        return sample.step(model, state)

    broken = sample.SAMPLE.__class__(name="broken", init=sample.init, step=step, finish=sample.finish)
    with pytest.raises(LookupError, match="raised inside the step"):
        genfn.generate(gm, _prompt(4, 1), max_new_tokens=4, strategy=broken, **STATIC)


class _ByteTokenizer:
    """Enough of a tokenizer for the streamers: every id decodes to one letter."""

    def incremental_decoder(self, skip_special_tokens=False):
        return self

    def push(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)

    def flush(self):
        return ""


ROW_SETTINGS = [dict(temperature=0.7, top_p=0.9, top_k=20, repetition_penalty=1.3, min_new_tokens=4),
                dict(temperature=1.3, top_p=0.6, top_k=5, repetition_penalty=1.1, min_new_tokens=1),
                dict(temperature=0.9, top_p=0.95, top_k=40, repetition_penalty=1.6, min_new_tokens=7)]


def test_a_batch_with_per_row_processor_values_equals_each_row_alone(models):
    """Every row carries its own temperature / top-p / top-k / penalties / min_new_tokens as tensor
    leaves of one chain, so requests with different settings share a batch (and a compiled step)."""
    _, gm = models
    alone, prefixes = [], []
    for (ids, new, seed), settings in zip(REQUESTS, ROW_SETTINGS):
        alone.append(genfn.generate(gm, ids, max_new_tokens=new, do_sample=True, key=seed, **settings)[0])
        request, strategy = prepare_request(gm, ids, max_new_tokens=new, do_sample=True, key=seed, **settings, **STATIC)
        prefixes.append(strategy.init(gm, request))
    ids0, new0, seed0 = REQUESTS[0]
    request, strategy = prepare_request(gm, ids0.expand(3, -1), max_new_tokens=new0, do_sample=True, key=seed0,
                                        **ROW_SETTINGS[0], **STATIC)
    batch = strategy.init(gm, request)
    for row in range(3):
        batch = insert(prefixes[row], batch, row)
    batch = _run(gm, batch, 40, compiled=False)
    for row, want in enumerate(alone):
        assert torch.equal(batch.tokens[row, : want.shape[0]], want), row
