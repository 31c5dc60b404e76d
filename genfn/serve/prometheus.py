"""``render(metrics, model_name)``: an ``EngineMetrics`` snapshot in Prometheus' text exposition
format (version 0.0.4), for ``GET /metrics``.

Every sample carries a ``model_name`` label. Counters end in ``_total``; histograms are in
seconds, with cumulative ``_bucket{le=...}`` samples ending at ``le="+Inf"``, then ``_sum`` and
``_count``. The names follow the ``EngineMetrics`` fields under a ``genfn_`` prefix.
"""

from __future__ import annotations

import math

from genfn.batching.metrics import EngineMetrics, Histogram

__all__ = ["CONTENT_TYPE", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric name, EngineMetrics field, help text)
_COUNTERS = (
    ("genfn_requests_finished_total", "requests_finished", "Requests that finished (stop or length)."),
    ("genfn_requests_cancelled_total", "requests_cancelled", "Requests cancelled before they finished."),
    ("genfn_requests_failed_total", "requests_failed", "Requests that ended with an error."),
    ("genfn_prompt_tokens_total", "prompt_tokens_total", "Prompt tokens of requests that produced a first token."),
    ("genfn_generation_tokens_total", "generation_tokens_total", "Tokens generated."),
    ("genfn_prompt_tokens_cached_total", "prompt_tokens_cached_total",
     "Tokens taken from the prefix cache instead of computed."),
)
_GAUGES = (
    ("genfn_requests_running", "running", "Requests admitted to the batch (prefilling or decoding)."),
    ("genfn_requests_waiting", "waiting", "Requests queued or preempted, waiting for admission."),
    # A gauge must not end in _total (Prometheus reads that suffix as a counter).
    ("genfn_kv_blocks_capacity", "kv_blocks_total", "KV cache blocks in the paged cache."),
    ("genfn_kv_blocks_used", "kv_blocks_used", "KV cache blocks held by live requests."),
    ("genfn_kv_blocks_free", "kv_blocks_free", "KV cache blocks not held by a live request."),
    ("genfn_kv_blocks_cached", "kv_blocks_cached", "Free KV cache blocks that keep a reusable prefix."),
    ("genfn_tokens_per_second", "tokens_per_second", "Tokens generated per second over the last few seconds."),
)
_HISTOGRAMS = (
    ("genfn_time_to_first_token_seconds", "time_to_first_token",
     "Seconds from a request's arrival to its first generated token."),
    ("genfn_inter_token_latency_seconds", "inter_token_latency",
     "Seconds between consecutive generated tokens of a request."),
)


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _histogram_lines(name: str, hist: Histogram, labels: str) -> list[str]:
    lines = []
    for bound, count in zip(hist.buckets, hist.counts):
        lines.append(f'{name}_bucket{{{labels},le="{_number(float(bound))}"}} {count}')
    if not hist.buckets or hist.buckets[-1] != math.inf:
        lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {hist.count}')
    lines.append(f"{name}_sum{{{labels}}} {_number(float(hist.sum))}")
    lines.append(f"{name}_count{{{labels}}} {hist.count}")
    return lines


def render(metrics: EngineMetrics, model_name: str) -> str:
    """The Prometheus text of ``metrics``, every sample labelled ``model_name``."""
    if not isinstance(metrics, EngineMetrics):
        raise TypeError(f"`metrics` must be an EngineMetrics, got {type(metrics).__name__}")
    if not isinstance(model_name, str):
        raise TypeError(f"`model_name` must be a str, got {type(model_name).__name__}")
    labels = f'model_name="{_label_value(model_name)}"'
    lines: list[str] = []
    for kind, table in (("counter", _COUNTERS), ("gauge", _GAUGES)):
        for name, field, help_text in table:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                      f"{name}{{{labels}}} {_number(getattr(metrics, field))}"]
    for name, field, help_text in _HISTOGRAMS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        lines += _histogram_lines(name, getattr(metrics, field), labels)
    return "\n".join(lines) + "\n"
