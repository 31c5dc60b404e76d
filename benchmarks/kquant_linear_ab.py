"""The K-quant row kernels (``kquant_linear``) of this tree against those of a git revision, in one
process, at Llama-3.2-1B's linear shapes with the weights out of cache.

The revision's K-quant library (its sources and headers as the revision had them) is built
(``genfn.bench.revision_kernels``) into a separate library with its op namespace renamed
(``genfn_kquant_base``), so both run side by side, interleaved call set by call set. Each shape
(q/o 2048 x 2048, k/v 512 x 2048, gate/up 8192 x 2048, down 2048 x 8192) is held as copies of one
random matrix, ``--megabytes`` of them, called in turn so that every call reads its weight from
memory as a decode step does. Checks that both give the same bits (``--allow-diff``: only report
the largest relative difference), then prints GB/s (weight bytes / time) of the best and the median
of ``--rounds`` rounds per format, shape and row count, and this tree's time over the revision's.

    python benchmarks/kquant_linear_ab.py --baseline main [--rows 1,2,4,8] [--formats q4_k,q6_k]
    python benchmarks/kquant_linear_ab.py --baseline main --threads 1 --megabytes 4   # in cache
    python benchmarks/kquant_linear_ab.py --baseline main --model llama-1b-q4_k_m.gguf --new-tokens 32

``--model``: a GGUF file loaded once with ``quantize="gguf"``, its batch-1 greedy decode (eager,
``--new-tokens`` tokens after a 16-token prompt) with every K-quant product on one library or the
other, alternating round by round (each first in every other round): tok/s per round, and whether both decoded the same tokens.

``--moe``: the mixture-of-experts decode kernel (``kquant_moe_decode``) instead, one token through
a Qwen3-MoE-like MLP (``--experts`` experts of hidden 2048 and width 768, ``--top-k`` chosen from a
fixed list of 64 random choices) in Q4_K and Q6_K, the experts (~170-250 MB) past the caches:
microseconds per token (median of ``--rounds``) and this tree's time over the revision's.

    python benchmarks/kquant_linear_ab.py --baseline main --moe [--experts 96 --top-k 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from genfn.bench.revision_kernels import build_at_revision
from genfn.kernels import kquant, native
from genfn.quant import quantize_k
from genfn.quant.kquants import FORMAT_ID
from genfn.state.base import tree_map
from kquant_kernels import SHAPES_1B as SHAPES  # this folder's: Llama-3.2-1B's linear shapes

def decode_ab(path: str, ops: dict, new_tokens: int, rounds: int) -> None:
    """One model's decode with the K-quant products on each library in turn (both in this process)."""
    import genfn

    model = genfn.load(path, quantize="gguf")
    prompt = torch.randint(100, model.spec.vocab_size - 100, (1, 16), generator=torch.Generator().manual_seed(0))

    def decode(op, tokens: int) -> torch.Tensor:
        kquant.kquant_linear = lambda x, weight, *, row_kernels=False: op(
            x, weight.data, FORMAT_ID[weight.format], weight.out_features, row_kernels)
        with torch.no_grad():
            return genfn.generate(model, prompt, max_new_tokens=tokens, do_sample=False, pad_token_id=0)

    native = kquant.kquant_linear
    seconds: dict[str, list[float]] = {key: [] for key in ops}
    try:
        outputs = {key: decode(op, new_tokens) for key, op in ops.items()}  # warm-up, and the tokens
        for round_ in range(rounds):
            # Each library first in every other round, so that a load that comes and goes in step
            # with the rounds hits both alike.
            for key, op in list(ops.items())[::1 if round_ % 2 == 0 else -1]:
                start = time.perf_counter()
                decode(op, new_tokens + 1)
                middle = time.perf_counter()
                decode(op, 1)  # the prompt's prefill and first token, taken off
                seconds[key].append(2 * middle - start - time.perf_counter())
    finally:
        kquant.kquant_linear = native
    same = all(torch.equal(out, next(iter(outputs.values()))) for out in outputs.values())
    print(f"{path}: batch-1 greedy decode, {new_tokens} tokens, {torch.get_num_threads()} threads, {rounds} "
          f"alternating rounds; same tokens: {same}")
    for key, times in seconds.items():
        rates = [new_tokens / t for t in times]
        print(f"  {key:10s} best {max(rates):6.1f} tok/s  median {statistics.median(rates):6.1f} tok/s  "
              f"({', '.join(f'{r:.1f}' for r in rates)})")
    keys = list(ops)
    print(f"  median time {keys[1]} / {keys[0]}: "
          f"{statistics.median(seconds[keys[1]]) / statistics.median(seconds[keys[0]]):.2f}")


