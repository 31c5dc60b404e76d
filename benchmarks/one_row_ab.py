"""One-row products of this tree's decode kernels against a git revision's, in one process, out of cache.

    python benchmarks/one_row_ab.py --baseline main                       # bfloat16, the 1B shape
    python benchmarks/one_row_ab.py --baseline main --dtype float32
    python benchmarks/one_row_ab.py --baseline main --model llama-1b-q8_0.gguf

The revision's decode library is built beside this tree's (``genfn.bench.revision_kernels``, op
namespace ``genfn_kernels_base``). Float: ``decode_linear`` of one row of x over Llama-3.2-1B's
16 layers (q/k/v 3072 x 2048, o 2048 x 2048, gate/up 16384 x 2048, down 2048 x 8192) and a 49152 x
2048 head, random weights of ``--dtype``. ``--model``: ``quant_linear`` of one row over every
Q8_0/Q4_0/Q4_1 matrix of a GGUF file loaded with ``quantize="gguf"``. Each round calls every matrix
in turn with either library and sums a float32 buffer of the same bytes (``tensor.sum``); checks
that both libraries give the same bits; prints GB/s (best and median) and this tree's time over the
revision's per round. This is how the one-row fetch ahead on Intel cores was measured
(docs/measurements/scale-sessions.md, *One row fetched ahead on Intel*).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from genfn.bench.revision_kernels import build_at_revision
from genfn.kernels import decode_linear_available, native
from genfn.quant.weight import QuantizedWeight

SHAPES_1B = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]


def float_calls(dtype: torch.dtype) -> tuple[list, int]:
    """(x, weight) of the 1B shape's layers and head for ``decode_linear``, and their bytes."""
    torch.manual_seed(0)
    weights = [(torch.randn(n, k) * 0.02).to(dtype) for _ in range(16) for n, k in SHAPES_1B]
    weights.append((torch.randn(49152, 2048) * 0.02).to(dtype))
    xs = {k: torch.randn(1, k).to(dtype) for k in (2048, 8192)}
    return [(xs[w.shape[1]], w) for w in weights], sum(w.numel() * w.element_size() for w in weights)


def quant_calls(path: str) -> tuple[list, int]:
    """The arguments of ``quant_linear`` for one row against every block-quantized matrix of the file,
    and their bytes."""
    import genfn

    found: list[QuantizedWeight] = []

    def walk(tree) -> None:
        if isinstance(tree, QuantizedWeight):
            found.append(tree)
        elif isinstance(tree, dict):
            for value in tree.values():
                walk(value)
        elif isinstance(tree, (list, tuple)):
            for value in tree:
                walk(value)

    walk(genfn.load(path, quantize="gguf").params)
    if not found:
        raise SystemExit(f"{path} has no Q8_0/Q4_0/Q4_1 matrices kept as tiles")
    xs = {w.in_features: torch.randn(1, w.in_features) for w in found}
    return ([(xs[w.in_features], w.codes, w.scales, w.mins, w.kind, w.out_features) for w in found],
            sum(w.codes.numel() * w.codes.element_size() + w.scales.numel() * 2 for w in found))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git revision whose decode kernels to compare with")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--model", help="a GGUF file: its block-quantized matrices through quant_linear instead")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not decode_linear_available():
        raise SystemExit("the native decode kernels are not available here")
    torch.ops.load_library(str(build_at_revision(native.DECODE, args.baseline,
                                                 {"genfn_kernels": "genfn_kernels_base"})))
    calls, total = quant_calls(args.model) if args.model else float_calls(getattr(torch, args.dtype))
    op = "quant_linear" if args.model else "decode_linear"
    ops = {"this tree": getattr(torch.ops.genfn_kernels, op), args.baseline: getattr(torch.ops.genfn_kernels_base, op)}
    if not torch.equal(*(fn(*calls[0]) for fn in ops.values())):
        raise SystemExit("the two libraries give different bits")
    buffer = torch.ones(total // 4)
    times = {name: [] for name in [*ops, "tensor.sum"]}
    for _ in range(args.rounds):
        for name, fn in ops.items():
            start = time.perf_counter()
            for arguments in calls:
                fn(*arguments)
            times[name].append(time.perf_counter() - start)
        start = time.perf_counter()
        buffer.sum()
        times["tensor.sum"].append(time.perf_counter() - start)
    what = args.model or f"{args.dtype}, the 1B shape"
    print(f"# one row of x, {what}: {total / 1e9:.2f} GB a pass, {args.threads} threads, {args.rounds} rounds")
    for name, seconds in times.items():
        print(f"{name:12s} best {total / min(seconds) / 1e9:6.2f} GB/s  median {total / statistics.median(seconds) / 1e9:6.2f} GB/s")
    ratios = [a / b for a, b in zip(times["this tree"], times[args.baseline])]
    print(f"this tree / {args.baseline} time per round: " + " ".join(f"{r:.3f}" for r in ratios)
          + f"  median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
