"""The batch-invariant mode's float linear (``invariant_linear``) of this tree against the one of a
git revision, and both against continuous batching's packed GEMM, in one process.

The revision's ``decode_linear.cpp`` (and its headers) are built (``genfn.bench.revision_kernels``)
into a separate library with the op namespace renamed (``genfn_kernels_base``), so the two kernels
run side by side, interleaved round by round, on SmolLM2's linear shapes with random weights.
Checks that both give the same bits (the mode's per-element order is the invariant), then prints
the best (``--best``) or median milliseconds of ``--rounds`` rounds and each one's ratio to the
packed GEMM. ``--shapes llama-1b`` takes the 1B model's linears instead (Llama-3.2-1B; bfloat16
there is what a 1B BF16 file's decode step runs), ``--rows`` a comma list of row counts (from 1:
the decode kernel's blocks up to 8 rows, the panels past them), ``--cpu-time`` the process's CPU
time instead of wall time (on a shared machine: leaves out the time its threads waited for a core).

    python benchmarks/invariant_linear_ab.py --baseline main [--rows 32] [--rounds 9] [--threads 1] [--best]
    python benchmarks/invariant_linear_ab.py --baseline main --shapes llama-1b --dtype bfloat16 --rows 1,8,16,32 --cpu-time
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from genfn import kernels
from genfn.bench.revision_kernels import build_at_revision
from genfn.kernels import native
from genfn.kernels.packed_gemm import PackedWeight, packed_linear

SHAPES = {
    "smollm2": {"wqkv": (960, 576), "wo": (576, 576), "w_gate_up": (3072, 576), "w_down": (576, 1536),
                "lm_head": (49152, 576)},
    "llama-1b": {"wqkv": (3072, 2048), "wo": (2048, 2048), "w_gate_up": (16384, 2048), "w_down": (2048, 8192),
                 "lm_head": (128256, 2048)},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="git revision whose invariant_linear to compare with")
    parser.add_argument("--rows", default="32", help="comma list of row counts of x")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--cpu-time", action="store_true", help="process CPU time instead of wall time")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--best", action="store_true", help="best of the rounds instead of their median")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: both")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    if not rows_list or min(rows_list) < 1:
        raise SystemExit(f"--rows must be positive counts, got {args.rows!r}")
    clock = time.process_time if args.cpu_time else time.perf_counter
    if not kernels.decode_linear_available():
        raise SystemExit(f"the native kernels are not available: {kernels.kernel_status()}")
    torch.set_num_threads(args.threads)
    torch.ops.load_library(str(build_at_revision(native.DECODE, args.baseline, {"genfn_kernels": "genfn_kernels_base"},
                                                 sources=("decode_linear.cpp",))))
    base, new = torch.ops.genfn_kernels_base.invariant_linear, torch.ops.genfn_kernels.invariant_linear
    dtypes = [getattr(torch, args.dtype)] if args.dtype else [torch.float32, torch.bfloat16]
    pick = min if args.best else statistics.median
    print(f"{args.shapes} shapes, {args.threads} thread(s), {'best' if args.best else 'median'} of {args.rounds} rounds, "
          f"ms of {'CPU' if args.cpu_time else 'wall'} time (x: against the packed GEMM)")
    for dtype in dtypes:
        for name, (n, k) in SHAPES[args.shapes].items():
            torch.manual_seed(0)
            weight = (torch.randn(n, k) / k ** 0.5).to(dtype)
            packed = PackedWeight(weight)
            for rows in rows_list:
                x = torch.randn(rows, k).to(dtype)
                assert torch.equal(base(x, weight), new(x, weight)), f"{name} {dtype} {rows} rows: the two kernels' bits differ"
                runs = {"packed GEMM": lambda: packed_linear(x, packed), args.baseline: lambda: base(x, weight),
                        "this tree": lambda: new(x, weight)}
                reps = max(1, int(2e8 / (2 * rows * n * k)))
                ms = {key: [] for key in runs}
                for _ in range(args.rounds):  # interleaved, so that the machine's load hits each alike
                    for key, fn in runs.items():
                        fn()
                        start = clock()
                        for _ in range(reps):
                            fn()
                        ms[key].append((clock() - start) * 1e3 / reps)
                times = {key: pick(v) for key, v in ms.items()}
                gemm, ours = times["packed GEMM"], times["this tree"]
                print(f"  {str(dtype)[6:]:<9} {name:<10} {rows:>3} rows  " + "   ".join(
                    f"{key} {t:.3f} ({t / gemm:.2f}x)" for key, t in times.items())
                    + f"   this tree {times[args.baseline] / ours:.2f}x as fast, {2 * rows * n * k / ours / 1e6:.0f} GFLOP/s",
                    flush=True)

if __name__ == "__main__":
    main()
