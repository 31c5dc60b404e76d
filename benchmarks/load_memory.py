"""Load time and memory of GGUF files: ``genfn.load(file, quantize="gguf")`` in a fresh process each.

    python benchmarks/load_memory.py --model ~/.cache/genfn/models/llama-1b-q4_0.gguf
    python benchmarks/load_memory.py --model A.gguf,B.gguf --repeats 3 --json out.json

Per file and repeat, one child process imports genfn and loads the native kernels first (so that
neither is counted), forgets its peak resident memory (``/proc/self/clear_refs``), then times
``genfn.load`` and reads ``VmRSS`` before and after and ``VmHWM`` (the peak) from
``/proc/self/status``. Printed and written to JSON: load seconds, resident memory before, after
and at the peak, and the peak over the process's own (the load's cost) against the file size.
Issue 31's bars: load <= 1 s per GB of file; peak <= 1.15x the file for quantized files.
The file's pages stay in the page cache between repeats (a warm read, as on a second start).

``--dtype float32|bfloat16`` times ``genfn.load(file, dtype=...)`` instead (a float load), and
``--as-avx2`` runs each child as a CPU without AVX-512 (``genfn.bench.avx2``).

``--variants`` compares settings in one session, each repeat running every file under every
variant in turn (interleaved, so a busy machine's load falls on all of them alike): a variant is
``label:NAME=VALUE,...``, environment variables for its child; ``PYTHONPATH`` picks another
source tree (an export of the previous commit: the "before"). For example

    python benchmarks/load_memory.py --model A.gguf --repeats 3 \
        --variants "before:PYTHONPATH=/tmp/base;numpy tiles:GENFN_NATIVE_TILES=0;after:"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = """
import json, sys, time
if sys.argv[3] == "avx2":
    from genfn.bench.avx2 import run_as_avx2_cpu
    run_as_avx2_cpu()
import torch
import genfn
from genfn import kernels
from genfn.models.loaders import gguf
kernels.quant_linear_available()
kernels.decode_stack_isa()

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
t = time.perf_counter()
model = (genfn.load(sys.argv[1], quantize="gguf") if sys.argv[2] == "gguf"
         else genfn.load(sys.argv[1], dtype=getattr(torch, sys.argv[2])))
seconds = time.perf_counter() - t
print(json.dumps({"load_s": seconds, "rss_before": before, "rss_after": status("VmRSS:"), "peak": status("VmHWM:")}))
"""


def measure(path: str, timeout: float, env: dict | None = None, dtype: str = "gguf", cpu: str = "native") -> dict:
    # -P: where the variant names a PYTHONPATH, the working directory's genfn must not come first.
    isolate = ["-P"] if env and "PYTHONPATH" in env else []
    done = subprocess.run([sys.executable, *isolate, "-c", CHILD, path, dtype, cpu], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    if done.returncode:
        raise RuntimeError(f"loading {path} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_variants(text: str) -> dict[str, dict[str, str]]:
    """``"a:X=1,Y=2;b:"`` -> ``{"a": {"X": "1", "Y": "2"}, "b": {}}``."""
    variants = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        label, _, settings = item.partition(":")
        try:
            variants[label.strip()] = dict(pair.split("=", 1) for pair in filter(None, settings.split(",")))
        except ValueError:
            raise ValueError(f"--variants: {item!r} is not label:NAME=VALUE,...") from None
    return variants


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="GGUF files, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", default=None, help="default: benchmarks/results/load-memory-<time>.json")
    parser.add_argument("--variants", default=None,
                        help='"label:NAME=VALUE,...;label:..." environments to compare, interleaved (see above)')
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                        help="load as genfn.load(file, dtype=...) (default: quantize='gguf', the blocks as stored)")
    parser.add_argument("--as-avx2", action="store_true",
                        help="each child runs as a CPU without AVX-512 (genfn.bench.avx2)")
    args = parser.parse_args(argv)
    from genfn.bench.results import write_results

    variants = parse_variants(args.variants) if args.variants else {"": {}}
    paths = args.model.split(",")
    report = {"load_avg_start": os.getloadavg()[0], "variants": variants, "dtype": args.dtype,
              "as_avx2": args.as_avx2, "files": []}
    runs: dict = {(path, label): [] for path in paths for label in variants}
    for _ in range(args.repeats):
        for path in paths:
            for label, env in variants.items():
                run = measure(path, args.timeout, env, args.dtype or "gguf", "avx2" if args.as_avx2 else "native")
                run["load_avg"] = os.getloadavg()[0]
                runs[path, label].append(run)
    for (path, label), done in runs.items():
        size = os.path.getsize(path)
        best = min(done, key=lambda r: r["load_s"])
        extra = min(r["peak"] - r["rss_before"] for r in done)
        report["files"].append({"model": path, "variant": label, "file_bytes": size, "runs": done})
        times = ", ".join(f"{r['load_s']:.2f}" for r in done)
        print(f"{os.path.basename(path)} ({size / 1e9:.2f} GB){' ' + label if label else ''}: load {best['load_s']:.2f} s "
              f"({best['load_s'] / (size / 1e9):.2f} s/GB; all {times}); "
              f"resident before {best['rss_before'] / 1e9:.2f} GB, after {best['rss_after'] / 1e9:.2f} GB, peak "
              f"{best['peak'] / 1e9:.2f} GB; the load's peak over the process's: {extra / 1e9:.2f} GB = "
              f"{extra / size:.2f}x the file", flush=True)
    report["load_avg_end"] = os.getloadavg()[0]
    report["when"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    print(f"# wrote {write_results('load-memory', report, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
