"""Quantized linear kernels side by side in one process: Q4_0/Q8_0 (quant_linear) against Q4_K/Q6_K
and IQ4_NL/IQ4_XS (kquant_linear) on one 8192 x 2048 matrix (Llama-3.2-1B's gate/up size), 1 and 9
rows of x (``--rows``: any counts, e.g. 64 for a prefill chunk).

    python benchmarks/kquant_kernels.py [--threads 2] [--rows 1,9,64] [--isa avx2]
    python benchmarks/kquant_kernels.py --gemm-ab --rows 9,16,64,512
    python benchmarks/kquant_kernels.py --model llama-1b-q4_k_m.gguf --prefill 512
    python benchmarks/kquant_kernels.py --stream --rows 1,2,4,8

Formats are interleaved over 4 rounds (best of each). GB/s counts the weight's bytes once per call;
the matrices (5-17 MB) may sit in a large L3, so this compares the kernels' cost per byte, not the
memory's bandwidth (the last line prints tensor.sum() over 256 MiB for that).

``--gemm-ab``: Q4_K/Q5_K/Q6_K (as stored and interleaved) and Q8_0/Q4_1/Q4_0, each row count through the row kernels and
through the GEMM (``kquant_gemm.cpp``, ``quant_gemm.cpp``; ``kquant.gemm_min_rows`` and
``kernels.quant_gemm_min_rows`` pick the path), interleaved; ``--shape 1536x576`` for another
matrix (SmolLM2's gate/up half). ``--model``: a GGUF file loaded with ``quantize="gguf"``, the
prefill of one ``--prefill``-token prompt (a 1-token ``generate``, eager) with the quantized
products on the row kernels and on the GEMMs, interleaved.

    python benchmarks/kquant_kernels.py --gemm-ab --rows 512 --shape 1536x576

``--stream``: Q8_0 and Q4_0 (quant_linear) against Q4_K, Q6_K and IQ4_XS (as stored and interleaved,
``q4_k_r8``, ``q6_k_r8``, ``iq4_xs_r8``; kquant_linear) at Llama-3.2-1B's shapes
(q/o 2048 x 2048, k/v 512 x 2048, gate/up 8192 x 2048, down 2048 x 8192), each shape as several
copies of the matrix called in turn, ``--stream-mb`` of them in all (default 128 MB, well past an
L3), so every call reads its weight from memory: GB/s here is the kernel against DRAM, as in decode.

``--decode-share``: with ``--model``, the file's K-quant products of one decode step (every layer
matrix and the LM head, in the step's order; the embedding is a lookup) called one after another
at one row of x, eagerly, so each reads its weight from memory as decode does; per format and
shape the best round's time, its share of the chain, and GB/s; interleaved with the compiled
static-cache step (ms per token, from a 64-token and a 1-token greedy decode) and ``tensor.sum``,
so the chain's time can be set against the step's and the read's.

    python benchmarks/kquant_kernels.py --model llama-1b-q4_k_m.gguf --decode-share [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from genfn import kernels
from genfn.kernels import kquant
from genfn.quant import QuantizedWeight, quantize, quantize_k
from genfn.quant.kquants import KQuantWeight
from genfn.state.base import NAMESPACE, tree_map

ROWS, COLUMNS = 8192, 2048


def best(fn, repeats: int = 5) -> float:
    """Fastest of ``repeats`` calls; on one thread in the thread's CPU time, which the other
    processes of a loaded machine do not stretch (on more, wall time)."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()
    fastest = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        fastest = min(fastest, clock() - start)
    return fastest


# The path a quantized product takes: the fewest rows that go to the GEMMs.
PATHS = {"rows": 10**9, "gemm": 1}
GEMM_FORMATS = ("q4_k", "q4_k_r8", "q5_k", "q5_k_r8", "q6_k", "q6_k_r8", "q8_0", "q4_1", "q4_0")
TILE_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")


def set_path(min_rows: int | None) -> None:
    """Both GEMMs' hand-over (K-quants and Q8_0/Q4_0/Q4_1 tiles); ``None``: the defaults."""
    kquant.gemm_min_rows(min_rows)
    kernels.quant_gemm_min_rows(min_rows)


