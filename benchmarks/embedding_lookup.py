"""What one token's embedding lookup costs in a model's own table, eagerly and compiled.

    python benchmarks/embedding_lookup.py --model /work/models-tmp/llama-1b-q4_0.gguf

Loads the file with ``quantize="gguf"`` (a tied Q6_K table becomes the head's interleaved
``q6_k_r8`` groups) and times ``genfn.kernels.embedding`` of one token, a different one each call,
eagerly and under ``torch.compile`` (what a compiled decode step runs for it), best of ``--rounds``
rounds of ``--calls`` calls. Run it with another tree on ``PYTHONPATH`` to compare two versions.
"""

from __future__ import annotations

import argparse
import time

import torch

import genfn
from genfn import kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(2)
    table = genfn.load(args.model, quantize="gguf").params["embed"]
    vocab = table.shape[0]
    tokens = [torch.tensor([[i * 7919 % vocab]]) for i in range(args.calls)]

    def lookup(t):
        return kernels.embedding(t, table, torch.float32)

    kind = getattr(table, "format", None) or getattr(table, "kind", None) or table.dtype
    print(f"{args.model}: table {type(table).__name__} {kind} {tuple(table.shape)}")
    for name, fn in (("eager", lookup), ("compiled", torch.compile(lookup, fullgraph=True))):
        for t in tokens[:10]:
            fn(t)
        best = float("inf")
        for _ in range(args.rounds):
            start = time.perf_counter()
            for t in tokens:
                fn(t)
            best = min(best, (time.perf_counter() - start) / len(tokens))
        print(f"  {name:8s} {best * 1e6:7.1f} us a token (best of {args.rounds} rounds of {args.calls} calls)")


if __name__ == "__main__":
    main()
