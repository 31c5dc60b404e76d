"""The pure scheduler of continuous batching: budgets, policies, chunked prefill, cancellation,
preemption, prefix reuse, block accounting, and a randomized simulation of 1,000 requests."""

from __future__ import annotations

import random
import threading

import pytest

from genfn.batching import blocks as B
from genfn.batching import scheduling as S
from genfn.batching.requests import RequestStatus, make_request
from genfn.batching.scheduler import FIFOScheduler, PrefillFirstScheduler, make_scheduler

VOCAB = 50
EOS = 0


def next_token(tokens) -> int:
    """A deterministic fake model: the next token depends on the whole history (its length and
    last tokens), so a recompute that lost or reordered a token would change every later one."""
    tail = tokens[-3:]
    return (sum((i + 2) * t for i, t in enumerate(tail)) + 7 * len(tokens)) % VOCAB


def oracle(prompt, max_new_tokens, eos=None) -> tuple[int, ...]:
    """What a request alone would generate."""
    tokens, out = list(prompt), []
    while max_new_tokens is None or len(out) < max_new_tokens:
        token = next_token(tokens)
        out.append(token)
        tokens.append(token)
        if eos is not None and token == eos:
            break
    return tuple(out)


def sampled(state: S.SchedulerState, batch: S.ScheduledBatch) -> dict:
    """The fake model's tokens for a batch: computed from what the scheduler says each row holds."""
    out = {}
    for chunk in batch.chunks:
        if chunk.samples:
            request = state.requests[chunk.request_id]
            assert request.token_ids[:chunk.end] == request.token_ids, "a sampling chunk ends at the last token"
            out[chunk.request_id] = next_token(request.token_ids)
    return out


def check_allocator(alloc: B.BlockAllocator) -> None:
    B.check_invariants(alloc)


def check_scheduler(state: S.SchedulerState, batch: S.ScheduledBatch | None = None) -> None:
    """Every request is queued exactly once, waiting ones hold nothing, running ones hold the
    blocks of what they computed, and a batch's chunks are the requests' own next tokens."""
    B.check_invariants(state.allocator)
    assert len(set(state.waiting)) == len(state.waiting) and len(set(state.active)) == len(state.active)
    assert set(state.waiting).isdisjoint(state.active)
    assert set(state.waiting) | set(state.active) == set(state.requests)
    assert set(state.allocator.tables) <= set(state.active)
    size = state.allocator.block_size
    for request_id in state.waiting:
        request = state.requests[request_id]
        assert request.status == RequestStatus.PENDING and request.num_computed == 0
    for request_id in state.active:
        request = state.requests[request_id]
        assert request.status in (RequestStatus.PREFILLING, RequestStatus.DECODING)
        assert len(B.block_table(state.allocator, request_id)) * size >= request.num_computed
        assert 0 < request.num_computed <= request.num_tokens
    if batch is not None:
        assert len(set(batch.request_ids)) == len(batch.chunks)
        for chunk in batch.chunks:
            request = state.requests[chunk.request_id]
            assert chunk.token_ids and request.token_ids[chunk.start:chunk.end] == chunk.token_ids
            assert request.num_computed == chunk.end and chunk.samples == (chunk.end == request.num_tokens)


def all_blocks_back(state: S.SchedulerState) -> bool:
    alloc = state.allocator
    return (B.num_free_blocks(alloc) == alloc.num_blocks and not alloc.tables and not any(alloc.refs)
            and not state.requests and not state.waiting and not state.active)


def run(state: S.SchedulerState, token_budget: int, cache_budget: int | None = None, max_steps: int = 10_000):
    """Drive the scheduler to the end with the fake model; returns (state, ended requests by id, batches)."""
    ended, batches = {}, []
    for _ in range(max_steps):
        if not S.has_pending(state):
            return state, ended, batches
        state, batch = S.schedule(state, token_budget, cache_budget)
        check_scheduler(state, batch)
        batches.append(batch)
        for request in batch.failed:
            assert request.request_id not in ended
            ended[request.request_id] = request
        state, finished = S.apply_step(state, batch, sampled(state, batch))
        for request in finished:
            assert request.request_id not in ended
            ended[request.request_id] = request
        check_allocator(state.allocator)
    raise AssertionError("the scheduler did not finish its requests")


