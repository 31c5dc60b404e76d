"""What the continuous batching engine reports about itself: ``EngineMetrics`` snapshots.

The manager's loop feeds a ``MetricsRecorder`` once per step (tokens made, first-token and
inter-token latencies) and once per ended request; any thread may take a snapshot at any time
(``ContinuousBatchingManager.metrics()``): the recorder's counters change under its lock, and the
gauges (running, waiting, KV blocks) are read from the scheduler's immutable state. Histograms
are Prometheus-style: cumulative counts per upper bound (seconds, the last ``+inf``), a sum and
a count, so ``genfn.serve.prometheus`` renders them as they are.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterable

from genfn.batching.requests import RequestStatus

__all__ = ["EngineMetrics", "Histogram", "INTER_TOKEN_BUCKETS", "MetricsRecorder", "TIME_TO_FIRST_TOKEN_BUCKETS"]

# Upper bounds in seconds; decode on a small CPU runs at tens of milliseconds per token and a first
# token behind a long queue may take minutes, so both ranges reach far.
TIME_TO_FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                               20.0, 40.0, 80.0, 160.0, 640.0, math.inf)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                       2.5, 5.0, 10.0, 20.0, 40.0, math.inf)
TOKENS_PER_SECOND_WINDOW_S = 5.0


@dataclasses.dataclass(frozen=True)
class Histogram:
    """``counts[i]``: observations ``<= buckets[i]`` (cumulative; ``buckets[-1]`` is ``inf``, so
    ``counts[-1] == count``); ``sum``: the sum of every observation, in seconds."""

    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float = 0.0
    count: int = 0

    @classmethod
    def empty(cls, buckets: tuple[float, ...]) -> Histogram:
        return cls(buckets, (0,) * len(buckets))

    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0


@dataclasses.dataclass(frozen=True)
class EngineMetrics:
    """A snapshot of the engine. Counters (``*_total``, ``requests_*``) only grow over a manager's
    life; gauges are the state at the snapshot.

    ``requests_finished / _cancelled / _failed``: requests ended each way. ``prompt_tokens_total``:
    prompt tokens of the requests that produced their first token (a recompute after preemption is
    not counted again); ``generation_tokens_total``: tokens generated. ``running``: requests
    admitted (prefilling or decoding); ``waiting``: requests queued or preempted. KV blocks:
    ``kv_blocks_used`` are held by live requests, ``kv_blocks_free`` = total - used (of which
    ``kv_blocks_cached`` hold a reusable prefix). ``tokens_per_second``: tokens generated over the
    last ``TOKENS_PER_SECOND_WINDOW_S`` seconds (or since the recorder started, if sooner).
    ``prompt_tokens_cached_total``: prompt tokens taken from the prefix cache instead of computed.
    """

    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    tokens_per_second: float = 0.0
    time_to_first_token: Histogram = Histogram.empty(TIME_TO_FIRST_TOKEN_BUCKETS)
    inter_token_latency: Histogram = Histogram.empty(INTER_TOKEN_BUCKETS)
    kv_blocks_cached: int = 0
    prompt_tokens_cached_total: int = 0


class _HistogramRecorder:
    """A histogram's per-bucket counts (not cumulative); callers hold the recorder's lock."""

    def __init__(self, buckets: tuple[float, ...]):
        if not buckets or buckets[-1] != math.inf or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"histogram buckets must be increasing and end with inf, got {buckets}")
        self.buckets = buckets
        self.per_bucket = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.per_bucket[bisect.bisect_left(self.buckets, value)] += 1  # the first bound >= value
        self.sum += value
        self.count += 1

    def snapshot(self) -> Histogram:
        cumulative, total = [], 0
        for n in self.per_bucket:
            total += n
            cumulative.append(total)
        return Histogram(self.buckets, tuple(cumulative), self.sum, self.count)


_ENDED_AS = {RequestStatus.FINISHED: "requests_finished", RequestStatus.CANCELLED: "requests_cancelled",
             RequestStatus.FAILED: "requests_failed"}


class MetricsRecorder:
    """The counters and histograms behind ``EngineMetrics``; every method is thread-safe.

    ``clock``: the time source (``perf_counter``), ``window_s``: the tokens/s window.
    """

    def __init__(self, *, window_s: float = TOKENS_PER_SECOND_WINDOW_S, clock: Callable[[], float] = time.perf_counter,
                 ttft_buckets: tuple[float, ...] = TIME_TO_FIRST_TOKEN_BUCKETS,
                 itl_buckets: tuple[float, ...] = INTER_TOKEN_BUCKETS):
        self._lock = threading.Lock()
        self._clock = clock
        self._window_s = window_s
        self._started = clock()
        self._counts: collections.Counter = collections.Counter()
        self._recent: collections.deque = collections.deque()  # (time, tokens) of recent steps
        self._ttft = _HistogramRecorder(ttft_buckets)
        self._itl = _HistogramRecorder(itl_buckets)

    def record_step(self, now: float, new_tokens: int, first_token_latencies: Iterable[float] = (),
                    inter_token_latencies: Iterable[float] = (), prompt_tokens: int = 0,
                    cached_prompt_tokens: int = 0) -> None:
        """One step's tokens and latencies (seconds), ``prompt_tokens`` of the requests whose first
        token it made."""
        with self._lock:
            self._counts["generation_tokens_total"] += new_tokens
            self._counts["prompt_tokens_total"] += prompt_tokens
            self._counts["prompt_tokens_cached_total"] += cached_prompt_tokens
            if new_tokens:
                self._recent.append((now, new_tokens))
            self._forget_before(now - self._window_s)
            for value in first_token_latencies:
                self._ttft.observe(value)
            for value in inter_token_latencies:
                self._itl.observe(value)

    def record_end(self, status: RequestStatus) -> None:
        name = _ENDED_AS.get(RequestStatus(status))
        if name is None:
            raise ValueError(f"a request ends FINISHED, CANCELLED or FAILED, not {RequestStatus(status).name}")
        with self._lock:
            self._counts[name] += 1

    def _forget_before(self, cutoff: float) -> None:
        while self._recent and self._recent[0][0] < cutoff:
            self._recent.popleft()

    def snapshot(self, *, running: int = 0, waiting: int = 0, kv_blocks_total: int = 0, kv_blocks_used: int = 0,
                 kv_blocks_cached: int = 0) -> EngineMetrics:
        """The counters now, with the gauges given by the caller."""
        with self._lock:
            now = self._clock()
            self._forget_before(now - self._window_s)
            span = max(min(self._window_s, now - self._started), 1e-6)
            rate = sum(n for _, n in self._recent) / span
            counts = dict(self._counts)
            ttft, itl = self._ttft.snapshot(), self._itl.snapshot()
        return EngineMetrics(
            requests_finished=counts.get("requests_finished", 0),
            requests_cancelled=counts.get("requests_cancelled", 0),
            requests_failed=counts.get("requests_failed", 0),
            prompt_tokens_total=counts.get("prompt_tokens_total", 0),
            generation_tokens_total=counts.get("generation_tokens_total", 0),
            running=running, waiting=waiting, kv_blocks_total=kv_blocks_total, kv_blocks_used=kv_blocks_used,
            kv_blocks_free=kv_blocks_total - kv_blocks_used, tokens_per_second=rate,
            time_to_first_token=ttft, inter_token_latency=itl, kv_blocks_cached=kv_blocks_cached,
            prompt_tokens_cached_total=counts.get("prompt_tokens_cached_total", 0))
