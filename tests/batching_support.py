"""Running requests through a started ``ContinuousBatchingManager`` to the end, shared by the
batching test modules (every wait under a timeout; no block may be left allocated)."""

from __future__ import annotations

import time

from genfn.batching import ContinuousBatchingManager
from genfn.batching import blocks as B

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
