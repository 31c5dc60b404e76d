"""Timing several ways of doing one thing side by side, for the measurement scripts in ``benchmarks/``."""

from __future__ import annotations

import time
from typing import Callable


def interleaved(calls: dict[str, Callable[[], object]], repeats: int, warm_up: bool = True) -> dict:
    """``{name: (last output, [seconds per repeat])}``; each repeat times every call once, in turn,
    so a change in the machine's load hits every call alike. ``warm_up``: each call runs once,
    untimed, first (a compiled engine compiles, a weight comes into the caches it would be in)."""
    if warm_up:
        for call in calls.values():
            call()
    results = {name: (None, []) for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            out = call()
            results[name] = (out, results[name][1] + [time.perf_counter() - start])
    return results
