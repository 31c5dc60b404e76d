"""Where a benchmark writes its JSON: ``<results dir>/<name>-<UTC date and time>[-tag].json``
unless the caller names a file, with the folder made on the way. A second run in the same minute
gets ``-2``, ``-3``, ... after the time rather than overwriting the first run's file.

The results dir is ``$GENFN_BENCH_RESULTS`` when set; else, in a source checkout (genfn imported
from a tree with a ``benchmarks/`` folder beside the package), that folder's ``results/``; else
``genfn-bench-results/`` under the current directory (an installed wheel has no checkout).
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["results_dir", "write_results"]


def results_dir() -> Path:
    """The folder benchmark results go to by default (module docstring)."""
    if os.environ.get("GENFN_BENCH_RESULTS"):
        return Path(os.environ["GENFN_BENCH_RESULTS"])
    checkout = Path(__file__).resolve().parents[2] / "benchmarks"
    return checkout / "results" if checkout.is_dir() else Path.cwd() / "genfn-bench-results"


def write_results(name: str, payload: Any, path: str | Path | None = None, tag: str | None = None,
                  indent: int = 1) -> Path:
    """Write ``payload`` as JSON to ``path`` or to the default file for ``name`` (and ``tag``);
    return where it went."""
    if path:
        out = Path(path)
    else:
        stamp = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d-%H%M}"
        suffix = f"{'-' + tag if tag else ''}.json"
        out = results_dir() / f"{name}-{stamp}{suffix}"
        count = 1
        while out.exists():  # a run in the same minute: never overwrite an earlier run's results
            count += 1
            out = results_dir() / f"{name}-{stamp}-{count}{suffix}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=indent))
    return out