def policy(kind="fifo", **kw):
    return S.SchedulerPolicy(kind=kind, **kw)


# ----------------------------------------------------------------------------------------------


def test_chunked_prefill_splits_within_the_token_budget():
    state = S.init_scheduler(64, 4, policy())
    state = S.add_request(state, make_request("long", range(1, 101), max_new_tokens=2))
    sizes = []
    for _ in range(10):
        state, batch = S.schedule(state, 32)
        (chunk,) = batch.chunks
        sizes.append((chunk.start, len(chunk.token_ids), chunk.samples))
        state, _ = S.apply_step(state, batch, sampled(state, batch))
        if chunk.samples:
            break
    assert sizes == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert state.requests["long"].status == RequestStatus.DECODING
    assert state.requests["long"].generated_ids == oracle(range(1, 101), 1)


def test_budgets_are_respected_on_every_step():
    rng = random.Random(3)
    for kind in ("fifo", "prefill_first"):
        state = S.init_scheduler(200, 8, policy(kind, max_requests_per_batch=5))
        for i in range(40):
            state = S.add_request(state, make_request(i, [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 90))],
                                                      max_new_tokens=rng.randint(1, 20)))
        state, ended, batches = run(state, token_budget=24, cache_budget=400)
        assert len(ended) == 40 and all(r.status == RequestStatus.FINISHED for r in ended.values())
        for batch in batches:
            assert batch.num_tokens <= 24
            assert batch.kv_read <= 400
            assert len(batch.chunks) <= 5
            assert len(set(batch.request_ids)) == len(batch.chunks)
        assert all_blocks_back(state)


def _decoding_and_split(kind):
    """A decoding request "d" and a request "p" whose prompt is half prefilled."""
    state = S.init_scheduler(64, 4, policy(kind, prefix_caching=False))
    state = S.add_request(state, make_request("d", [5, 6, 7], max_new_tokens=10))
    state, batch = S.schedule(state, 8)
    state, _ = S.apply_step(state, batch, sampled(state, batch))
    state = S.add_request(state, make_request("p", range(1, 41), max_new_tokens=3))
    state, batch = S.schedule(state, 8)
    assert [(c.request_id, len(c.token_ids)) for c in batch.chunks] == [("d", 1), ("p", 7)]
    state, _ = S.apply_step(state, batch, sampled(state, batch))
    assert state.requests["p"].status == RequestStatus.PREFILLING
    return state


def test_fifo_serves_decodes_first_and_prefill_first_serves_split_prefills_first():
    fifo = _decoding_and_split("fifo")
    state = S.add_request(fifo, make_request("new", [9, 9], max_new_tokens=1))
    _, batch = S.schedule(state, 8)
    assert [(c.request_id, len(c.token_ids)) for c in batch.chunks] == [("d", 1), ("p", 7)]
    _, batch = S.schedule(state, 40)
    assert [(c.request_id, len(c.token_ids)) for c in batch.chunks] == [("d", 1), ("p", 33), ("new", 2)]

    first = _decoding_and_split("prefill_first")
    state = S.add_request(first, make_request("new", [9, 9], max_new_tokens=1))
    _, batch = S.schedule(state, 8)
    assert [(c.request_id, len(c.token_ids)) for c in batch.chunks] == [("p", 8)]
    _, batch = S.schedule(state, 40)
    assert [(c.request_id, len(c.token_ids)) for c in batch.chunks] == [("p", 33), ("d", 1), ("new", 2)]


def test_waiting_requests_are_admitted_in_arrival_order():
    state = S.init_scheduler(64, 4, policy(prefix_caching=False))
    for name, length in (("a", 6), ("b", 20), ("c", 2)):
        state = S.add_request(state, make_request(name, range(1, length + 1), max_new_tokens=1))
    state, batch = S.schedule(state, 16, None)
    # "b" is split to what is left of the budget; "c" (which would fit) does not overtake it.
    assert [(c.request_id, len(c.token_ids)) for c in batch.chunks] == [("a", 6), ("b", 10)]
    without_chunks = S.init_scheduler(64, 4, policy(prefix_caching=False, chunked_prefill=False))
    for name, length in (("a", 6), ("b", 12), ("c", 2)):
        without_chunks = S.add_request(without_chunks, make_request(name, range(1, length + 1), max_new_tokens=1))
    _, batch = S.schedule(without_chunks, 16)
    assert [(c.request_id, len(c.token_ids)) for c in batch.chunks] == [("a", 6)]


