"""``EngineMetrics``: the recorder's counters, histograms and tokens/s window (on a fake clock),
the manager's snapshot against what its outputs say (taken from other threads while the loop
runs), and ``genfn.serve.prometheus.render`` checked line by line against the text format."""

from __future__ import annotations

import bisect
import math
import random
import re
import threading
import time

import pytest

from conftest import tiny_pair
from genfn.batching.manager import ContinuousBatchingManager
from genfn.batching.metrics import (
    INTER_TOKEN_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    EngineMetrics,
    Histogram,
    MetricsRecorder,
)
from genfn.batching.requests import RequestStatus
from genfn.config.batching import ContinuousBatchingConfig
from genfn.serve.prometheus import render

WAIT_S = 60  # the longest any single wait in these tests may take


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _cumulative(bounds, values):
    return tuple(sum(1 for v in values if v <= b) for b in bounds)


# ----------------------------------------------------------------------------------------------
# The recorder
# ----------------------------------------------------------------------------------------------


def test_recorder_counts_and_histograms_are_cumulative_prometheus_buckets():
    clock = _Clock()
    recorder = MetricsRecorder(clock=clock)
    rng = random.Random(0)
    ttfts = [rng.expovariate(2.0) for _ in range(50)] + [0.005, 0.01]  # two exactly on a bound: le includes it
    itls = [rng.expovariate(40.0) for _ in range(300)] + [1e6]
    recorder.record_step(clock.now, 7, ttfts[:20], itls[:100], prompt_tokens=30, cached_prompt_tokens=8)
    recorder.record_step(clock.now, 5, ttfts[20:], itls[100:], prompt_tokens=12)
    for status in [RequestStatus.FINISHED] * 3 + [RequestStatus.CANCELLED] * 2 + [RequestStatus.FAILED]:
        recorder.record_end(status)
    m = recorder.snapshot(running=2, waiting=3, kv_blocks_total=10, kv_blocks_used=4, kv_blocks_cached=1)
    assert (m.requests_finished, m.requests_cancelled, m.requests_failed) == (3, 2, 1)
    assert (m.prompt_tokens_total, m.prompt_tokens_cached_total, m.generation_tokens_total) == (42, 8, 12)
    assert (m.running, m.waiting, m.kv_blocks_used, m.kv_blocks_free, m.kv_blocks_cached) == (2, 3, 4, 6, 1)
    for hist, values, bounds in ((m.time_to_first_token, ttfts, TIME_TO_FIRST_TOKEN_BUCKETS),
                                 (m.inter_token_latency, itls, INTER_TOKEN_BUCKETS)):
        assert hist.buckets == bounds and hist.buckets[-1] == math.inf
        assert hist.counts == _cumulative(bounds, values)
        assert hist.count == hist.counts[-1] == len(values)
        assert hist.sum == pytest.approx(sum(values))
    with pytest.raises(ValueError, match="FINISHED, CANCELLED or FAILED"):
        recorder.record_end(RequestStatus.DECODING)
    with pytest.raises(ValueError, match="buckets"):
        MetricsRecorder(ttft_buckets=(1.0, 0.5, math.inf))


def test_tokens_per_second_counts_the_recent_window_only():
    clock = _Clock()
    recorder = MetricsRecorder(clock=clock, window_s=5.0)
    clock.now += 2.0  # 2 s after the start: the rate is over 2 s, not the whole window
    recorder.record_step(clock.now, 10)
    assert recorder.snapshot().tokens_per_second == pytest.approx(10 / 2.0)
    clock.now += 4.0
    recorder.record_step(clock.now, 30)
    assert recorder.snapshot().tokens_per_second == pytest.approx(40 / 5.0)
    clock.now += 2.0  # the first step is now older than the window
    assert recorder.snapshot().tokens_per_second == pytest.approx(30 / 5.0)
    clock.now += 10.0
    snapshot = recorder.snapshot()
    assert snapshot.tokens_per_second == 0.0 and snapshot.generation_tokens_total == 40


