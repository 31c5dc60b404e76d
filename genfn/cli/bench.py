"""``genfn bench``: run the decode benchmark (``python -m genfn.bench``) and plot its tokens/s per configuration.

The benchmark writes its JSON (``results``: one entry per engine, weight format and batch size);
it runs from an installed wheel as from a checkout, under OpenMP's default wait policy
(``GENFN_WAIT_POLICY=default`` unless set, as the published tables were measured). This command
writes a PNG bar chart beside it (the same name, ``.png``): one group of bars per
format and batch size, one bar per engine. ``--plot JSON`` only draws an existing result file.
The plot needs matplotlib, part of the ``bench`` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from genfn.cli.common import UserError
from genfn.cli.status import Status

__all__ = ["add_arguments", "main", "plot_results", "decode_script"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="the quick subset: float32, batch 1, 32 tokens, one repeat (a few minutes)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="where the benchmark writes its JSON (default: benchmarks/results/ in a checkout, "
                             "else ./genfn-bench-results/; $GENFN_BENCH_RESULTS overrides)")
    parser.add_argument("--plot", default=None, metavar="JSON", help="only plot this existing result file")
    parser.add_argument("--script", default=None, metavar="PATH",
                        help="a benchmark script to run instead of python -m genfn.bench")
    parser.add_argument("extra", nargs=argparse.REMAINDER,
                        help="after `--`: options for the benchmark (python -m genfn.bench --help; e.g. -- --dtypes q4_1 --batches 1)")


def decode_script(path: str | None) -> list[str]:
    """The command line that runs the benchmark: ``path`` when given, else the packaged one."""
    if path is None:
        return [sys.executable, "-m", "genfn.bench"]
    if not os.path.isfile(path):
        raise UserError(f"benchmark script not found: {path}")
    return [sys.executable, path]


def benchmark_environment() -> dict:
    """This process's environment for the benchmark, without the wait policy ``import genfn`` chose
    here (the benchmark runs under OpenMP's default unless the user chose a policy)."""
    from genfn import wait_policy

    env = dict(os.environ)
    if "genfn's choice" in wait_policy.wait_policy():
        for name, value in {**wait_policy.BUSY_POLICY, **wait_policy.QUIET_POLICY}.items():
            if env.get(name) == value:
                del env[name]
    env.setdefault("GENFN_WAIT_POLICY", "default")
    return env


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError("genfn bench plots with matplotlib, which is not installed: pip install 'genfn[bench]' "
                        "(or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _label(engine_result: dict) -> tuple[str, str]:
    return f"{engine_result['format']}\nbatch {engine_result['batch']}", engine_result["engine"]


def plot_results(json_path: str, png_path: str | None = None) -> str:
    """Draw the tokens/s of every (format, batch, engine) in ``json_path``; returns the PNG's path."""
    plt = _pyplot()
    try:
        with open(json_path, encoding="utf-8") as f:
            payload = json.load(f)
    except FileNotFoundError:
        raise UserError(f"benchmark results not found: {json_path}") from None
    except json.JSONDecodeError as err:
        raise UserError(f"benchmark results {json_path} are not valid JSON: {err.msg}") from None
    results = payload.get("results") if isinstance(payload, dict) else None
    if not isinstance(results, list):
        raise UserError(f"{json_path} has no 'results' list (is it the decode benchmark's JSON?)")
    measured = [r for r in results if isinstance(r, dict) and r.get("error") is None
                and isinstance(r.get("tok_s"), (int, float)) and {"engine", "format", "batch"} <= set(r)]
    if not measured:
        raise UserError(f"{json_path} holds no successful measurement to plot")
    groups = list(dict.fromkeys(_label(r)[0] for r in measured))
    engines = list(dict.fromkeys(_label(r)[1] for r in measured))
    value = {_label(r): r["tok_s"] for r in measured}
    width = 0.8 / len(engines)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * max(1, len(engines)) * 0.6), 4.5))
    for i, engine in enumerate(engines):
        xs = [g + (i - (len(engines) - 1) / 2) * width for g in range(len(groups))]
        heights = [value.get((group, engine), 0.0) for group in groups]
        bars = ax.bar(xs, heights, width, label=engine)
        ax.bar_label(bars, labels=[f"{h:.0f}" if h else "" for h in heights], fontsize=7, padding=2)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("tokens / s (higher is better)")
    threads = payload.get("threads")
    tokens = (payload.get("args") or {}).get("new_tokens")
    ax.set_title(f"genfn decode speed{f', {tokens} greedy tokens' if tokens else ''}"
                 f"{f', {threads} threads' if threads else ''}")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    png_path = png_path or os.path.splitext(json_path)[0] + ".png"
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def main(args, status: Status) -> int:
    if args.plot is not None:
        status.line(f"plotted {plot_results(args.plot)}")
        return 0
    _pyplot()  # a missing matplotlib is said now, not after minutes of benchmarking
    from genfn.bench.results import results_dir

    runner = decode_script(args.script)
    json_path = args.json or str(results_dir() / time.strftime("decode-%Y-%m-%d-%H%M%S.json"))
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    command = [*runner, "--json", json_path, *(["--quick"] if args.quick else []), *extra]
    status.line(f"running {' '.join(command[1:])}")
    done = subprocess.run(command, env=benchmark_environment())
    if done.returncode != 0:
        status.line(f"error: the benchmark exited with status {done.returncode}", always=True)
        return done.returncode
    status.line(f"results in {json_path}; plot in {plot_results(json_path)}")
    return 0