def moe_ab(ops: dict, num_experts: int, top_k: int, rounds: int) -> None:
    """The K-quant mixture-of-experts decode of each library, interleaved, on the same experts."""
    hidden, inter = 2048, 768
    print(f"K-quant path {kquant.kquant_isa()}, {torch.get_num_threads()} thread(s), {num_experts} experts, "
          f"top {top_k}, {rounds} interleaved rounds; median us per token")
    for fmt in ("q4_k", "q6_k"):
        torch.manual_seed(0)
        gate_up = torch.stack([quantize_k(torch.randn(2 * inter, hidden) * 0.02, fmt).data.view(2 * inter, -1)
                               for _ in range(num_experts)])
        down = torch.stack([quantize_k(torch.randn(hidden, inter) * 0.02, fmt).data.view(hidden, -1)
                            for _ in range(num_experts)])
        f = FORMAT_ID[fmt]
        x = torch.randn(1, hidden)
        choices = [torch.randperm(num_experts)[:top_k].view(1, top_k) for _ in range(64)]
        weights = torch.softmax(torch.randn(1, top_k), -1)
        base, new = (op(x, choices[0], weights, gate_up, f, down, f)[0] for op in ops.values())
        if not torch.equal(base, new):
            raise SystemExit(f"{fmt}: the kernels' bits differ")
        seconds: dict[str, list[float]] = {key: [] for key in ops}
        for _ in range(rounds):
            for key, op in ops.items():
                start = time.perf_counter()
                for chosen in choices:
                    op(x, chosen, weights, gate_up, f, down, f)
                seconds[key].append((time.perf_counter() - start) / len(choices))
        cells = "  ".join(f"{key} {statistics.median(s) * 1e6:7.1f}" for key, s in seconds.items())
        keys = list(ops)
        ratio = statistics.median(seconds[keys[1]]) / statistics.median(seconds[keys[0]])
        print(f"{fmt}: {cells}  ratio {ratio:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="git revision whose K-quant kernels to compare with")
    parser.add_argument("--rows", default="1,2,4,8", help="comma list of row counts of x")
    parser.add_argument("--formats", default="q4_k,q6_k")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--megabytes", type=int, default=96, help="copies of each matrix, in MB (default: past L3)")
    parser.add_argument("--model", help="a GGUF file: its batch-1 decode on each library, alternating")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per round with --model")
    parser.add_argument("--allow-diff", action="store_true", help="report, rather than refuse, differing bits")
    parser.add_argument("--moe", action="store_true", help="the mixture-of-experts decode kernel instead")
    parser.add_argument("--experts", type=int, default=96, help="experts with --moe")
    parser.add_argument("--top-k", type=int, default=8, help="experts chosen per token with --moe")
    args = parser.parse_args()
    if not kquant.kquant_available():
        raise SystemExit(f"the K-quant kernels are not available: {kquant.kquant_status()}")
    torch.set_num_threads(args.threads)
    torch.ops.load_library(str(build_at_revision(
        native.KQUANT, args.baseline, {"genfn_kquant": "genfn_kquant_base", "genfn::kquant": "genfn::kquant_base"})))
    if args.moe:
        return moe_ab({args.baseline: torch.ops.genfn_kquant_base.kquant_moe_decode,
                       "this tree": torch.ops.genfn_kquant.kquant_moe_decode}, args.experts, args.top_k, args.rounds)
    ops = {args.baseline: torch.ops.genfn_kquant_base.kquant_linear, "this tree": torch.ops.genfn_kquant.kquant_linear}
    if args.model:
        return decode_ab(args.model, ops, args.new_tokens, args.rounds)
    counts = [int(r) for r in args.rows.split(",")]
    formats = args.formats.split(",")
    print(f"K-quant path {kquant.kquant_isa()}, {args.threads} thread(s), {args.megabytes} MB of copies per shape, "
          f"{args.rounds} interleaved rounds; GB/s best / median, time ratio this tree / {args.baseline} (median)")
    for fmt in formats:
        for name, n, k in SHAPES:
            torch.manual_seed(0)
            one = quantize_k(torch.randn(n, k) * 0.02, fmt)
            copies = [one] + [tree_map(torch.clone, one) for _ in range(max(1, args.megabytes * 2**20 // one.nbytes) - 1)]
            for rows in counts:
                x = torch.randn(rows, k)
                base, new = (op(x, one.data, FORMAT_ID[fmt], n, False) for op in ops.values())
                if not torch.equal(base, new):
                    diff = ((base - new).abs().max() / base.abs().max()).item()
                    if not args.allow_diff:
                        raise SystemExit(f"{fmt} {name} rows {rows}: the kernels' bits differ (max {diff:.2e} of max)")
                    print(f"  {fmt} {name} rows {rows}: bits differ, max |diff| {diff:.2e} of max |y|")
                seconds = {key: [] for key in ops}
                for _ in range(args.rounds):  # interleaved, so that the machine's load hits each alike
                    for key, op in ops.items():
                        op(x, copies[-1].data, FORMAT_ID[fmt], n, False)
                        start = time.perf_counter()
                        for w in copies:
                            op(x, w.data, FORMAT_ID[fmt], n, False)
                        seconds[key].append((time.perf_counter() - start) / len(copies))
                cells = "  ".join(f"{key} {one.nbytes / min(s) / 1e9:6.2f} / {one.nbytes / statistics.median(s) / 1e9:6.2f}"
                                  for key, s in seconds.items())
                ratio = statistics.median(seconds["this tree"]) / statistics.median(seconds[args.baseline])
                print(f"{fmt} {name:8s} rows {rows}: {cells}  ratio {ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
