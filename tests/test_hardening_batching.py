"""Continuous batching under faults: a request whose logits turn NaN fails alone (the others finish
with their solo greedy tokens, including those that later reuse its cache blocks), on every
attention path of the packed forward. Every wait has a timeout."""

from __future__ import annotations

import random
import time

import pytest
import torch

from conftest import tiny_pair
from genfn.batching import blocks as B
from genfn.batching import scheduling as S
from genfn.batching.engine import Engine, engine_step
from genfn.batching.manager import ContinuousBatchingManager
from genfn.batching.requests import RequestStatus, make_request
from genfn.batching.settings import request_settings
from genfn.config.batching import ContinuousBatchingConfig
from genfn.driver import NonFiniteLogitsError
from genfn.generation import generate
from genfn.models import packed
from genfn.models.model import Model
from genfn.models.packed import init_packed_cache

WAIT_S = 60
POISON = 13  # the token whose embedding is NaN in the faulty model

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def models():
    """(clean model, the same model with a NaN embedding row for token POISON): the oracle of each
    request is the faulty model's solo run, which raises exactly where the prompt or a generated
    token is POISON."""
    clean = tiny_pair()[1]
    params = dict(clean.params)
    embed = params["embed"].clone()
    embed[POISON] = float("nan")
    params["embed"] = embed
    faulty = Model(clean.spec, params, clean.apply_fn, clean.init_cache_fn, generation_config=clean.generation_config,
                   config=clean.config)
    return clean, faulty


def _solo(model, prompt, limit):
    """The request's greedy tokens alone (up to its EOS), or None where ``generate`` raises
    NonFiniteLogitsError (the prompt, or a token it generates, is the poisoned one)."""
    try:
        out = generate(model, torch.tensor([prompt]), max_new_tokens=limit, do_sample=False)
    except NonFiniteLogitsError:
        return None
    out = out[0, len(prompt):].tolist()
    return out[:out.index(2) + 1] if 2 in out else out


def _prompts(rng, count, poisoned):
    prompts = []
    for i in range(count):
        prompt = [rng.choice([t for t in range(3, 97) if t != POISON]) for _ in range(rng.randint(3, 14))]
        if i in poisoned:
            prompt[rng.randrange(len(prompt))] = POISON
        prompts.append(prompt)
    return prompts


@pytest.mark.parametrize("attention", ["planned", "gather", "whole_cache"])
def test_a_nan_request_fails_alone_and_its_blocks_poison_no_later_request(models, attention, monkeypatch):
    """Poisoned prompts leave NaN keys/values in their blocks; the blocks go back to the allocator
    and are handed to later requests, whose masked-out tails then hold NaN. Every clean request
    must still give its solo greedy tokens; every poisoned one must fail with the NaN error."""
    _, faulty = models
    if attention == "gather":
        monkeypatch.setattr(packed, "WHOLE_CACHE_FACTOR", 0)
    size, blocks, width = 4, 14, 8  # few blocks: freed blocks are reused at once
    engine = Engine(faulty, init_packed_cache(faulty.spec, blocks, size), max_batch_tokens=16, max_requests=4,
                    table_width=width)
    if attention != "planned":
        monkeypatch.setattr(engine, "plan", lambda batch: None)
    state = S.init_scheduler(blocks, size, S.SchedulerPolicy(max_requests_per_batch=4, max_blocks_per_request=width))
    rng = random.Random(3)
    poisoned = {0, 3, 4}
    prompts = _prompts(rng, 10, poisoned)
    for i, prompt in enumerate(prompts):
        r = request_settings(faulty, prompt, None, {}, max_new_tokens=10)
        state = S.add_request(state, make_request(i, prompt, r.max_new_tokens, list(r.eos_token_ids),
                                                  {"genfn": r.settings}))
    finished, failed = {}, {}
    for _ in range(400):
        if not S.has_pending(state):
            break
        state, outcome = engine_step(engine, state)
        finished.update({r.request_id: r for r in outcome.finished})
        failed.update({r.request_id: r for r in outcome.failed})
    assert not S.has_pending(state)
    expected = {i: _solo(faulty, p, 10) for i, p in enumerate(prompts)}
    assert set(failed) == {i for i, e in expected.items() if e is None} >= poisoned
    assert all("NaN or infinite logits" in r.error for r in failed.values())
    assert set(finished) == {i for i, e in expected.items() if e is not None}
    for i in finished:
        assert list(finished[i].generated_ids) == expected[i], f"request {i}"
    assert B.num_free_blocks(state.allocator) == blocks and not any(state.allocator.refs)


def test_the_manager_fails_only_the_request_at_fault_and_remove_invalid_values_keeps_it(models):
    _, faulty = models
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=24, max_batch_tokens=16, max_requests_per_batch=4)
    manager = ContinuousBatchingManager(faulty, None, cb)
    rng = random.Random(5)
    prompts = _prompts(rng, 8, {1, 6})
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=6, do_sample=False) for p in prompts]
        kept = manager.add_request(prompts[1], max_new_tokens=3, do_sample=False, remove_invalid_values=True)
        results = {}
        deadline = time.monotonic() + 10 * WAIT_S
        while len(results) < len(ids) + 1 and time.monotonic() < deadline:
            out = manager.get_result(timeout=WAIT_S)
            assert out is not None, "no result came"
            assert out.request_id not in results, "a request ended twice"
            results[out.request_id] = out
        alloc = manager.scheduler.state.allocator
        assert B.num_free_blocks(alloc) == alloc.num_blocks, "blocks leaked"
    finally:
        manager.stop(timeout=WAIT_S)
    assert manager.fatal_error is None
    for i, rid in enumerate(ids):
        out, expected = results[rid], _solo(faulty, prompts[i], 6)
        if expected is None:
            assert i not in (1, 6) or out.status == RequestStatus.FAILED
            assert out.status == RequestStatus.FAILED and "NonFiniteLogitsError" in out.error
        else:
            assert out.status == RequestStatus.FINISHED, out.error
            assert list(out.generated_tokens) == expected
    # remove_invalid_values=True: the request opted out of the check and keeps generating.
    assert results[kept].status == RequestStatus.FINISHED and len(results[kept].generated_tokens) >= 1