def gemm_weight(w: torch.Tensor, fmt: str):
    """``w`` in ``fmt``: a tiles format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) or a K-quant one."""
    return QuantizedWeight.from_rows(quantize(w, fmt)) if fmt in TILE_FORMATS else quantize_k(w, fmt)


def gemm_ab(counts: list[int], rounds: int, shape: tuple[int, int]) -> None:
    """Row kernels against the GEMM per format and row count, interleaved."""
    out_features, in_features = shape
    w = torch.randn(out_features, in_features) * 0.02
    # The K-quants need in_features a multiple of 256.
    weights = {fmt: gemm_weight(w, fmt) for fmt in GEMM_FORMATS if in_features % 256 == 0 or fmt.startswith("q")
               and not fmt.endswith("_k")}
    results: dict[tuple[int, str, str], float] = {}
    try:
        for _ in range(rounds):
            for rows in counts:
                x = torch.randn(rows, in_features)
                for name, weight in weights.items():
                    for path, min_rows in PATHS.items():
                        set_path(min_rows)
                        seconds = best(lambda: kernels.linear(x, weight), 3)
                        results[(rows, name, path)] = min(results.get((rows, name, path), float("inf")), seconds)
    finally:
        set_path(None)
    print(f"K-quant path: {kquant.kquant_isa()}; {out_features} x {in_features}, {torch.get_num_threads()} threads; "
          f"ms per call, row kernels / GEMM (GEMM int8 GOP/s)")
    for rows in counts:
        print(f"rows {rows}: " + "  ".join(
            f"{name} {results[(rows, name, 'rows')] * 1e3:.2f} / {results[(rows, name, 'gemm')] * 1e3:.2f} "
            f"({results[(rows, name, 'rows')] / results[(rows, name, 'gemm')]:.2f}x, "
            f"{2 * rows * out_features * in_features / results[(rows, name, 'gemm')] / 1e9:.0f})"
            for name in weights), flush=True)


# Llama-3.2-1B's linear shapes: (name, out_features, in_features).
SHAPES_1B = (("q/o", 2048, 2048), ("k/v", 512, 2048), ("gate/up", 8192, 2048), ("down", 2048, 8192))


