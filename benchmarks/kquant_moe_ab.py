"""The K-quant mixture-of-experts decode kernel (``kquant_moe_decode``) of this tree against a git
revision's, in one process: one token through a Qwen3-MoE-like MLP (``--experts`` experts of hidden
2048 and expert width 768, ``--top-k`` chosen per token from a fixed list of 64 random choices), in
Q4_K and Q6_K, the two libraries interleaved round by round. The experts (~170-250 MB) lie past
the caches, as a decode step reads them. Checks that both give the same bits, then prints the
median microseconds per token of each and this tree's time over the revision's.

    python benchmarks/kquant_moe_ab.py --baseline HEAD [--experts 96 --top-k 8 --rounds 7]
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

HIDDEN, INTER = 2048, 768


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="git revision whose K-quant kernels to compare with")
    parser.add_argument("--experts", type=int, default=96)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not kquant.kquant_available():
        raise SystemExit(f"the K-quant kernels are not available: {kquant.kquant_status()}")
    torch.set_num_threads(args.threads)
    torch.ops.load_library(str(build_at_revision(
        native.KQUANT, args.baseline, {"genfn_kquant": "genfn_kquant_base", "genfn::kquant": "genfn::kquant_base"})))
    ops = {args.baseline: torch.ops.genfn_kquant_base.kquant_moe_decode, "this tree": torch.ops.genfn_kquant.kquant_moe_decode}
    E, k = args.experts, args.top_k
    torch.manual_seed(0)
    print(f"K-quant path {kquant.kquant_isa()}, {args.threads} thread(s), {E} experts, top {k}, "
          f"{args.rounds} interleaved rounds; median us per token")
    for fmt in ("q4_k", "q6_k"):
        gate_up = torch.stack([quantize_k(torch.randn(2 * INTER, HIDDEN) * 0.02, fmt).data.view(2 * INTER, -1)
                               for _ in range(E)])
        down = torch.stack([quantize_k(torch.randn(HIDDEN, INTER) * 0.02, fmt).data.view(HIDDEN, -1) for _ in range(E)])
        f = FORMAT_ID[fmt]
        x = torch.randn(1, HIDDEN)
        choices = [torch.randperm(E)[:k].view(1, k) for _ in range(64)]
        weights = torch.softmax(torch.randn(1, k), -1)
        base, new = (op(x, choices[0], weights, gate_up, f, down, f)[0] for op in ops.values())
        if not torch.equal(base, new):
            raise SystemExit(f"{fmt}: the kernels' bits differ")
        seconds = {key: [] for key in ops}
        for _ in range(args.rounds):
            for key, op in ops.items():
                start = time.perf_counter()
                for chosen in choices:
                    op(x, chosen, weights, gate_up, f, down, f)
                seconds[key].append((time.perf_counter() - start) / len(choices))
        cells = "  ".join(f"{key} {statistics.median(s) * 1e6:7.1f}" for key, s in seconds.items())
        ratio = statistics.median(seconds["this tree"]) / statistics.median(seconds[args.baseline])
        print(f"{fmt}: {cells}  ratio {ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
