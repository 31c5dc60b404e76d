"""What pieces of the eager decode step cost, each switched off and on in one process.

    python benchmarks/eager_parts_ab.py                       # SmolLM2 Q4_1 (its tied head's tiles)
    python benchmarks/eager_parts_ab.py --model /work/models-tmp/llama-1b-q4_k_m.gguf --rounds 6

Runs ``genfn.generate`` eagerly (``disable_compile=True``, static cache, greedy, ``--new-tokens``)
with each combination of two pieces of the eager path in turn, rounds alternating in order, so a
drift of the machine hits every variant alike:

- ``stack table``: the run's params carry the native stack's table of weights built once
  (``genfn.models.registry.step_params``); off, every step walks the layers' weights and builds one;
- ``native lookup``: a tied head's Q8_0/Q4_0/Q4_1 tiles looked up in one native pass
  (``genfn.kernels.embedding``'s ``tiles_lookup``); off, ``QuantizedWeight.lookup``'s torch ops.

Prints ms per token for each variant (median of the rounds) and the time it saves against both
off (median of the paired rounds). The variants' tokens must agree; a mismatch is an error.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import genfn  # noqa: E402
from genfn import kernels  # noqa: E402
from genfn.models import registry  # noqa: E402
from genfn.quant.weight import QuantizedWeight  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from genfn.default_model import default_model_path

    model = genfn.load(args.model or default_model_path(), quantize="gguf")
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    settings = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                    cache_implementation="static", disable_compile=True)
    native_embedding, native_step_params = kernels.embedding, registry.step_params

    def torch_embedding(tokens, table, dtype):
        if isinstance(table, QuantizedWeight):
            return table.lookup(tokens).to(dtype)
        return native_embedding(tokens, table, dtype)

    def plain_params(spec, params):
        return params

    variants = {"both off": (torch_embedding, plain_params), "stack table": (torch_embedding, native_step_params),
                "native lookup": (native_embedding, plain_params), "both": (native_embedding, native_step_params)}
    times = {name: [] for name in variants}
    tokens = {}
    try:
        for r in range(args.rounds):
            for name in variants if r % 2 == 0 else list(variants)[::-1]:
                kernels.embedding, registry.step_params = variants[name]
                genfn.generate(model, ids, **dict(settings, max_new_tokens=4, min_new_tokens=4))
                start = time.perf_counter()
                out = genfn.generate(model, ids, **settings)
                times[name].append((time.perf_counter() - start) / args.new_tokens * 1e3)
                tokens.setdefault(name, out.tolist())
                if tokens[name] != tokens["both off" if "both off" in tokens else name]:
                    raise SystemExit(f"{name}: its tokens differ from the variant with both pieces off")
    finally:
        kernels.embedding, registry.step_params = native_embedding, native_step_params
    base = times["both off"]
    print(f"load average {os.getloadavg()[0]:.2f}, {args.rounds} rounds of {args.new_tokens} tokens")
    for name, values in times.items():
        saved = statistics.median((b - v) * 1e3 for b, v in zip(base, values))
        print(f"{name:14s} {statistics.median(values):.3f} ms/token   saves {saved:.0f} us a token (paired median)")


if __name__ == "__main__":
    main()
