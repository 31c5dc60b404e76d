"""Soak: the continuous batching manager under random adds, cancels, pauses and stops from several
threads, in phases. After each phase: every request ended exactly once (none twice, none never),
no block leaked (the allocator's free count is back to its total, its invariants hold), the
manager forgot every request, and the process's resident memory stays bounded after warm-up.
Bounded in time (``GENFN_SOAK_S`` seconds per phase, default 5); every wait has a timeout."""

from __future__ import annotations

import gc
import os
import random
import threading
import time

import pytest

from conftest import tiny_pair
from genfn.batching import blocks as B
from genfn.batching.manager import ContinuousBatchingManager
from genfn.batching.requests import RequestStatus
from genfn.config.batching import ContinuousBatchingConfig

WAIT_S = 60
PHASE_S = float(os.environ.get("GENFN_SOAK_S", "5"))
PHASES = 5
RSS_GROWTH_LIMIT = 48 * 2**20  # bytes the process may grow from the end of the warm-up phase

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Ledger:
    """What was submitted and how each request ended, shared by the threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.submitted: list = []
        self.ends: dict = {}
        self.errors: list[str] = []

    def end(self, out) -> None:
        with self.lock:
            if out.request_id in self.ends:
                self.errors.append(f"{out.request_id} ended twice ({self.ends[out.request_id].status} then "
                                   f"{out.status})")
            self.ends[out.request_id] = out


def _phase(manager, ledger: _Ledger, rng: random.Random, phase: int, hard_stop: bool) -> None:
    stop_adding = threading.Event()
    stop_collecting = threading.Event()
    failures: list[BaseException] = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                failures.append(exc)
        return run

    def adder(seed):
        local = random.Random(seed)
        while not stop_adding.is_set():
            prompt = [local.randrange(3, 97) for _ in range(local.randint(1, 24))]
            settings = ({"do_sample": True, "seed": local.randrange(10**6), "temperature": local.choice([1e-4, 0.7])}
                        if local.random() < 0.5 else {"do_sample": False})
            rid = manager.add_request(prompt, max_new_tokens=local.randint(1, 12), **settings)
            with ledger.lock:
                ledger.submitted.append(rid)
                earlier = local.choice(ledger.submitted)
            if local.random() < 0.2:
                manager.cancel_request(earlier)
            time.sleep(local.uniform(0, 0.01))

    def pauser():
        while not stop_adding.is_set():
            if manager.is_running():
                try:
                    with manager.pause():
                        time.sleep(0.005)
                except RuntimeError:  # the loop stopped meanwhile
                    pass
            time.sleep(0.05)

    def collector():
        while not stop_collecting.is_set():
            out = manager.get_result(timeout=0.05)
            if out is not None and out.is_finished():
                ledger.end(out)

    manager.start()
    threads = [threading.Thread(target=guarded(lambda s=s: adder(s))) for s in (rng.random() for _ in range(3))]
    threads += [threading.Thread(target=guarded(pauser)), threading.Thread(target=guarded(collector))]
    for t in threads:
        t.start()
    time.sleep(PHASE_S)
    if phase % 2:  # stop while requests are still being added
        manager.stop(block=True, timeout=WAIT_S, hard_stop=hard_stop, keep_for_next_session=True)
        stop_adding.set()
    else:
        stop_adding.set()
        for t in threads[:4]:
            t.join(timeout=WAIT_S)
        manager.stop(block=True, timeout=WAIT_S, hard_stop=hard_stop, keep_for_next_session=True)
    for t in threads[:4]:
        t.join(timeout=WAIT_S)
    # Requests added after the stop ended at once (FAILED); the collector drains what is left.
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        with ledger.lock:
            if len(ledger.ends) >= len(set(ledger.submitted)):
                break
        time.sleep(0.01)
    stop_collecting.set()
    threads[4].join(timeout=WAIT_S)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    assert not failures, failures
    assert not manager.is_running(), "the loop did not stop"


def test_soak_random_adds_cancels_pauses_and_stops_leak_nothing():
    model = tiny_pair()[1]
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=32, max_batch_tokens=32, max_requests_per_batch=8)
    manager = ContinuousBatchingManager(model, None, cb)
    ledger = _Ledger()
    rng = random.Random(7)
    rss_after_warmup = None
    try:
        for phase in range(PHASES):
            _phase(manager, ledger, rng, phase, hard_stop=rng.random() < 0.5)
            assert not ledger.errors, ledger.errors
            with ledger.lock:
                submitted, ends = set(ledger.submitted), dict(ledger.ends)
            assert len(submitted) == len(ledger.submitted), "a request id was handed out twice"
            assert set(ends) == submitted, f"requests never ended: {sorted(submitted - set(ends))[:5]}"
            statuses = {out.status for out in ends.values()}
            assert statuses <= {RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED}
            alloc = manager.scheduler.state.allocator
            B.check_invariants(alloc)
            assert B.num_free_blocks(alloc) == alloc.num_blocks and not any(alloc.refs), "blocks leaked"
            assert not manager.scheduler.has_pending_requests()
            assert not manager._live and not manager._records, "the manager still holds ended requests"
            assert manager.fatal_error is None, manager.fatal_error
            gc.collect()
            if phase == 0:
                rss_after_warmup = _rss()
            else:
                grown = _rss() - rss_after_warmup
                assert grown < RSS_GROWTH_LIMIT, f"resident memory grew {grown / 2**20:.1f} MiB after warm-up"
        finished = sum(out.status == RequestStatus.FINISHED for out in ledger.ends.values())
        assert finished > 50, "the soak finished too few requests to mean anything"
    finally:
        manager.destroy()
