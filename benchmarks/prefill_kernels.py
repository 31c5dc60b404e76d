"""A prefill's kernels one at a time: each weight format's product of many rows through
``genfn.kernels.linear`` and the causal prefill attention op, in one process:

    python benchmarks/prefill_kernels.py --as-avx2 --threads 1
    python benchmarks/prefill_kernels.py --formats q4_k,q8_0 --shapes 8192x2048 --rows 512
    PYTHONPATH=<other tree> python benchmarks/prefill_kernels.py --as-avx2    # tree against tree

Formats: the tiles (q8_0, q4_0, q4_1, q5_0), the K-quants as stored (q4_k, q5_k, q6_k, iq4_xs) and
bfloat16 (``bf16``: on a CPU without AVX512_BF16 a float32 GEMM of the widened values, else oneDNN's;
for comparison ``bf16_torch``, ``F.linear`` on the bfloat16 tensors, and ``bf16_float32``, ``F.linear``
on them widened, rounded once). ``--as-avx2`` runs this
process as a CPU without AVX-512 (``genfn.bench.avx2``; torch's own kernels keep this CPU's paths
unless ``ATEN_CPU_CAPABILITY``/``ONEDNN_MAX_CPU_ISA``/``MKL_ENABLE_INSTRUCTIONS`` hold them). Each
figure is the best of ``--repeats`` calls, timed by the thread's CPU time at ``--threads 1`` (other
processes' turns on a shared machine do not inflate it) and by the wall clock on more. Products
print multiply-adds a second (int8 or float), the attention its time per call. A checksum of each
output follows, so two trees' runs show whether the bits moved. ``--decode-slots N`` adds the decode
attention op (``dense_decode_attention``: one query a head against N cached slots, what each step
after a long prompt pays per layer) for the same head counts.
"""

from __future__ import annotations

import argparse

import torch

# This folder's: thread CPU time at one thread (else wall), and a weight in a quantized format.
from kquant_kernels import best as best_seconds, gemm_weight


def weight_in(fmt: str, w: torch.Tensor):
    return w.bfloat16() if fmt.startswith("bf16") else gemm_weight(w, fmt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="q8_0,q4_0,q4_1,q5_0,q4_k,q5_k,q6_k,iq4_xs,bf16")
    ap.add_argument("--shapes", default="2048x2048,16384x2048", help="out x in features, comma list")
    ap.add_argument("--rows", type=int, default=512, help="rows of x (prompt tokens)")
    ap.add_argument("--heads", default="9/3,32/8", help="query/kv heads of the attention cases (head_dim 64)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--as-avx2", action="store_true", help="run as a CPU without AVX-512")
    ap.add_argument("--decode-slots", type=int, default=0, help="also time the decode attention over this many slots")
    args = ap.parse_args()
    if args.as_avx2:
        from genfn.bench.avx2 import run_as_avx2_cpu

        run_as_avx2_cpu()
    from genfn import kernels

    torch.set_num_threads(args.threads)
    print(f"# prefill kernels: {args.rows} rows, {args.threads} threads, decode library "
          f"{kernels.decode_stack_isa()}, best of {args.repeats}")
    generator = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        out_features, in_features = (int(v) for v in shape.split("x"))
        w = torch.randn(out_features, in_features, generator=generator) * 0.05
        x = torch.randn(args.rows, in_features, generator=generator)
        for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
            weight = weight_in(fmt, w)
            xs = x.bfloat16() if fmt.startswith("bf16") else x
            product = {"bf16_torch": torch.nn.functional.linear,
                       "bf16_float32": lambda a, b: torch.nn.functional.linear(a.float(), b.float()).to(a.dtype),
                       }.get(fmt, kernels.linear)
            seconds = best_seconds(lambda: product(xs, weight), args.repeats)
            checksum = product(xs, weight).double().sum().item()
            print(f"{shape} {fmt:12s} {seconds * 1e3:8.2f} ms  {args.rows * out_features * in_features / seconds / 1e9:6.1f} "
                  f"GMAC/s  checksum {checksum:.6f}", flush=True)
    if not kernels.portable_ops_available():
        print("# no prefill attention op here (neither decode library loads)")
        return
    mask = torch.ones(args.rows, args.rows, dtype=torch.bool).tril()[None, None]
    for pair in args.heads.split(","):
        heads, kv_heads = (int(v) for v in pair.split("/"))
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(1, h, args.rows, 64, generator=generator).to(dtype)
                       for h in (heads, kv_heads, kv_heads))
            call = lambda: torch.ops.genfn_kernels.prefill_attention(q, k, v, mask, 64 ** -0.5)  # noqa: E731
            seconds = best_seconds(call, args.repeats)
            print(f"attention {heads}/{kv_heads} heads {str(dtype).removeprefix('torch.'):8s} {seconds * 1e3:8.2f} ms  "
                  f"checksum {call().double().sum().item():.6f}", flush=True)
            if args.decode_slots > 0:
                q1, k1, v1 = (torch.randn(*shape, generator=generator).to(dtype)
                              for shape in ((1, heads, 64), (1, kv_heads, args.decode_slots, 64),
                                            (1, kv_heads, args.decode_slots, 64)))
                visible = torch.ones(1, args.decode_slots, dtype=torch.bool)
                step = lambda: torch.ops.genfn_kernels.dense_decode_attention(q1, k1, v1, visible, 64 ** -0.5)  # noqa: E731
                seconds = best_seconds(step, 4 * args.repeats)
                print(f"decode attention {heads}/{kv_heads} heads {args.decode_slots} slots "
                      f"{str(dtype).removeprefix('torch.'):8s} {seconds * 1e6:8.1f} us  "
                      f"checksum {step().double().sum().item():.6f}", flush=True)


if __name__ == "__main__":
    main()