def stream(counts: list[int], rounds: int, megabytes: int) -> None:
    """GB/s per format, shape and row count, each call on a matrix out of cache (copies in turn)."""
    formats = ("q8_0", "q4_0", "q4_k", "q4_k_r8", "q6_k", "q6_k_r8", "iq4_xs", "iq4_xs_r8")
    results: dict[tuple[str, str, int], float] = {}
    copies: dict[tuple[str, str], list] = {}
    for name, rows_out, cols in SHAPES_1B:
        w = torch.randn(rows_out, cols) * 0.02
        for fmt in formats:
            one = QuantizedWeight.from_rows(quantize(w, fmt)) if fmt in ("q8_0", "q4_0") else quantize_k(w, fmt)
            count = max(2, megabytes * 2**20 // one.nbytes)
            copies[(name, fmt)] = [one] + [tree_map(torch.clone, one) for _ in range(count - 1)]
    for _ in range(rounds):
        for rows in counts:
            xs = {cols: torch.randn(rows, cols) for _, _, cols in SHAPES_1B}
            for name, _, cols in SHAPES_1B:
                for fmt in formats:
                    weights = copies[(name, fmt)]
                    kernels.linear(xs[cols], weights[0])
                    start = time.perf_counter()
                    for w in weights:
                        kernels.linear(xs[cols], w)
                    seconds = (time.perf_counter() - start) / len(weights)
                    key = (name, fmt, rows)
                    results[key] = min(results.get(key, float("inf")), seconds)
    print(f"K-quant path: {kquant.kquant_isa()}, {torch.get_num_threads()} threads, matrices out of cache; "
          f"GB/s (us per call), best of {rounds}")
    for rows in counts:
        for name, _, _ in SHAPES_1B:
            print(f"rows {rows} {name:8s} " + "  ".join(
                f"{fmt} {copies[(name, fmt)][0].nbytes / results[(name, fmt, rows)] / 1e9:6.2f} "
                f"({results[(name, fmt, rows)] * 1e6:6.0f})" for fmt in formats), flush=True)
    big = torch.ones(256 * 2**20 // 4)
    print(f"sum {big.numel() * 4 / best(big.sum) / 1e9:.1f} GB/s")


def prefill_ab(model_path: str, length: int, rounds: int) -> None:
    """A GGUF model's prefill of one prompt, row kernels against the GEMM, interleaved."""
    import genfn

    model = genfn.load(model_path, quantize="gguf")
    ids = torch.randint(100, model.spec.vocab_size - 100, (1, length), generator=torch.Generator().manual_seed(0))

    def prefill():
        with torch.no_grad():
            genfn.generate(model, ids, max_new_tokens=1, do_sample=False, pad_token_id=0, disable_compile=True)

    seconds: dict[str, list[float]] = {path: [] for path in PATHS}
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter  # as best()
    try:
        for path, min_rows in PATHS.items():  # warm-up of both
            set_path(min_rows)
            prefill()
        for _ in range(rounds):
            for path, min_rows in PATHS.items():
                set_path(min_rows)
                start = clock()
                prefill()
                seconds[path].append(clock() - start)
    finally:
        set_path(None)
    print(f"{model_path}: prefill of {length} tokens, {torch.get_num_threads()} threads "
          f"({'thread CPU' if clock is time.thread_time else 'wall'} time), K-quant path {kquant.kquant_isa()}, "
          f"{rounds} interleaved rounds")
    for path, times in seconds.items():
        print(f"  {path:4s}  best {length / min(times):7.1f} tok/s  median {length / sorted(times)[len(times) // 2]:7.1f} "
              f"tok/s  ({', '.join(f'{t:.2f}' for t in times)} s)")
    print(f"  GEMM / row kernels, best: {min(seconds['rows']) / min(seconds['gemm']):.2f}x")


def decode_share(model_path: str, rounds: int) -> None:
    """A decode step's K-quant products as one chain at one row, by format and shape, against the
    compiled step and tensor.sum, interleaved."""
    import optree

    import genfn

    model = genfn.load(model_path, quantize="gguf")
    # The embedding is read one row per token; a tied LM head is the same matrix, kept once.
    params = {name: value for name, value in model.params.items() if name != "embed"}
    chain = optree.tree_leaves(params, is_leaf=lambda leaf: isinstance(leaf, KQuantWeight), namespace=NAMESPACE)
    chain = [w for w in chain if isinstance(w, KQuantWeight)]
    kinds = {}
    for w in chain:
        kinds.setdefault((w.format, w.out_features, w.in_features), []).append(w)
    xs = {w.in_features: torch.randn(1, w.in_features) for w in chain}
    prompt = torch.tensor([[1, 500, 1000, 42, 7, 300]])
    new = 64
    kw = dict(do_sample=False, pad_token_id=0, cache_implementation="static", max_cache_len=64 + new)

    def decode(tokens: int) -> float:
        start = time.perf_counter()
        genfn.generate(model, prompt, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
        return time.perf_counter() - start

    decode(new), decode(1)  # the compile
    big = torch.ones(256 * 2**20 // 4)
    per_kind: dict = {}  # the fastest chain's times, so the kinds add up to it
    step = total = read = float("inf")
    for r in range(rounds):
        this_step = (decode(new) - decode(1)) / (new - 1)
        this_total = float("inf")
        for _ in range(3):
            times = dict.fromkeys(kinds, 0.0)
            for w in chain:
                start = time.perf_counter()
                kernels.linear(xs[w.in_features], w)
                times[(w.format, w.out_features, w.in_features)] += time.perf_counter() - start
            this_total = min(this_total, sum(times.values()))
            if this_total < total:
                total, per_kind = this_total, times
        step, read = min(step, this_step), min(read, best(big.sum, 3))
        print(f"round {r}: step {this_step * 1e3:.2f} ms, chain {this_total * 1e3:.2f} ms", flush=True)
    nbytes = {kind: sum(w.nbytes for w in ws) for kind, ws in kinds.items()}
    all_bytes, sum_rate = sum(nbytes.values()), big.numel() * 4 / read
    print(f"{model_path}: {torch.get_num_threads()} threads, K-quant path {kquant.kquant_isa()}, best of {rounds} "
          f"rounds; tensor.sum {sum_rate / 1e9:.1f} GB/s")
    print(f"  compiled step {step * 1e3:.2f} ms ({1 / step:.1f} tok/s): {all_bytes / sum_rate / step * 100:.0f} % of "
          f"tensor.sum's time for its {all_bytes / 1e6:.0f} MB of K-quant weights")
    print(f"  chain of {len(chain)} products {total * 1e3:.2f} ms ({all_bytes / total / 1e9:.1f} GB/s, "
          f"{total / step * 100:.0f} % of the step)")
    for kind in sorted(kinds, key=lambda k: -per_kind[k]):
        fmt, out_features, in_features = kind
        print(f"  {fmt:8s} {out_features:6d} x {in_features:5d} x{len(kinds[kind]):3d}  {nbytes[kind] / 1e6:6.1f} MB "
              f"({nbytes[kind] / all_bytes * 100:4.1f} %)  {per_kind[kind] * 1e3:6.2f} ms "
              f"({per_kind[kind] / total * 100:4.1f} % of the chain)  {nbytes[kind] / per_kind[kind] / 1e9:5.1f} GB/s")
    for fmt in sorted({kind[0] for kind in kinds}):
        fb = sum(b for kind, b in nbytes.items() if kind[0] == fmt)
        ft = sum(t for kind, t in per_kind.items() if kind[0] == fmt)
        print(f"  {fmt:8s} all: {fb / 1e6:6.1f} MB ({fb / all_bytes * 100:4.1f} %), {ft * 1e3:6.2f} ms "
              f"({ft / total * 100:4.1f} % of the chain), {fb / ft / 1e9:5.1f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--rows", default="1,9", help="comma list of row counts of x")
    parser.add_argument("--isa", choices=("avx2", "avx512"), default=None,
                        help="pin the K-quant kernels' path (default: the best this CPU has)")
    parser.add_argument("--gemm-ab", action="store_true", help="row kernels against the GEMMs")
    parser.add_argument("--shape", default=f"{ROWS}x{COLUMNS}",
                        help="the matrix, OUTxIN (default mode and --gemm-ab; e.g. 512x2048 fits a core's L2)")
    parser.add_argument("--model", help="a GGUF file: its prefill with the row kernels against the GEMM")
    parser.add_argument("--prefill", type=int, default=512, help="prompt length for --model")
    parser.add_argument("--decode-share", action="store_true",
                        help="with --model: a decode step's K-quant products by format and shape, against the step")
    parser.add_argument("--stream", action="store_true", help="Q4_0/Q4_K/Q6_K/IQ4_XS at the 1B shapes, out of cache")
    parser.add_argument("--stream-mb", type=int, default=128, help="megabytes of copies per shape for --stream")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    counts = [int(r) for r in args.rows.split(",")]
    if args.isa:
        kquant.force_isa(args.isa)
    if args.decode_share and not args.model:
        parser.error("--decode-share needs --model")
    if args.decode_share:
        return decode_share(args.model, args.rounds)
    if args.model:
        return prefill_ab(args.model, args.prefill, args.rounds)
    if args.gemm_ab:
        out_features, in_features = (int(v) for v in args.shape.split("x"))
        return gemm_ab(counts, args.rounds, (out_features, in_features))
    if args.stream:
        return stream(counts, args.rounds, args.stream_mb)
    out_features, in_features = (int(v) for v in args.shape.split("x"))
    w = torch.randn(out_features, in_features) * 0.02
    weights = {"q4_0": QuantizedWeight.from_rows(quantize(w, "q4_0")),
               "q8_0": QuantizedWeight.from_rows(quantize(w, "q8_0")),
               **{fmt: quantize_k(w, fmt) for fmt in ("q4_k", "q4_k_r8", "q6_k", "q6_k_r8", "iq4_nl", "iq4_xs")}}
    results: dict[tuple[int, str], float] = {}
    for _ in range(args.rounds):
        for rows in counts:
            x = torch.randn(rows, in_features)
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