def test_without_chunked_prefill_a_prompt_over_this_steps_budget_but_within_a_forward_waits():
    # Speculative requests keep room for their drafts, so a step's budget can be less than a forward
    # holds: a whole prompt that fits the forward must wait for the room, not fail for good.
    state = S.init_scheduler(64, 4, policy(prefix_caching=False, chunked_prefill=False))
    state = S.add_request(state, make_request("too_big", range(1, 20), max_new_tokens=1))
    state = S.add_request(state, make_request("p", range(1, 13), max_new_tokens=1))
    waiting, batch = S.schedule(state, 8, max_batch_tokens=16)
    assert not batch.chunks
    assert [f.request_id for f in batch.failed] == ["too_big"]  # 19 tokens fit no forward of 16
    assert "token budget (16)" in batch.failed[0].error
    assert "p" in waiting.waiting
    _, batch = S.schedule(waiting, 16, max_batch_tokens=16)
    assert [(c.request_id, len(c.token_ids)) for c in batch.chunks] == [("p", 12)]
    with pytest.raises(ValueError, match="max_batch_tokens"):
        S.schedule(state, 16, max_batch_tokens=8)


def test_without_chunked_prefill_a_prompt_over_the_budget_fails():
    state = S.init_scheduler(64, 4, policy(chunked_prefill=False))
    state = S.add_request(state, make_request("big", range(1, 30), max_new_tokens=1))
    state = S.add_request(state, make_request("ok", range(1, 5), max_new_tokens=1))
    state, batch = S.schedule(state, 16)
    (failed,) = batch.failed
    assert failed.request_id == "big" and failed.status == RequestStatus.FAILED
    assert "chunked prefill is off" in failed.error
    assert batch.request_ids == ("ok",)
    state, (ok,) = S.apply_step(state, batch, sampled(state, batch))
    assert ok.generated_ids == oracle(range(1, 5), 1)
    assert all_blocks_back(state)
    assert all_blocks_back(state)


def test_a_request_longer_than_the_cache_fails_and_frees_its_blocks():
    state = S.init_scheduler(4, 4, policy(safety_margin=0.0))
    state = S.add_request(state, make_request("too_long_prompt", range(1, 30), max_new_tokens=1))
    state = S.add_request(state, make_request("grows_too_long", range(1, 10), max_new_tokens=None))
    state, ended, _ = run(state, 64)
    assert ended["too_long_prompt"].status == RequestStatus.FAILED
    assert "at most 16" in ended["too_long_prompt"].error
    grown = ended["grows_too_long"]
    assert grown.status == RequestStatus.FAILED and "reached 16 tokens" in grown.error
    # 16 tokens have keys/values; the 17th was sampled from them and is kept.
    assert grown.generated_ids == oracle(range(1, 10), 16 - 9 + 1)
    assert all_blocks_back(state)


def test_block_table_width_caps_a_request():
    state = S.init_scheduler(64, 4, policy(max_blocks_per_request=3))
    state = S.add_request(state, make_request("r", range(1, 5), max_new_tokens=100))
    state, ended, _ = run(state, 64)
    assert ended["r"].status == RequestStatus.FAILED and len(ended["r"].token_ids) == 12 + 1


def test_cancellation_of_waiting_and_running_requests():
    scheduler = FIFOScheduler(32, 4)
    for name in ("run", "wait"):
        scheduler.add_waiting_request(make_request(name, range(1, 9), max_new_tokens=50))
    batch = scheduler.schedule_batch(8)
    assert batch.request_ids == ("run",)
    scheduler.update_batch(batch, sampled(scheduler.state, batch))
    assert not scheduler.request_is_cancelled("run")
    scheduler.set_request_cancellation("run")
    scheduler.set_request_cancellation("wait")
    scheduler.set_request_cancellation("never-added")
    assert scheduler.request_is_cancelled("run") and scheduler.request_is_cancelled("never-added")
    # Until cleared, cancelled requests are not scheduled.
    assert scheduler.schedule_batch(8).chunks == ()
    cancelled = scheduler.clear_cancelled_requests()
    assert {r.request_id: r.status for r in cancelled} == {"run": RequestStatus.CANCELLED,
                                                           "wait": RequestStatus.CANCELLED}
    assert cancelled[0].generated_ids == oracle(range(1, 9), 1)
    assert not scheduler.has_pending_requests()
    assert scheduler.clear_cancelled_requests() == ()
    assert all_blocks_back(scheduler.state)


