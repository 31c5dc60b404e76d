"""Running requests to the end through a started ``ContinuousBatchingManager`` or through the engine
step itself, shared by the batching test modules (every wait under a timeout; no block may be left
allocated)."""

from __future__ import annotations

import time

from genfn.batching import ContinuousBatchingManager
from genfn.batching import blocks as B
from genfn.batching import guidance_groups as GG
from genfn.batching import scheduling as S
from genfn.batching import sequence_groups as SG
from genfn.batching.engine import Engine, engine_step, require_packed_forward
from genfn.batching.requests import sequence_ids
from genfn.batching.settings import request_settings, sequence_requests

WAIT_S = 60


def run_requests(model, requests, cb, chunked_prefill: bool = True):
    """``(outputs in request order, manager.stats)`` of ``requests`` (``(prompt, max_new_tokens,
    settings)`` each) run by one manager over ``cb``; asserts every block came back."""
    manager = ContinuousBatchingManager(model, None, cb, chunked_prefill=chunked_prefill)
    manager.start()
    try:
        ids = [manager.add_request(prompt, max_new_tokens=limit, **settings) for prompt, limit, settings in requests]
        results = {}
        deadline = time.monotonic() + 10 * WAIT_S
        while len(results) < len(ids) and time.monotonic() < deadline:
            out = manager.get_result(timeout=WAIT_S)
            assert out is not None, "no result came"
            results[out.request_id] = out
        state = manager.scheduler.state
        assert B.num_free_blocks(state.allocator) == state.allocator.num_blocks, "blocks leaked"
    finally:
        manager.stop(timeout=WAIT_S)
    return [results[rid] for rid in ids], manager.stats


def run_engine(model, requests, num_blocks, max_batch_tokens, max_rows, cancel=None, block_size=4, width=16,
               max_steps=1000, on_step=None, tokenizer=None, compile=None):
    """Every request (``{id: (prompt, max_new_tokens, settings)}``, queued as the manager queues
    them: ``n`` sequences behind their first, a guided request with its unconditional request)
    through ``engine_step`` to its end; the allocator's invariants checked after every step.
    ``cancel``: ``(step, request id)`` cancelled before that step; ``on_step(state, outcome)``
    after each step; ``tokenizer``: for stop strings and grammars; ``compile``: the engine's
    ``torch.compile`` options (None: eager). Returns the ended requests by id and what the steps did."""
    cache = require_packed_forward(model).init_packed_cache(model.spec, num_blocks, block_size)
    engine = Engine(model, cache, max_batch_tokens=max_batch_tokens, max_requests=max_rows, table_width=width,
                    compile=compile)
    state = S.init_scheduler(num_blocks, block_size, S.SchedulerPolicy(max_requests_per_batch=max_rows,
                                                                       max_blocks_per_request=width))
    for rid, (prompt, limit, settings) in requests.items():
        settings = dict(settings)  # a request's own tokenizer= (for its stop strings), as the manager takes it
        resolved = request_settings(model, prompt, None, settings, max_new_tokens=limit,
                                    tokenizer=settings.pop("tokenizer", tokenizer))
        ids = sequence_ids(rid, len(resolved.sequences))
        state = GG.add_request(state, SG.leader_request(sequence_requests(ids, resolved)))
    ended, seen = {}, dict(tokens=0, prompt_tokens=0, preempted=set(), joined=[], shared_rows=0, reused=0)
    for step in range(max_steps):
        if not S.has_pending(state):
            break
        if cancel is not None and cancel[0] == step:
            state = S.mark_cancelled(state, cancel[1])
        state, outcome = engine_step(engine, state)
        B.check_invariants(state.allocator)
        assert not outcome.failed, [r.error for r in outcome.failed]
        if on_step is not None:
            on_step(state, outcome)
        ended.update({r.request_id: r for r in outcome.finished + outcome.cancelled})
        seen["tokens"] += outcome.num_tokens
        seen["prompt_tokens"] += outcome.batch.prompt_tokens
        seen["preempted"].update(outcome.preempted)
        seen["joined"].extend(outcome.joined)
        seen["shared_rows"] += sum(c.logits_from is not None for c in outcome.batch.chunks)
        seen["reused"] += outcome.reused_tokens
    assert not S.has_pending(state), "the engine did not finish in time"
    assert B.num_free_blocks(state.allocator) == num_blocks and not any(state.allocator.refs), "blocks leaked"
    return ended, seen


def drive(model, requests, *, blocks=40, size=4, budget=16, rows=6, width=16, tokenizer=None):
    """``requests`` ((prompt, max new tokens, settings) each, ids 0, 1, ...) through ``run_engine``;
    returns (generated tokens per request, the most tokens one step gave a request, steps, requests
    preempted, prompt tokens reused)."""
    most, steps = 1, 0

    def on_step(state, outcome):
        nonlocal most, steps
        steps += 1
        for value in outcome.new_tokens.values():
            most = max(most, len(value) if isinstance(value, tuple) else 1)

    ended, seen = run_engine(model, dict(enumerate(requests)), blocks, budget, rows, block_size=size, width=width,
                             max_steps=3000, on_step=on_step, tokenizer=tokenizer)
    tokens = [list(ended[i].generated_ids) for i in range(len(requests))]
    return tokens, most, steps, len(seen["preempted"]), seen["reused"]
