"""Batch-1 greedy decode of one GGUF file by two or more source trees, in fresh processes alternated.

    python benchmarks/trees_ab.py --model llama-1b-q4_k_m.gguf --trees /work/wt/base,/work/main --rounds 4

For a change whose effect lies inside one native call (the layers' stack, a kernel the stack calls),
where an in-process A/B of two op libraries cannot swap it: each round runs every tree once (order
reversed every other round, so a drift of the machine hits both alike) as a new process with that
tree on ``PYTHONPATH`` and its own kernels (build each tree's first: ``python -m genfn.kernels
build``; the kernel cache keys libraries by their sources, so trees share it). A process loads the
file with ``quantize="gguf"``, warms up, and keeps the best of three 64-token decodes
((65-token call - 1-token call) / 64, eager). Prints tok/s and a hash of the tokens per process,
each tree's median and best, and each tree's paired ratios over the first's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

CHILD = r'''
import sys, time, torch, genfn
torch.set_num_threads(int(sys.argv[2]))
model = genfn.load(sys.argv[1], quantize="gguf")
ids = torch.tensor([model.tokenizer.encode("The history of the Roman Empire is long and")])
genfn.generate(model, ids, max_new_tokens=8, do_sample=False)
best = 0.0
for _ in range(3):
    t = time.perf_counter(); genfn.generate(model, ids, max_new_tokens=1, do_sample=False); one = time.perf_counter() - t
    t = time.perf_counter(); out = genfn.generate(model, ids, max_new_tokens=65, do_sample=False); many = time.perf_counter() - t
    best = max(best, 64 / (many - one))
print(best, hash(tuple(out[0].tolist())))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--trees", required=True, help="comma list of source trees; ratios are over the first")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    args = ap.parse_args()
    trees = args.trees.split(",")
    if len(trees) < 2:
        raise SystemExit("--trees: give at least two source trees")
    rates: dict[str, list[float]] = {t: [] for t in trees}
    for r in range(args.rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            done = subprocess.run([sys.executable, "-c", CHILD, args.model, str(args.threads)],
                                  env=dict(os.environ, PYTHONPATH=tree), capture_output=True, text=True,
                                  timeout=args.timeout)
            if done.returncode != 0:
                raise SystemExit(f"{tree}: {done.stderr[-2000:]}")
            rate, tokens = done.stdout.split()
            rates[tree].append(float(rate))
            print(f"{tree} {float(rate):.1f} tok/s tokens {tokens}", flush=True)
    for tree in trees:
        print(f"{tree} median {statistics.median(rates[tree]):.1f} best {max(rates[tree]):.1f}")
    for tree in trees[1:]:
        print(f"paired {tree} / {trees[0]}:", " ".join(f"{a / b:.3f}" for a, b in zip(rates[tree], rates[trees[0]])))


if __name__ == "__main__":
    main()