def test_a_cancelled_chunk_in_flight_is_ignored_by_the_update():
    scheduler = PrefillFirstScheduler(32, 4)
    scheduler.add_waiting_request(make_request("x", [1, 2, 3], max_new_tokens=5))
    batch = scheduler.schedule_batch(8)
    scheduler.set_request_cancellation("x")
    (cancelled,) = scheduler.clear_cancelled_requests()
    assert cancelled.status == RequestStatus.CANCELLED
    assert scheduler.update_batch(batch, {"x": 4}) == ()
    assert all_blocks_back(scheduler.state)


def test_scheduler_methods_finish_outputs_reset():
    scheduler = make_scheduler("fifo", 16, 4)
    assert isinstance(scheduler, FIFOScheduler)
    with pytest.raises(ValueError, match="scheduler_type"):
        make_scheduler("lifo", 16, 4)
    scheduler.add_waiting_request(make_request("a", [1, 2, 3], max_new_tokens=5))
    with pytest.raises(ValueError, match="already in the scheduler"):
        scheduler.add_waiting_request(make_request("a", [1], max_new_tokens=5))
    assert scheduler.has_pending_requests()
    batch = scheduler.schedule_batch(8)
    scheduler.update_batch(batch, {"a": 11})
    batch = scheduler.schedule_batch(8)
    scheduler.update_batch(batch, {"a": [12, 13]})  # a step may append several tokens
    assert scheduler.get_active_request_static_outputs("a") == [11, 12, 13]
    assert scheduler.allocated_blocks("a") == (0,)  # 4 tokens have keys/values; 12 and 13 not yet
    assert scheduler.get_active_request_static_outputs("unknown") == []
    ended = scheduler.finish_request("a", RequestStatus.FAILED, error="boom")
    assert ended.status == RequestStatus.FAILED and ended.error == "boom"
    assert scheduler.finish_request("a") is None
    assert all_blocks_back(scheduler.state)
    scheduler.add_waiting_request(make_request("b", range(1, 20), max_new_tokens=5))
    scheduler.schedule_batch(64)
    scheduler.reset()
    assert all_blocks_back(scheduler.state) and B.cached_block_count(scheduler.state.allocator) == 0
    with pytest.raises(ValueError, match="terminal"):
        scheduler.finish_request("b", RequestStatus.DECODING)


def test_eos_and_max_new_tokens_end_a_request():
    state = S.init_scheduler(16, 4)
    state = S.add_request(state, make_request("eos", [1, 2], max_new_tokens=10, eos_token_id=[9, -1]))
    state = S.add_request(state, make_request("len", [1, 2, 3], max_new_tokens=2))
    state, batch = S.schedule(state, 16)
    state, finished = S.apply_step(state, batch, {"eos": [4, 9, 5], "len": [4, 5, 6]})
    assert {r.request_id: r.generated_ids for r in finished} == {"eos": (4, 9), "len": (4, 5)}
    assert all(r.status == RequestStatus.FINISHED for r in finished)
    with pytest.raises(ValueError, match="no token"):
        state2 = S.add_request(state, make_request("z", [1], max_new_tokens=3))
        state2, batch = S.schedule(state2, 4)
        S.apply_step(state2, batch, {})


