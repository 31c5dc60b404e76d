"""The tiles formats' product on AVX2 (``tiles_avx2.cpp``, what a CPU without AVX-512 VNNI runs for
Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 weights) against the decode library's VNNI kernel, kernel by kernel, in one
process on a CPU that has both:

    python benchmarks/tiles_avx2.py                       # every format, 1, 2, 4 and 8 rows of x
    python benchmarks/tiles_avx2.py --formats q8_0 --rows 1 --avx2-only --rounds 3

Each product streams eight 1B-shaped matrices (8192 x 2048, the up projection's shape) from memory,
80-140 MB in all, so the rate is what a decode step's linears get: bytes of weights read per second,
the best of ``--repeats`` passes over the eight. ``--avx2-only`` skips the VNNI kernel (a tree without
the decode library, or one compared against itself across builds: run it in each tree's worktree in
turn). ``tensor.sum``'s read rate is printed before and after, since this VM's memory speed drifts.
"""

from __future__ import annotations

import argparse
import time

import torch

from genfn import kernels
from genfn.bench.decode import read_bandwidth_gbs
from genfn.kernels import kquant, native
from genfn.quant import FORMATS, QuantizedWeight, quantize


def _rate(product, x: torch.Tensor, weights: list[QuantizedWeight], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            product(x, w)
        best = min(best, time.perf_counter() - start)
    return sum(w.nbytes for w in weights) / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma list among {', '.join(FORMATS)}")
    ap.add_argument("--rows", default="1,2,4,8", help="rows of x, comma list")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=1, help="passes over every case, one after another")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--avx2-only", action="store_true", help="time the AVX2 kernel alone")
    args = ap.parse_args()
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise SystemExit(f"--formats: {', '.join(unknown)} unknown; choose among {', '.join(FORMATS)}")
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    if not kquant.tiles_kernel_runs():
        raise SystemExit(f"the AVX2 tiles kernel does not run here (K-quant kernels: {kquant.kquant_status()})")
    with_vnni = not args.avx2_only and kernels.decode_linear_available() and native.cpu_has("avx512_vnni")
    torch.set_num_threads(args.threads)
    print(f"# tiles on AVX2{' against VNNI' if with_vnni else ''}: {args.threads} threads, "
          f"read rate {read_bandwidth_gbs()[0]:.1f} GB/s (tensor.sum)")
    generator = torch.Generator().manual_seed(0)
    for round_ in range(args.rounds):
        for fmt in formats:
            weights = [QuantizedWeight.from_rows(quantize(torch.randn(8192, 2048, generator=generator) * 0.05, fmt))
                       for _ in range(8)]
            for m in rows:
                x = torch.randn(m, 2048, generator=generator)
                avx2 = _rate(kquant.tiles_linear, x, weights, args.repeats)
                line = f"round {round_ + 1} {fmt} rows {m}: avx2 {avx2:5.1f} GB/s"
                if with_vnni:
                    vnni = _rate(kernels.quantized_linear, x, weights, args.repeats)
                    line += f"  vnni {vnni:5.1f} GB/s  avx2 / vnni rate {avx2 / vnni:.2f}"
                print(line, flush=True)
    print(f"# read rate after: {read_bandwidth_gbs()[0]:.1f} GB/s")


if __name__ == "__main__":
    main()
