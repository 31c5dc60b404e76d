"""A GGUF model's batch-1 greedy decode on this tree against a git revision's, fresh processes alternated.

    python benchmarks/tree_decode_ab.py --baseline HEAD~1 --model llama-1b-iq4_xs.gguf [--rounds 3] [--compiled]

``kquant_linear_ab.py --model`` swaps only the K-quant library under one loaded model, so it cannot
compare changes to what the loader makes of a file (a new interleaved format, another layout). Here
each round loads the file with ``quantize="gguf"`` in a fresh process of each tree (the revision
exported to a temporary directory with ``git archive``; its native kernels built on first use into
the shared cache), the order flipping every round, and times ``--new-tokens`` greedy tokens of a
fixed 16-token prompt (static cache, eager unless ``--compiled``; ``min_new_tokens`` so that an end-of-text
token does not cut a decode short), the prefill subtracted: tok/s is
(time(1 + n tokens) - time(1 token)) / n, best of 3 calls. Prints each round's tok/s, the formats
the loader chose for the layers, whether both trees decoded the same tokens, and ``tensor.sum``'s
read rate after each decode (``genfn.bench.decode.read_bandwidth_gbs``; the memory's speed moves
between minutes on a VM).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 900

_CHILD = r"""
import json, sys, time, torch, genfn
model = genfn.load(sys.argv[1], quantize="gguf")
n, compiled = int(sys.argv[2]), sys.argv[3] == "1"
formats = sorted({v.format for layer in model.params["layers"] for v in layer.values() if hasattr(v, "format")})
ids = torch.tensor([[1, 450, 3681, 310, 278, 5917, 13378, 338, 1472, 322, 12092, 29889, 739, 4689, 746, 278]])
def timed(tokens):
    start = time.perf_counter()
    out = genfn.generate(model, ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                         cache_implementation="static", max_cache_len=ids.shape[1] + n + 8, disable_compile=not compiled)
    assert out.shape[1] == ids.shape[1] + tokens, out.shape  # every token timed was decoded
    return time.perf_counter() - start, out
timed(4), timed(4)
best, out = float("inf"), None
for _ in range(3):
    one, _ = timed(1)
    many, out = timed(1 + n)
    best = min(best, (many - one) / n)
from genfn.bench.decode import read_bandwidth_gbs
read_gb_s = read_bandwidth_gbs()[0]  # tensor.sum's
print(json.dumps({"tok_s": 1 / best, "formats": formats, "tokens": out[0].tolist(), "read_gb_s": read_gb_s}))
"""


def decode(tree: Path, model: str, new_tokens: int, compiled: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", _CHILD, model, str(new_tokens), "1" if compiled else "0"], env=env,
                          cwd=tree, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"the decode in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="git revision to compare this tree with")
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--compiled", action="store_true", help="the compiled decode step (default: eager)")
    args = parser.parse_args()
    if args.rounds < 1 or args.new_tokens < 1:
        parser.error("--rounds and --new-tokens must be positive")
    with tempfile.TemporaryDirectory(prefix="genfn-baseline-") as scratch:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", scratch], input=archive.stdout, check=True)
        trees = {"this tree": ROOT, args.baseline: Path(scratch)}
        print(f"# {args.model}, batch 1, {'compiled' if args.compiled else 'eager'}, {args.new_tokens} tokens, "
              f"{args.rounds} rounds", flush=True)
        ratios = []
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            results = {name: decode(trees[name], args.model, args.new_tokens, args.compiled) for name in order}
            ours, theirs = results["this tree"], results[args.baseline]
            ratios.append(ours["tok_s"] / theirs["tok_s"])
            print(f"round {r}: this tree {ours['tok_s']:.1f} tok/s {ours['formats']}, {args.baseline} "
                  f"{theirs['tok_s']:.1f} tok/s {theirs['formats']}: {ratios[-1]:.2f}x; same tokens: "
                  f"{ours['tokens'] == theirs['tokens']}; tensor.sum {ours['read_gb_s']:.1f} / "
                  f"{theirs['read_gb_s']:.1f} GB/s", flush=True)
        print(f"this tree / {args.baseline}: {min(ratios):.2f}-{max(ratios):.2f}x", flush=True)


if __name__ == "__main__":
    main()
