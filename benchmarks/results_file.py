"""Where a benchmark writes its JSON: ``benchmarks/results/<name>-<UTC date and time>[-tag].json``
unless the caller names a file, with the folder made on the way."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, payload: Any, path: str | Path | None = None, tag: str | None = None,
                  indent: int = 1) -> Path:
    """Write ``payload`` as JSON to ``path`` or to the default file for ``name`` (and ``tag``);
    return where it went."""
    if path:
        out = Path(path)
    else:
        stamp = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d-%H%M}"
        out = RESULTS / f"{name}-{stamp}{'-' + tag if tag else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=indent))
    return out
