"""Quantized linear kernels side by side in one process: Q4_0/Q8_0 (quant_linear) against Q4_K/Q6_K
(kquant_linear) on one 8192 x 2048 matrix (Llama-3.2-1B's gate/up size), 1 and 9 rows of x.

    python benchmarks/kquant_kernels.py [THREADS]      # default 2

Formats are interleaved over 4 rounds (best of each). GB/s counts the weight's bytes once per call;
the matrices (5-17 MB) may sit in a large L3, so this compares the kernels' cost per byte, not the
memory's bandwidth (the last line prints tensor.sum() over 256 MiB for that).
"""
import sys, time, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from genfn import kernels
from genfn.quant import quantize, QuantizedWeight, quantize_k
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
N, K = 8192, 2048
w = torch.randn(N, K) * 0.02
weights = {"q4_0": QuantizedWeight.from_rows(quantize(w, "q4_0")), "q8_0": QuantizedWeight.from_rows(quantize(w, "q8_0")),
           "q4_k": quantize_k(w, "q4_k"), "q6_k": quantize_k(w, "q6_k")}
big = torch.ones(256 * 2**20 // 4)
def best(fn, n=5):
    fn(); b = 1e9
    for _ in range(n):
        t = time.perf_counter(); fn(); b = min(b, time.perf_counter() - t)
    return b
results = {}
for rnd in range(4):
    for rows in (1, 9):
        x = torch.randn(rows, K)
        for f, v in weights.items():
            t = best(lambda: kernels.linear(x, v), 3)
            results[(rows, f)] = min(results.get((rows, f), 1e9), t)
for rows in (1, 9):
    print(f"rows {rows}: " + "  ".join(f"{f} {weights[f].nbytes / results[(rows, f)] / 1e9:5.2f} GB/s ({results[(rows, f)]*1e3:.2f} ms)" for f in weights), flush=True)
print("9-row / 1-row time: " + "  ".join(f"{f} {results[(9, f)] / results[(1, f)]:.2f}" for f in weights))
t = best(big.sum); print(f"sum {big.numel()*4/t/1e9:.1f} GB/s")
