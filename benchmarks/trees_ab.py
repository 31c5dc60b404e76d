"""Decode of one model file by two or more source trees, in fresh processes alternated.

    python benchmarks/trees_ab.py --model llama-1b-q4_k_m.gguf --trees /work/wt/base,/work/main --rounds 4

For a change whose effect lies inside one native call (the layers' stack, a kernel the stack calls),
where an in-process A/B of two op libraries cannot swap it: each round runs every tree once (order
reversed every other round, so a drift of the machine hits both alike) as ``model_bench.py``'s child
process with that tree on ``PYTHONPATH`` and its own kernels (build each tree's first: ``python -m
genfn.kernels build``; the kernel cache keys libraries by their sources, so trees share it). The
child loads the file as ``model_bench.py`` does, warms up and keeps the best of ``--repeats``
decodes of ``--new-tokens`` tokens (a 1-token call's time subtracted), and with ``--prefill N`` the
best prefill of one N-token prompt as well. Prints tok/s and a digest of the decoded tokens per
process, each tree's median and best, and each tree's paired ratios over the first's (decode, and
prefill where timed).
"""

from __future__ import annotations

import argparse
import statistics

from model_bench import run_child


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file or HF directory")
    ap.add_argument("--trees", required=True, help="comma list of source trees; ratios are over the first")
    ap.add_argument("--engine", default="genfn", choices=["genfn", "genfn-compiled"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed decodes per process (the fastest counts)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=0, help="also time the prefill of a prompt this long (0: none)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per process")
    args = ap.parse_args()
    trees = args.trees.split(",")
    if len(trees) < 2:
        raise SystemExit("--trees: give at least two source trees")
    args.batches = [args.batch]
    phases = ["decode"] + (["prefill"] if args.prefill else [])
    rates: dict[str, dict[str, list[float]]] = {p: {t: [] for t in trees} for p in phases}
    for r in range(args.rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            result = run_child(args, args.model, args.engine, tree=tree)
            if "error" in result:
                raise SystemExit(f"{tree}: {result['error']}")
            rates["decode"][tree].append(result["decode_tok_s"][args.batch])
            prefill = ""
            if args.prefill:
                rates["prefill"][tree].append(result["prefill_tok_s"])
                prefill = f"  pp{args.prefill} {result['prefill_tok_s']:.1f} tok/s"
            print(f"{tree} {result['decode_tok_s'][args.batch]:.1f} tok/s tokens {result['tokens_digest'][args.batch]}"
                  f"{prefill}", flush=True)
    for phase in phases:
        for tree in trees:
            print(f"{phase} {tree} median {statistics.median(rates[phase][tree]):.1f} "
                  f"best {max(rates[phase][tree]):.1f}")
        for tree in trees[1:]:
            print(f"{phase} paired {tree} / {trees[0]}:",
                  " ".join(f"{a / b:.3f}" for a, b in zip(rates[phase][tree], rates[phase][trees[0]])))


if __name__ == "__main__":
    main()