def test_snapshots_from_many_threads_while_the_recorder_is_fed_stay_consistent():
    recorder = MetricsRecorder()
    stop = threading.Event()
    seen = []

    def feed():
        while not stop.is_set():
            recorder.record_step(time.perf_counter(), 2, [0.1], [0.01])

    def read():
        for _ in range(100):
            m = recorder.snapshot()
            seen.append(m)
            # One step adds one first-token latency, one inter-token latency and two tokens, under one lock.
            assert m.generation_tokens_total == 2 * m.time_to_first_token.count == 2 * m.inter_token_latency.count

    feeder = threading.Thread(target=feed)
    readers = [threading.Thread(target=read) for _ in range(3)]
    feeder.start()
    for r in readers:
        r.start()
    for r in readers:
        r.join(WAIT_S)
    stop.set()
    feeder.join(WAIT_S)
    assert not feeder.is_alive() and not any(r.is_alive() for r in readers)
    assert len(seen) == 300


# ----------------------------------------------------------------------------------------------
# The manager
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair()[1]


def test_manager_metrics_agree_with_its_outputs_and_can_be_read_from_any_thread(tiny):
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=32, max_batch_tokens=16, max_requests_per_batch=4)
    manager = ContinuousBatchingManager(tiny, None, cb)
    before = manager.metrics()  # before start: nothing built, nothing used
    assert before.kv_blocks_total == 32 and before.kv_blocks_used == 0 and before.generation_tokens_total == 0
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 97) for _ in range(rng.randint(1, 20))] for _ in range(16)]
    limits = [rng.randint(1, 12) for _ in prompts]
    views, stop = ([], []), threading.Event()

    def watch(view):
        while not stop.is_set():
            view.append(manager.metrics())
            time.sleep(0.002)

    watchers = [threading.Thread(target=watch, args=(view,)) for view in views]
    manager.start()
    try:
        for w in watchers:
            w.start()
        ids = [manager.add_request(p, max_new_tokens=m, do_sample=False) for p, m in zip(prompts, limits)]
        ids.append(manager.add_request([5, 6, 7], max_new_tokens=200, do_sample=False, eos_token_id=-1))
        results = {}
        deadline = time.monotonic() + 10 * WAIT_S
        while len(results) < len(ids) - 1 and time.monotonic() < deadline:
            out = manager.get_result(timeout=WAIT_S)
            assert out is not None, "no result came"
            results[out.request_id] = out
        manager.cancel_request(ids[-1])
        last = manager.get_result(ids[-1], timeout=WAIT_S)
        assert last is not None and last.status == RequestStatus.CANCELLED
        results[last.request_id] = last
        stop.set()
        for w in watchers:
            w.join(WAIT_S)
        m = manager.metrics()
    finally:
        stop.set()
        manager.stop(timeout=WAIT_S)
    generated = [len(out.generated_tokens) for out in results.values()]
    assert m.requests_finished == len(ids) - 1 and m.requests_cancelled == 1 and m.requests_failed == 0
    assert m.generation_tokens_total == sum(generated)
    assert m.prompt_tokens_total == sum(len(out.prompt_ids) for out in results.values() if out.generated_tokens)
    assert m.time_to_first_token.count == sum(1 for g in generated if g)
    assert m.inter_token_latency.count == sum(g - 1 for g in generated if g)
    assert m.running == m.waiting == m.kv_blocks_used == 0 and m.kv_blocks_free == 32
    assert m.tokens_per_second > 0
    snapshots = views[0] + views[1]
    assert len(snapshots) > 10
    assert max(s.running for s in snapshots) <= 4 and max(s.kv_blocks_used for s in snapshots) <= 32
    assert any(s.kv_blocks_used > 0 for s in snapshots) and any(s.running > 0 for s in snapshots)
    for view in views:  # counters only grow, as each thread sees them
        for name in ("generation_tokens_total", "prompt_tokens_total", "requests_finished"):
            seen = [getattr(s, name) for s in view]
            assert seen == sorted(seen), name
    after = manager.metrics()  # stopped: the counters stay, the gauges are empty
    assert after.generation_tokens_total == m.generation_tokens_total and after.kv_blocks_used == 0


