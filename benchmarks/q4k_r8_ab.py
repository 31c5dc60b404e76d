"""A GGUF file's layers with Q4_K interleaved 8 rows to a group (``q4_k_r8``, the default) against
the file's own rows (``GENFN_Q4K_R8=0``), both loaded in one process, greedy decodes alternating
(each first in every other round), so a loaded machine's noise falls on both alike.

    python benchmarks/q4k_r8_ab.py /work/models-tmp/llama-1b-q4_k_m.gguf --new-tokens 32 --rounds 6 [--threads 1] [--compiled]

Eager decodes keep a dynamic cache (the op-by-op layer, the K-quant op's row path); ``--compiled``
runs the compiled static-cache step (the fused layer). Prints tok/s per round and the medians,
and whether both chose the same tokens.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import genfn


def load(path: str, interleaved: bool):
    before = os.environ.get("GENFN_Q4K_R8")
    os.environ["GENFN_Q4K_R8"] = "1" if interleaved else "0"
    try:
        return genfn.load(path, quantize="gguf")
    finally:  # the caller's setting back as it was
        if before is None:
            os.environ.pop("GENFN_Q4K_R8")
        else:
            os.environ["GENFN_Q4K_R8"] = before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compiled", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = {"q4_k_r8": load(args.model, True), "q4_k": load(args.model, False)}
    prompt = torch.tensor([[1, 500, 1000, 42, 7, 300]])
    n = args.new_tokens
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    kw.update(cache_implementation="static", max_cache_len=64 + n) if args.compiled else kw.update(disable_compile=True)
    tokens, rates = {}, {name: [] for name in models}
    for name, model in models.items():  # warm-up (and the compile)
        tokens[name] = genfn.generate(model, prompt, **kw)
    for r in range(args.rounds):
        for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
            start = time.perf_counter()
            genfn.generate(models[name], prompt, **kw)
            rates[name].append(n / (time.perf_counter() - start))
        print(f"round {r}: " + "  ".join(f"{k} {v[-1]:.2f} tok/s" for k, v in rates.items()), flush=True)
    medians = {k: sorted(v)[len(v) // 2] for k, v in rates.items()}
    print(f"{args.model}: {'compiled' if args.compiled else 'eager'}, {args.threads} threads, {n} tokens, "
          f"load avg {os.getloadavg()[0]:.1f}; medians " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items())
          + f" tok/s; best " + ", ".join(f"{k} {max(v):.2f}" for k, v in rates.items())
          + f"; r8 / stored median {medians['q4_k_r8'] / medians['q4_k']:.2f}x; same tokens: "
          f"{torch.equal(tokens['q4_k_r8'], tokens['q4_k'])}")


if __name__ == "__main__":
    main()
