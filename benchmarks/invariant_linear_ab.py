"""The batch-invariant mode's float linear (``invariant_linear``) of this tree against the one of a
git revision, and both against continuous batching's packed GEMM, in one process.

The revision's ``decode_linear.cpp`` (and its headers) are built (``genfn.bench.revision_kernels``)
into a separate library with the op namespace renamed (``genfn_kernels_base``), so the two kernels
run side by side, interleaved round by round, on SmolLM2's linear shapes with random weights.
Checks that both give the same bits (the mode's per-element order is the invariant), then prints
the best (``--best``) or median milliseconds of ``--rounds`` rounds and each one's ratio to the
packed GEMM.

    python benchmarks/invariant_linear_ab.py --baseline main [--rows 32] [--rounds 9] [--threads 1] [--best]
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

SHAPES = {"wqkv": (960, 576), "wo": (576, 576), "w_gate_up": (3072, 576), "w_down": (576, 1536),
          "lm_head": (49152, 576)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="git revision whose invariant_linear to compare with")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--best", action="store_true", help="best of the rounds instead of their median")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: both")
    args = parser.parse_args()
    if not kernels.decode_linear_available():
        raise SystemExit(f"the native kernels are not available: {kernels.kernel_status()}")
    torch.set_num_threads(args.threads)
    torch.ops.load_library(str(build_at_revision(native.DECODE, args.baseline, {"genfn_kernels": "genfn_kernels_base"},
                                                 sources=("decode_linear.cpp",))))
    base, new = torch.ops.genfn_kernels_base.invariant_linear, torch.ops.genfn_kernels.invariant_linear
    dtypes = [getattr(torch, args.dtype)] if args.dtype else [torch.float32, torch.bfloat16]
    pick = min if args.best else statistics.median
    print(f"{args.rows} rows, {args.threads} thread(s), {'best' if args.best else 'median'} of {args.rounds} rounds, ms")
    for dtype in dtypes:
        for name, (n, k) in SHAPES.items():
            torch.manual_seed(0)
            weight = (torch.randn(n, k) / k ** 0.5).to(dtype)
            x = torch.randn(args.rows, k).to(dtype)
            packed = PackedWeight(weight)
            assert torch.equal(base(x, weight), new(x, weight)), f"{name} {dtype}: the two kernels' bits differ"
            runs = {"packed GEMM": lambda: packed_linear(x, packed), args.baseline: lambda: base(x, weight),
                    "this tree": lambda: new(x, weight)}
            reps = max(1, int(2e8 / (2 * args.rows * n * k)))
            ms = {key: [] for key in runs}
            for _ in range(args.rounds):  # interleaved, so that the machine's load hits each alike
                for key, fn in runs.items():
                    fn()
                    start = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    ms[key].append((time.perf_counter() - start) * 1e3 / reps)
            times = {key: pick(v) for key, v in ms.items()}
            gemm = times["packed GEMM"]
            print(f"  {str(dtype)[6:]:<9} {name:<10} " + "   ".join(
                f"{key} {t:.3f} ({t / gemm:.2f}x)" for key, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