def test_invalid_arguments_raise_clear_errors():
    state = S.init_scheduler(8, 4)
    with pytest.raises(ValueError, match="token_budget"):
        S.schedule(state, 0)
    with pytest.raises(ValueError, match="cache_budget"):
        S.schedule(state, 4, -1)
    with pytest.raises(ValueError, match="kind"):
        S.SchedulerPolicy(kind="round_robin")
    with pytest.raises(ValueError, match="safety_margin"):
        S.SchedulerPolicy(safety_margin=1.5)
    with pytest.raises(ValueError, match="max_requests_per_batch"):
        S.SchedulerPolicy(max_requests_per_batch=0)
    with pytest.raises(ValueError, match="input_ids"):
        make_request("e", [])
    with pytest.raises(ValueError, match="max_new_tokens"):
        make_request("e", [1], max_new_tokens=0)
    with pytest.raises(TypeError, match="input_ids"):
        make_request("e", [1, "a"])
    with pytest.raises(TypeError, match="RequestState"):
        S.add_request(state, {"request_id": "x"})
    with pytest.raises(TypeError, match="eos_token_id"):
        make_request("e", [1], eos_token_id="2")


def test_preemption_frees_blocks_requeues_and_loses_nothing():
    # 6 blocks of 4 tokens: two requests of 6 prompt tokens growing to 20 tokens cannot both fit.
    state = S.init_scheduler(6, 4, policy(safety_margin=0.0, prefix_caching=False))
    state = S.add_request(state, make_request("old", [1, 2, 3, 4, 5, 6], max_new_tokens=14))
    state = S.add_request(state, make_request("new", [6, 5, 4, 3, 2, 1], max_new_tokens=14))
    preempted = []
    ended = {}
    for _ in range(1000):
        if not S.has_pending(state):
            break
        state, batch = S.schedule(state, 16)
        for request_id in batch.preempted:
            request = state.requests[request_id]
            assert request.status == RequestStatus.PENDING and request.num_computed == 0
            assert not B.block_table(state.allocator, request_id)
            assert request_id in state.waiting and request_id not in batch.request_ids
            preempted.append((request_id, len(request.generated_ids)))
        state, finished = S.apply_step(state, batch, sampled(state, batch))
        ended.update({r.request_id: r for r in finished})
        check_allocator(state.allocator)
    assert not S.has_pending(state)
    assert preempted and preempted[0][0] == "new" and preempted[0][1] > 0
    assert ended["old"].generated_ids == oracle([1, 2, 3, 4, 5, 6], 14)
    assert ended["new"].generated_ids == oracle([6, 5, 4, 3, 2, 1], 14)
    assert ended["new"].preemptions >= 1 and ended["old"].preemptions == 0
    assert all_blocks_back(state)


def test_fifo_safety_margin_holds_back_new_prefills():
    for kind, admitted in (("fifo", False), ("prefill_first", True)):
        # FIFO's margin of 0.15 is 3 of 20 blocks; a 69-token prompt leaves 2 free.
        state = S.init_scheduler(20, 4, policy(kind, prefix_caching=False))
        state = S.add_request(state, make_request("big", range(1, 70), max_new_tokens=3))
        state, batch = S.schedule(state, 128)
        state, _ = S.apply_step(state, batch, sampled(state, batch))
        assert B.num_free_blocks(state.allocator) == 2
        state = S.add_request(state, make_request("small", [1], max_new_tokens=1))
        _, batch = S.schedule(state, 128)
        assert batch.request_ids == (("big", "small") if admitted else ("big",))
        state, ended, _ = run(state, 128)
        assert set(ended) == {"big", "small"} and all_blocks_back(state)


def test_a_repeated_system_prompt_is_prefilled_once():
    system = list(range(1, 18))  # 4 full blocks of 4, and one token more
    state = S.init_scheduler(64, 4, policy())
    state = S.add_request(state, make_request("first", system + [30, 31], max_new_tokens=4))
    state, batch = S.schedule(state, 64)
    state, _ = S.apply_step(state, batch, sampled(state, batch))
    state = S.add_request(state, make_request("second", system + [40], max_new_tokens=4))
    state, batch = S.schedule(state, 64)
    (chunk,) = [c for c in batch.chunks if c.request_id == "second"]
    assert chunk.start == 16 and chunk.token_ids == (17, 40)
    assert state.requests["second"].num_reused == 16
    shared = B.block_table(state.allocator, "first")[:4]
    assert B.block_table(state.allocator, "second")[:4] == shared
    assert all(B.ref_count(state.allocator, b) == 2 for b in shared)
    state, batch = S.apply_step(state, batch, sampled(state, batch))
    state, ended, _ = run(state, 64)
    assert ended["second"].generated_ids == oracle(system + [40], 4)
    assert all_blocks_back(state)


