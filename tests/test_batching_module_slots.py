"""Continuous batching of wrapped modules (``genfn.from_module``) over slot-per-row key/value caches
(``genfn.models.module_packed``).

A wrapped transformers GPT-2 (learned positions) and Llama (RoPE) batch as ``generate`` runs them
alone: greedy requests give ``generate``'s tokens and seeded ones ``generate(key=...)``'s, with
chunked prefill, preemption forced by a tiny block budget and shared prefixes; prompt-lookup drafts
and beam search keep their exact results. A decode step of ``R`` rows runs ``R`` tokens through the
module (the forward is counted), a run computes each token once, a request whose prefix another
slot holds copies it instead of computing it, slots are trusted by what they hold (a reused
request id, a module whose rows must advance together, a slot a NaN request left), ``n``
sequences share a prompt, and a request keeps its slot while a new one takes a free or the least
recently used one. Every wait has a timeout."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from conftest import tiny_hf_model
from genfn.batching import blocks as B
from genfn.batching import scheduling as S
from genfn.batching.engine import Engine, engine_step, require_packed_forward
from genfn.batching.requests import RequestStatus, make_request
from genfn.batching.settings import request_settings
from genfn.config.batching import ContinuousBatchingConfig
from genfn.generation import generate
from genfn.models import module_packed
from genfn.models.model import Model
from batching_support import run_requests

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _wrapped(arch: str, seed: int = 4):
    """A wrapped transformers GPT-2, or Llama with ``tiny_pair(seed=seed)``'s weights (the native
    Llama the other batching tests run: the same tokens, so the same drafts, forks and preemptions)."""
    import genfn
    from test_batching_families import _wrapped_gpt2

    if arch == "gpt2":
        return _wrapped_gpt2()
    return genfn.from_module(tiny_hf_model("LlamaForCausalLM", seed=seed)[0])


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def wrapped(request):
    return _wrapped(request.param)


@pytest.fixture(scope="module")
def gpt2():
    return _wrapped("gpt2")


def _alone(model, prompt, limit, **settings):
    tokens = generate(model, torch.tensor([prompt]), max_new_tokens=limit, **settings)[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


class _Counted:
    """The tokens each forward of ``model``'s module runs (a forward pre-hook), per call."""

    def __init__(self, model):
        self.calls: list[int] = []
        self.handle = model.spec.module.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        self.calls.append(int(kwargs["input_ids"].numel()))

    def take(self) -> list[int]:
        calls, self.calls = self.calls, []
        return calls


def _engine(model, *, blocks=64, size=4, budget=32, rows=4, width=16):
    family = require_packed_forward(model)
    assert family is module_packed
    engine = Engine(model, family.init_packed_cache(model.spec, blocks, size), max_batch_tokens=budget,
                    max_requests=rows, table_width=width)
    state = S.init_scheduler(blocks, size, S.SchedulerPolicy(max_requests_per_batch=rows, max_blocks_per_request=width))
    return engine, state


def _add(model, state, rid, prompt, limit, **settings):
    resolved = request_settings(model, prompt, None, settings, max_new_tokens=limit)
    return S.add_request(state, make_request(rid, prompt, resolved.max_new_tokens, list(resolved.eos_token_ids),
                                             {"genfn": resolved.settings}))


def _until_done(engine, state, counted=None, steps=None, max_steps=500):
    """Step to the end; the ended requests' generated tokens by id (and each step's batch and
    forward tokens appended to ``steps``)."""
    ended = {}
    for _ in range(max_steps):
        if not S.has_pending(state):
            break
        state, outcome = engine_step(engine, state)
        B.check_invariants(state.allocator)
        assert not outcome.failed, [r.error for r in outcome.failed]
        if steps is not None:
            steps.append((outcome.batch, counted.take()))
        ended.update({r.request_id: list(r.generated_ids) for r in outcome.finished})
    assert not S.has_pending(state), "the requests did not end"
    assert B.num_free_blocks(state.allocator) == state.allocator.num_blocks
    return state, ended


def test_wrapped_models_batch_greedy_and_seeded_requests_as_generate(wrapped):
    rng = random.Random(12)
    system = [rng.randrange(3, 97) for _ in range(13)]
    requests = []
    for i in range(10):
        prompt = [rng.randrange(3, 97) for _ in range(rng.randint(1, 24))]
        if i % 2:
            prompt = system + prompt[:6]
        settings = {"do_sample": False} if i % 3 else {"do_sample": True, "temperature": 0.8, "top_k": 20,
                                                        "seed": 300 + i}
        requests.append((prompt, rng.randint(4, 12), settings))
    # 12 blocks of 4 tokens and 12 tokens per forward: prompts are chunked, requests preempted.
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=12, max_batch_tokens=12, max_requests_per_batch=4)
    outputs, stats = run_requests(wrapped, requests, cb)
    assert stats["preempted"] > 0 and stats["reused_tokens"] > 0, dict(stats)
    for i, (out, (prompt, limit, settings)) in enumerate(zip(outputs, requests)):
        assert out.status == RequestStatus.FINISHED, out.error
        settings = dict(settings)
        seed = settings.pop("seed", None)
        expected = _alone(wrapped, prompt, limit, **settings, **({"key": seed} if seed is not None else {}))
        assert out.generated_tokens == expected, f"request {i} ({settings})"


