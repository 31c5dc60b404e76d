"""What the batch-invariant mode (``genfn.deterministic``) costs: throughput against the default mode.

Two workloads on SmolLM2-135M-Instruct (the default model), each run in both modes, interleaved
round by round in one process so that the machine's load hits both alike:

- ``generate batch 1``: ``--prompts`` prompts one at a time, ``--new-tokens`` greedy tokens each
  (eager; ``GenerationConfig(batch_invariant=True)`` for the mode);
- ``continuous 32``: ``--requests`` requests through ``generate_batch``
  (``ContinuousBatchingConfig(batch_invariant=True)`` for the mode).

Reports tokens/s of each mode (the best of ``--rounds`` rounds) and the mode's slowdown
(default throughput / mode throughput; the issue's goal is <= 1.15x), and checks that the mode's
tokens are the same in every round.

    python benchmarks/determinism.py [--dtype float32|bfloat16] [--quantize gguf] [--rounds 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import genfn
from genfn.batching import generate_batch
from genfn.config import ContinuousBatchingConfig, GenerationConfig
from genfn.default_model import default_model_path

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "Explain photosynthesis to a child.",
           "List three prime numbers and say why they are prime.", "What is the boiling point of water?",
           "Give me a short recipe for pancakes.", "Translate 'good morning' into Spanish.",
           "Summarize the plot of Hamlet in two sentences."]


def _ids(model, count: int) -> list[list[int]]:
    texts = [PROMPTS[i % len(PROMPTS)] + (f" ({i})" if i >= len(PROMPTS) else "") for i in range(count)]
    return [torch.as_tensor(model.tokenizer(t)["input_ids"]).reshape(-1).tolist() for t in texts]


def _generate_alone(model, prompts, new_tokens: int, invariant: bool):
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              batch_invariant=invariant, disable_compile=True)
    tokens, outputs = 0, []
    for ids in prompts:
        out = genfn.generate(model, torch.tensor([ids]), generation_config=config)
        outputs.append(out[0, len(ids):].tolist())
        tokens += out.shape[1] - len(ids)
    return tokens, outputs


def _continuous(model, prompts, new_tokens: int, invariant: bool):
    cb = ContinuousBatchingConfig(max_requests_per_batch=len(prompts), batch_invariant=invariant)
    results = generate_batch(model, prompts, continuous_batching_config=cb, max_new_tokens=new_tokens,
                             do_sample=False)
    outputs = [list(r.generated_tokens) for r in results.values()]
    return sum(len(o) for o in outputs), outputs


WORKLOADS = {"generate batch 1": _generate_alone, "continuous": _continuous}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantize", default=None, choices=[None, "gguf"], help="keep the file's Q4_1 blocks")
    parser.add_argument("--prompts", type=int, default=4, help="prompts of the batch-1 workload")
    parser.add_argument("--requests", type=int, default=32, help="requests of the continuous-batching workload")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = genfn.load(default_model_path(), dtype=getattr(torch, args.dtype), quantize=args.quantize)
    sizes = {"generate batch 1": args.prompts, "continuous": args.requests}
    best: dict[tuple[str, bool], float] = {}
    first: dict[tuple[str, bool], list] = {}
    stable = True
    for _ in range(args.rounds):
        for name, run in WORKLOADS.items():
            prompts = _ids(model, sizes[name])
            for invariant in (False, True):
                start = time.perf_counter()
                tokens, outputs = run(model, prompts, args.new_tokens, invariant)
                rate = tokens / (time.perf_counter() - start)
                key = (name, invariant)
                best[key] = max(best.get(key, 0.0), rate)
                if invariant:
                    stable &= first.setdefault(key, outputs) == outputs
    rows = [{"workload": f"{name} ({sizes[name]})", "default tok/s": round(best[(name, False)], 2),
             "batch-invariant tok/s": round(best[(name, True)], 2),
             "slowdown": round(best[(name, False)] / best[(name, True)], 3)} for name in WORKLOADS]
    result = {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "quantize": args.quantize,
              "threads": torch.get_num_threads(), "new_tokens": args.new_tokens, "rounds": args.rounds,
              "mode_tokens_same_every_round": stable, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"SmolLM2-135M-Instruct {args.dtype}{' Q4_1 blocks' if args.quantize else ''}, "
          f"{torch.get_num_threads()} threads, {args.new_tokens} new tokens, best of {args.rounds} rounds")
    for row in rows:
        print(f"  {row['workload']:<22} default {row['default tok/s']:8.2f} tok/s   batch-invariant "
              f"{row['batch-invariant tok/s']:8.2f} tok/s   slowdown {row['slowdown']:.3f}x")
    print(f"  the mode's tokens were the same in every round: {stable}")


if __name__ == "__main__":
    main()