def test_prefix_reuse_reference_counts_and_lru_through_the_scheduler():
    system = list(range(1, 18))
    state = S.init_scheduler(12, 4, policy(safety_margin=0.0))
    state = S.add_request(state, make_request("first", system + [30, 31], max_new_tokens=5))
    state, batch = S.schedule(state, 64)
    state, _ = S.apply_step(state, batch, sampled(state, batch))
    state = S.add_request(state, make_request("second", system + [40], max_new_tokens=5))
    state, batch = S.schedule(state, 64)
    state, _ = S.apply_step(state, batch, sampled(state, batch))
    shared = B.block_table(state.allocator, "first")[:4]
    assert B.block_table(state.allocator, "second")[:4] == shared
    assert [B.ref_count(state.allocator, b) for b in shared] == [2, 2, 2, 2]
    state, ended, _ = run(state, 64)
    assert ended["first"].generated_ids == oracle(system + [30, 31], 5)
    assert ended["second"].generated_ids == oracle(system + [40], 5)
    # Both ended: the shared blocks are unreferenced but still cached, and reused by a third.
    assert all(B.ref_count(state.allocator, b) == 0 for b in shared)
    assert set(shared) <= set(B.evictable_blocks(state.allocator))
    state = S.add_request(state, make_request("third", system, max_new_tokens=1))
    state, batch = S.schedule(state, 64)
    assert batch.chunks[0].start == 16 and batch.chunks[0].token_ids == (17,)
    state, _ = S.apply_step(state, batch, sampled(state, batch))
    # A request needing every block evicts the cached ones (least recently released first).
    state = S.add_request(state, make_request("big", range(100, 147), max_new_tokens=1))
    state, batch = S.schedule(state, 64)
    assert batch.request_ids == ("big",) and B.cached_block_count(state.allocator) == 0
    state, (big,) = S.apply_step(state, batch, sampled(state, batch))
    assert big.generated_ids == oracle(range(100, 147), 1)
    assert all_blocks_back(state)


def test_cancellation_from_other_threads_while_the_loop_runs():
    scheduler = FIFOScheduler(64, 4, max_requests_per_batch=8)
    ids = list(range(200))
    for i in ids:
        scheduler.add_waiting_request(make_request(i, [1 + i % 40, 2, 3], max_new_tokens=40))
    ended = {}

    def cancel(part):
        for i in part:
            scheduler.set_request_cancellation(i)

    threads = [threading.Thread(target=cancel, args=(ids[k::4],), daemon=True) for k in (0, 1)]
    steps = 0
    while scheduler.has_pending_requests():
        if steps == 5:
            for thread in threads:
                thread.start()
        for request in scheduler.clear_cancelled_requests():
            assert request.request_id not in ended
            ended[request.request_id] = request
        batch = scheduler.schedule_batch(32)
        for request in scheduler.update_batch(batch, sampled(scheduler.state, batch)):
            assert request.request_id not in ended
            ended[request.request_id] = request
        steps += 1
        assert steps < 10_000
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()
    assert set(ended) == set(ids)
    cancelled = {i for i, r in ended.items() if r.status == RequestStatus.CANCELLED}
    assert cancelled and cancelled <= set(ids[0::4]) | set(ids[1::4])
    for i, request in ended.items():
        full = oracle([1 + i % 40, 2, 3], 40)
        if request.status == RequestStatus.FINISHED:
            assert request.generated_ids == full
        else:
            assert request.generated_ids == full[:len(request.generated_ids)]
    assert all_blocks_back(scheduler.state)