def test_a_decode_step_runs_one_token_per_row_and_a_run_computes_each_token_once(wrapped):
    rng = random.Random(3)
    # Different first tokens: no prompt shares a prefix another slot could give it.
    prompts = [[10 + i] + [rng.randrange(3, 97) for _ in range(rng.randint(4, 19))] for i in range(4)]
    engine, state = _engine(wrapped, blocks=64, budget=16, rows=4)
    for i, prompt in enumerate(prompts):
        state = _add(wrapped, state, i, prompt, 10, do_sample=False)
    counted, steps = _Counted(wrapped), []
    try:
        _, ended = _until_done(engine, state, counted, steps)
    finally:
        counted.handle.remove()
    assert [ended[i] for i in range(4)] == [_alone(wrapped, p, 10, do_sample=False) for p in prompts]
    decode_steps = [(batch, calls) for batch, calls in steps if batch.is_decode_only and len(batch.chunks) == 4]
    assert decode_steps, "no step decoded all four rows"
    for batch, calls in decode_steps:
        assert calls == [4]  # one module call: a token per row, no prefix
    # Every prompt token and every generated token but the last is computed exactly once.
    assert sum(sum(calls) for _, calls in steps) == sum(len(p) + len(ended[i]) - 1 for i, p in enumerate(prompts))
    assert sum(batch.num_tokens for batch, _ in steps) == sum(sum(calls) for _, calls in steps)


def test_a_prefix_another_slot_holds_is_copied_and_slots_are_trusted_by_content(gpt2):
    rng = random.Random(8)
    system = [rng.randrange(3, 97) for _ in range(18)]
    first, second = system + [5, 6, 7], system + [40, 41]
    engine, state = _engine(gpt2, blocks=64, budget=32, rows=4)
    counted = _Counted(gpt2)
    try:
        state, ended = _until_done(engine, _add(gpt2, state, "a", first, 6, do_sample=False))
        counted.take()
        # "b" shares 4 full blocks (16 tokens) with "a", which ended: the prefix cache gives them, and
        # its slot copies from "a"'s all 18 positions where their tokens agree; it computes 2.
        steps = []
        state, ended_b = _until_done(engine, _add(gpt2, state, "b", second, 6, do_sample=False), counted, steps)
        prefill_batch, prefill_calls = steps[0]
        assert prefill_batch.chunks[0].start == 16 and prefill_calls == [len(second) - len(system)]
        # "a" again, another prompt: the slot "a" held is reused only as far as its tokens agree.
        other = [rng.randrange(3, 97) for _ in range(9)]
        state, ended_c = _until_done(engine, _add(gpt2, state, "a", other, 6, do_sample=False))
    finally:
        counted.handle.remove()
    assert ended["a"] == _alone(gpt2, first, 6, do_sample=False)
    assert ended_b["b"] == _alone(gpt2, second, 6, do_sample=False)
    assert ended_c["a"] == _alone(gpt2, other, 6, do_sample=False)


def test_a_module_whose_rows_advance_together_runs_rows_that_share_positions(gpt2):
    together = Model(dataclasses.replace(gpt2.spec, row_mask=None), gpt2.params, gpt2.apply_fn, gpt2.init_cache_fn,
                     generation_config=gpt2.generation_config)
    assert not together.spec.rows_independent
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 97) for _ in range(n)] for n in (3, 9, 9, 14)]
    engine, state = _engine(together, blocks=64, budget=12, rows=4)
    for i, prompt in enumerate(prompts):
        state = _add(together, state, i, prompt, 8, do_sample=False)
    _, ended = _until_done(engine, state)
    assert [ended[i] for i in range(4)] == [_alone(gpt2, p, 8, do_sample=False) for p in prompts]


def test_prompt_lookup_on_a_wrapped_llama():
    from test_batching_speculation import test_prompt_lookup_greedy_equals_plain_decoding_with_chunking_preemption_and_sharing as lookup

    lookup(_wrapped("llama"))


@pytest.mark.parametrize("num_blocks,max_batch_tokens", [(80, 64), (13, 8)], ids=["roomy", "tiny-budget-chunked"])
def test_beam_requests_on_a_wrapped_llama_equal_generate(num_blocks, max_batch_tokens, monkeypatch):
    from test_batching_beams import test_beam_requests_in_a_mixed_batch_equal_generate as beams

    # The beams test's own model (tiny_pair(seed=6)), wrapped: beams forked, copied and preempted.
    beams(_wrapped("llama", seed=6), num_blocks, max_batch_tokens, monkeypatch)