# ----------------------------------------------------------------------------------------------
# Prometheus text
# ----------------------------------------------------------------------------------------------

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*)\} (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _parse(text):
    """{name: (type, help)} and [(name, labels, value)]; fails on any line that is not valid."""
    assert text.endswith("\n")
    families, samples = {}, []
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, help_text = line[7:].split(" ", 1)
            families.setdefault(name, {})["help"] = help_text
        elif line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert kind in ("counter", "gauge", "histogram")
            assert name in families and "type" not in families[name], f"TYPE after samples or twice: {line}"
            families[name]["type"] = kind
        else:
            match = _SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            labels = dict(_LABEL.findall(match.group(2)))
            value = match.group(3)
            samples.append((match.group(1), labels, math.inf if value == "+Inf" else float(value)))
    return families, samples


def test_render_is_prometheus_text_with_counters_gauges_and_histograms():
    ttft = Histogram((0.1, 1.0, math.inf), (1, 3, 4), 6.5, 4)
    metrics = EngineMetrics(requests_finished=5, requests_cancelled=1, requests_failed=2, prompt_tokens_total=100,
                            generation_tokens_total=250, running=3, waiting=4, kv_blocks_total=64, kv_blocks_used=10,
                            kv_blocks_free=54, tokens_per_second=12.5, time_to_first_token=ttft)
    name = 'Smol"LM\\2\n'
    families, samples = _parse(render(metrics, name))
    assert all(labels["model_name"] == 'Smol\\"LM\\\\2\\n' for _, labels, _ in samples)
    values = {s[0]: s[2] for s in samples if "le" not in s[1]}
    assert values["genfn_requests_finished_total"] == 5 and values["genfn_requests_failed_total"] == 2
    assert values["genfn_generation_tokens_total"] == 250 and values["genfn_prompt_tokens_total"] == 100
    assert values["genfn_requests_running"] == 3 and values["genfn_requests_waiting"] == 4
    assert values["genfn_kv_blocks_used"] == 10 and values["genfn_kv_blocks_free"] == 54
    assert values["genfn_kv_blocks_capacity"] == 64
    assert values["genfn_tokens_per_second"] == 12.5
    for family, info in families.items():
        assert info.get("help") and info.get("type"), family
        assert family.endswith("_total") == (info["type"] == "counter"), family
    histograms = [f for f, info in families.items() if info["type"] == "histogram"]
    assert sorted(histograms) == ["genfn_inter_token_latency_seconds", "genfn_time_to_first_token_seconds"]
    buckets = [(s[1]["le"], s[2]) for s in samples if s[0] == "genfn_time_to_first_token_seconds_bucket"]
    assert buckets == [("0.1", 1), ("1.0", 3), ("+Inf", 4)]
    assert values["genfn_time_to_first_token_seconds_sum"] == 6.5
    assert values["genfn_time_to_first_token_seconds_count"] == 4
    empty = [(s[1]["le"], s[2]) for s in samples if s[0] == "genfn_inter_token_latency_seconds_bucket"]
    assert len(empty) == len(INTER_TOKEN_BUCKETS) and empty[-1] == ("+Inf", 0)
    for sample_name, _, _ in samples:  # every sample belongs to a declared family
        base = re.sub(r"_(bucket|sum|count)$", "", sample_name)
        assert sample_name in families or (base in families and families[base]["type"] == "histogram")


def test_render_refuses_what_is_not_a_snapshot():
    with pytest.raises(TypeError, match="metrics"):
        render({"running": 1}, "m")
    with pytest.raises(TypeError, match="model_name"):
        render(EngineMetrics(), None)


def test_bucket_bounds_render_in_order_and_le_includes_the_bound():
    recorder = MetricsRecorder()
    recorder.record_step(0.0, 1, [TIME_TO_FIRST_TOKEN_BUCKETS[3]])
    hist = recorder.snapshot().time_to_first_token
    index = bisect.bisect_left(hist.buckets, TIME_TO_FIRST_TOKEN_BUCKETS[3])
    assert hist.counts[index] == 1 and hist.counts[index - 1] == 0
    _, samples = _parse(render(recorder.snapshot(), "m"))
    bounds = [s[1]["le"] for s in samples if s[0] == "genfn_time_to_first_token_seconds_bucket"]
    assert [float(b) for b in bounds] == sorted(float(b) for b in bounds) and bounds[-1] == "+Inf"
