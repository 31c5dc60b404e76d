"""Quantized linear kernels side by side in one process: Q4_0/Q8_0 (quant_linear) against Q4_K/Q6_K
and IQ4_NL/IQ4_XS (kquant_linear) on one 8192 x 2048 matrix (Llama-3.2-1B's gate/up size), 1 and 9
rows of x (``--rows``: any counts, e.g. 64 for a prefill chunk).

    python benchmarks/kquant_kernels.py [--threads 2] [--rows 1,9,64] [--isa avx2]

Formats are interleaved over 4 rounds (best of each). GB/s counts the weight's bytes once per call;
the matrices (5-17 MB) may sit in a large L3, so this compares the kernels' cost per byte, not the
memory's bandwidth (the last line prints tensor.sum() over 256 MiB for that).
"""

from __future__ import annotations

import argparse
import time

import torch

from genfn import kernels
from genfn.kernels import kquant
from genfn.quant import QuantizedWeight, quantize, quantize_k

ROWS, COLUMNS = 8192, 2048


def best(fn, repeats: int = 5) -> float:
    fn()
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        fastest = min(fastest, time.perf_counter() - start)
    return fastest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--rows", default="1,9", help="comma list of row counts of x")
    parser.add_argument("--isa", choices=("avx2", "avx512"), default=None,
                        help="pin the K-quant kernels' path (default: the best this CPU has)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    counts = [int(r) for r in args.rows.split(",")]
    if args.isa:
        kquant.force_isa(args.isa)
    w = torch.randn(ROWS, COLUMNS) * 0.02
    weights = {"q4_0": QuantizedWeight.from_rows(quantize(w, "q4_0")),
               "q8_0": QuantizedWeight.from_rows(quantize(w, "q8_0")),
               **{fmt: quantize_k(w, fmt) for fmt in ("q4_k", "q6_k", "iq4_nl", "iq4_xs")}}
    results: dict[tuple[int, str], float] = {}
    for _ in range(args.rounds):
        for rows in counts:
            x = torch.randn(rows, COLUMNS)
            for name, weight in weights.items():
                seconds = best(lambda: kernels.linear(x, weight), 3)
                results[(rows, name)] = min(results.get((rows, name), float("inf")), seconds)
    print(f"K-quant path: {kquant.kquant_isa()}")
    for rows in counts:
        print(f"rows {rows}: " + "  ".join(
            f"{name} {weights[name].nbytes / results[(rows, name)] / 1e9:5.2f} GB/s "
            f"({results[(rows, name)] * 1e3:.2f} ms)" for name in weights), flush=True)
    for rows in counts[1:]:
        print(f"{rows}-row / {counts[0]}-row time: " + "  ".join(
            f"{name} {results[(rows, name)] / results[(counts[0], name)]:.2f}" for name in weights))
    big = torch.ones(256 * 2**20 // 4)
    print(f"sum {big.numel() * 4 / best(big.sum) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