@pytest.mark.parametrize("kind", ["fifo", "prefill_first"])
def test_randomized_simulation_of_1000_requests(kind):
    """Requests arrive at random with random lengths, share system prompts, get cancelled at random,
    and the cache is small enough to force preemption: every request ends exactly once, finished
    ones generated what they would alone, and every block comes back."""
    rng = random.Random(1234 if kind == "fifo" else 4321)
    systems = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(8, 20))] for _ in range(3)]
    scheduler = make_scheduler(kind, 40, 4, max_requests_per_batch=12)
    prompts, limits, ended = {}, {}, {}
    next_id, steps = 0, 0
    total = 1000
    stats = {"preempted": 0, "reused": 0, "cancel_asked": 0}

    def end(request):
        assert request.request_id not in ended, f"request {request.request_id} ended twice"
        ended[request.request_id] = request

    while next_id < total or scheduler.has_pending_requests():
        for _ in range(rng.choice([0, 0, 1, 2, 3])):
            if next_id < total:
                prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30))]
                if rng.random() < 0.4:
                    prompt = rng.choice(systems) + prompt[:rng.randint(0, 10)]
                limits[next_id] = rng.choice([None, rng.randint(1, 30)]) if rng.random() < 0.9 else 1
                prompts[next_id] = prompt
                scheduler.add_waiting_request(make_request(next_id, prompt, max_new_tokens=limits[next_id] or 30,
                                                           eos_token_id=EOS))
                next_id += 1
        if next_id and rng.random() < 0.15:
            scheduler.set_request_cancellation(rng.randrange(next_id))  # may have ended already
            stats["cancel_asked"] += 1
        for request in scheduler.clear_cancelled_requests():
            end(request)
        token_budget = rng.choice([4, 16, 48, 64])
        cache_budget = rng.choice([None, 400])
        batch = scheduler.schedule_batch(token_budget, cache_budget)
        check_scheduler(scheduler.state, batch)
        assert batch.num_tokens <= token_budget and len(batch.chunks) <= 12
        assert cache_budget is None or batch.kv_read <= cache_budget
        stats["preempted"] += len(batch.preempted)
        for request in batch.failed:
            end(request)
        for chunk in batch.chunks:
            request = scheduler.state.requests[chunk.request_id]
            if chunk.start and chunk.start == request.num_reused and chunk.start < len(prompts[chunk.request_id]):
                stats["reused"] += 1
        for request in scheduler.update_batch(batch, sampled(scheduler.state, batch)):
            end(request)
        check_scheduler(scheduler.state)
        steps += 1
        assert steps < 100_000
    assert sorted(ended) == list(range(total))
    statuses = {r.status for r in ended.values()}
    assert statuses <= {RequestStatus.FINISHED, RequestStatus.CANCELLED}
    assert RequestStatus.CANCELLED in statuses
    for i, request in ended.items():
        alone = oracle(prompts[i], limits[i] or 30, EOS)
        if request.status == RequestStatus.FINISHED:
            assert request.generated_ids == alone, f"request {i}"
        else:
            assert request.generated_ids == alone[:len(request.generated_ids)], f"request {i}"
    assert stats["preempted"] > 0 and stats["reused"] > 0
    assert all_blocks_back(scheduler.state)
    evicted = B.evict_all(scheduler.state.allocator)
    assert sorted(evicted.free) == list(range(40)) and B.cached_block_count(evicted) == 0


def test_a_preempted_request_recomputes_from_its_cached_blocks():
    """With prefix caching, the full blocks a preempted request computed (prompt and generated
    tokens) stay cached, so its recompute starts past them when they were not evicted meanwhile."""
    state = S.init_scheduler(6, 4, policy(safety_margin=0.0))
    state = S.add_request(state, make_request("old", [1, 2, 3, 4, 5, 6], max_new_tokens=14))
    state = S.add_request(state, make_request("new", [9, 8, 7, 6, 5, 4], max_new_tokens=10))
    readmissions, ended = [], {}
    for _ in range(1000):
        if not S.has_pending(state):
            break
        before = {rid: r.preemptions for rid, r in state.requests.items() if rid in state.waiting}
        state, batch = S.schedule(state, 16)
        check_scheduler(state, batch)
        for chunk in batch.chunks:
            if before.get(chunk.request_id):
                readmissions.append((chunk.request_id, chunk.start))
        state, finished = S.apply_step(state, batch, sampled(state, batch))
        ended.update({r.request_id: r for r in finished})
    assert not S.has_pending(state)
    assert readmissions and any(start > 0 for _, start in readmissions)
    assert ended["old"].generated_ids == oracle([1, 2, 3, 4, 5, 6], 14)
    assert ended["new"].generated_ids == oracle([9, 8, 7, 6, 5, 4], 10)
    assert all_blocks_back(state)
