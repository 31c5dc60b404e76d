"""Continuous batching's many-row linears: genfn's bfloat16 GEMM against oneDNN's, and the two
continuous-batching engines built on them, in one process. On a CPU with AMX-BF16 oneDNN's GEMM
runs on the tiles and is genfn's default (``genfn.kernels.packed_gemm.bf16_gemm_preferred``).

    python benchmarks/gemm.py                      # kernels at 16-512 rows, then the engines
    python benchmarks/gemm.py --no-engines --rows 32 64

Kernels: for each of SmolLM2's linear shapes (the fused q/k/v, o, gate/up, down and LM head) and
each row count, ``ROUNDS`` (env, default 5) alternations of oneDNN's GEMM on its packed weight
(``torch.ops.mkldnn._linear_pointwise``, what ``genfn.kernels.packed_gemm`` used before) and
genfn's ``bf16_gemm`` on its own packing, ``bf16_gemm_plain`` (the prefill layer's: the plain
weight, each panel packed as it goes) and ``F.linear`` on the plain weight (what it ran before);
prints the median GFLOP/s of each and their ratios. For the gate/up shape also oneDNN's GEMM
followed by genfn's ``silu_mul`` against ``bf16_gemm_swiglu`` (the two in one pass). ``--cpu-time`` (with ``--threads 1``) times by the thread's CPU time, which other
processes' turns on a shared machine do not inflate.
Engines: ``generate_batch`` of the parallel workload (32 prompts of 30 random tokens, greedy,
``--new-tokens`` tokens) with each GEMM, alternating, ``ROUNDS`` rounds after one warm-up each;
prints the wall times, their ratios, and how many requests got the same tokens (bfloat16 sums in
another order can move a near-tie).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from genfn.bench.results import write_results  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "5"))
# SmolLM2-135M: [out, in] of wqkv, wo, w_gate_up, w_down and the LM head.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


_clock = time.perf_counter


def _seconds(fn, reps: int) -> float:
    start = _clock()
    for _ in range(reps):
        fn()
    return (_clock() - start) / reps


def kernels(rows_list):
    ops = torch.ops.genfn_kernels
    out = []
    for rows in rows_list:
        for n, k in SHAPES:
            weight, x = torch.randn(n, k).bfloat16(), torch.randn(rows, k).bfloat16()
            onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
            genfn = ops.pack_bf16_gemm_weight(weight)
            runs = {
                "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
                "genfn": lambda: ops.bf16_gemm(x, genfn, n, None, False),
                "plain": lambda: ops.bf16_gemm_plain(x, weight, None, False),
                "F.linear": lambda: torch.nn.functional.linear(x, weight),  # what the prefill layer ran
            }
            if n == 3072:  # gate/up: with the SwiGLU pass that follows it, or fused
                runs["onednn+silu_mul"] = lambda: ops.silu_mul(
                    torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""))
                runs["swiglu"] = lambda: ops.bf16_gemm_swiglu(x, weight)
            reps = max(3, int(4e8 / (2 * rows * n * k)))
            times = {name: [] for name in runs}
            for fn in runs.values():
                fn()
            for _ in range(ROUNDS):
                for name, fn in runs.items():
                    times[name].append(_seconds(fn, reps))
            flops = 2 * rows * n * k
            rate = {name: flops / statistics.median(t) / 1e9 for name, t in times.items()}
            out.append({"rows": rows, "out": n, "in": k, "gflops": rate})
            print(f"rows {rows:4d}  {n:5d} x {k:4d}  GFLOP/s oneDNN {rate['onednn']:6.1f}  genfn {rate['genfn']:6.1f}"
                  f"  genfn/oneDNN {rate['genfn'] / rate['onednn']:.2f}x  plain {rate['plain']:6.1f}"
                  f"  plain/oneDNN {rate['plain'] / rate['onednn']:.2f}x  F.linear {rate['F.linear']:6.1f}"
                  f"  plain/F.linear {rate['plain'] / rate['F.linear']:.2f}x"
                  + (f"  swiglu/(oneDNN+silu_mul) {rate['swiglu'] / rate['onednn+silu_mul']:.2f}x"
                     if n == 3072 else ""),
                  flush=True)
    return out


def engines(new_tokens: int):
    import genfn
    import genfn.kernels.packed_gemm as packed_gemm
    from genfn.config.batching import ContinuousBatchingConfig

    model = genfn.load(dtype=torch.bfloat16)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, model.spec.vocab_size - 1) for _ in range(30)] for _ in range(32)]
    config = ContinuousBatchingConfig(page_size=32, max_requests_per_batch=32, max_batch_tokens=512)
    preferred = packed_gemm.bf16_gemm_preferred
    variants = {"genfn": lambda: True, "onednn": lambda: False}
    walls, tokens = {name: [] for name in variants}, {}
    try:
        for round_ in range(ROUNDS + 1):
            for name, choice in variants.items():
                packed_gemm.bf16_gemm_preferred = choice  # read when generate_batch packs the weights
                start = time.perf_counter()
                outputs = model.generate_batch(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                               do_sample=False, continuous_batching_config=config, warmup=False)
                if round_:
                    walls[name].append(time.perf_counter() - start)
                tokens[name] = [o.generated_tokens for o in outputs.values()]
    finally:
        packed_gemm.bf16_gemm_preferred = preferred
    ratios = [b / a for a, b in zip(walls["genfn"], walls["onednn"])]
    same = sum(a == b for a, b in zip(tokens["genfn"], tokens["onednn"]))
    for name, w in walls.items():
        print(f"generate_batch 32 x (30 + {new_tokens}) with {name:6s} GEMM: wall s " + " ".join(f"{v:.2f}" for v in w))
    print("oneDNN / genfn wall per round: " + " ".join(f"{r:.2f}" for r in ratios)
          + f"  (median {statistics.median(ratios):.2f}x); requests with equal tokens {same}/{len(prompts)}")
    return {"walls": walls, "ratios": ratios, "equal_tokens": same, "requests": len(prompts)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 512])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--no-engines", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-time", action="store_true", help="time the kernels by the thread's CPU time (--threads 1)")
    args = ap.parse_args(argv)
    if args.cpu_time and args.threads != 1:
        raise ValueError("--cpu-time counts the calling thread's time only: it needs --threads 1")
    if args.cpu_time:
        global _clock
        _clock = time.thread_time
    torch.set_num_threads(args.threads)
    from genfn.kernels.packed_gemm import bf16_gemm_available, onednn_has_amx_bf16

    if not bf16_gemm_available():
        sys.exit("genfn's bfloat16 GEMM is not available here (it needs the native kernels and AVX512_BF16)")
    print(f"# bfloat16 GEMM, torch {torch.__version__}, {args.threads} threads, {ROUNDS} rounds"
          f"{', thread CPU time' if args.cpu_time else ''}, load average {os.getloadavg()[0]:.2f}, oneDNN on AMX tiles: "
          f"{onednn_has_amx_bf16()} (genfn's default GEMM: {'oneDNN' if onednn_has_amx_bf16() else 'genfn'})", flush=True)
    payload = {"kernels": kernels(args.rows)}
    if not args.no_engines:
        payload["engines"] = engines(args.new_tokens)
    print(f"# wrote {write_results('gemm', payload)}")


if __name__ == "__main__":
    main()