def test_a_nan_request_fails_alone_and_its_slot_poisons_no_later_request():
    from test_hardening_batching import POISON, _prompts, _solo

    clean = _wrapped("llama")
    params = dict(clean.params)
    embed = params["model.embed_tokens.weight"].clone()
    embed[POISON] = float("nan")  # NaN keys and values from the poisoned token on
    params["model.embed_tokens.weight"] = embed
    faulty = Model(clean.spec, params, clean.apply_fn, clean.init_cache_fn, generation_config=clean.generation_config)
    # 4 slots for 10 requests: the poisoned requests' slots are taken by clean ones.
    engine, state = _engine(faulty, blocks=14, budget=16, rows=4, width=8)
    prompts = _prompts(random.Random(3), 10, {0, 3, 4})
    for i, prompt in enumerate(prompts):
        state = _add(faulty, state, i, prompt, 10)
    finished, failed = {}, {}
    for _ in range(400):
        if not S.has_pending(state):
            break
        state, outcome = engine_step(engine, state)
        finished.update({r.request_id: list(r.generated_ids) for r in outcome.finished})
        failed.update({r.request_id: r for r in outcome.failed})
    expected = {i: _solo(faulty, p, 10) for i, p in enumerate(prompts)}
    assert set(failed) == {i for i, e in expected.items() if e is None} >= {0, 3, 4}
    assert finished == {i: e for i, e in expected.items() if e is not None}
    assert B.num_free_blocks(state.allocator) == 14


def test_n_sequences_on_a_wrapped_llama():
    from test_batching_sequences import test_n_sequences_share_the_prompt_and_each_equals_generate_with_the_derived_key as n

    n(_wrapped("llama", seed=6))  # the sequences test's own model, wrapped


def test_beam_requests_on_a_wrapped_gpt2_equal_generate(gpt2, monkeypatch):
    from test_batching_beams import test_beam_requests_in_a_mixed_batch_equal_generate as beams

    beams(gpt2, 80, 64, monkeypatch)


def test_a_request_keeps_its_slot_and_one_without_takes_a_free_else_the_least_recently_used():
    table = module_packed.SlotTable(("a", None, "b"), (5, 0, 7), (3, 0, 1), clock=4)

    def rows(*keys):
        return [module_packed._Row(i, key, 0, 1, True, []) for i, key in enumerate(keys)]

    batch = rows("b", "c")
    table = module_packed._assign(table, batch)
    assert [row.slot for row in batch] == [2, 1]  # "b" keeps its slot, "c" takes the free one
    batch = rows("d", "c")
    table = module_packed._assign(table, batch)
    # No slot is free: "d" takes "a"'s (used at step 3; "b"'s and "c"'s at step 4), "c" keeps its own.
    assert [row.slot for row in batch] == [0, 1] and table.owners == ("d", "c", "b")
    assert table.filled == (5, 0, 7) and table.clock == 6  # what a slot holds is the forward's to say


def test_a_slot_copied_into_forgets_what_it_held_past_the_copy(wrapped):
    """A chunk that samples nothing and whose slot copies all of it from another slot computes
    nothing: the slot's positions past the copy, computed after the slot's old prefix, must not be
    trusted by a later chunk whose tokens happen to agree with them (what beams forked and preempted
    met: a beam's stale suffix)."""
    tail = [31, 32, 33, 34, 35, 36, 37, 38]
    x, a = [11, 12, 13, 14] + tail, [51, 52, 53, 54, 60, 61]
    y = a[:4] + tail  # "a"'s first 4 tokens, then the very tokens "x" held at positions 4 .. 11
    # 2 slots, 4 tokens a forward, blocks of 8 (no prompt shares a full block with another).
    engine, state = _engine(wrapped, blocks=32, size=8, budget=4, rows=2)
    state, ended = _until_done(engine, _add(wrapped, state, "x", x, 3, do_sample=False))
    state, ended_a = _until_done(engine, _add(wrapped, state, "a", a, 3, do_sample=False))
    state = _add(wrapped, state, "y", y, 3, do_sample=False)
    state, outcome = engine_step(engine, state)  # "y"'s chunk 0 .. 4: "x"'s slot, copied from "a"'s
    assert [(c.start, c.end, c.samples) for c in outcome.batch.chunks] == [(0, 4, False)]
    slot = engine.cache.table.owners.index("y")
    assert engine.cache.held[slot, :4].tolist() == a[:4] and (engine.cache.held[slot, 4:] == -1).all()
    state, ended_y = _until_done(engine, state)
    assert ended["x"] == _alone(wrapped, x, 3, do_sample=False)
    assert ended_a["a"] == _alone(wrapped, a, 3, do_sample=False)
    assert ended_y["y"] == _alone(wrapped, y, 3, do_sample=False)
