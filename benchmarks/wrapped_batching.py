"""Continuous batching of a wrapped module (``genfn.from_module``): tokens/s of ``generate_batch``.

    python benchmarks/wrapped_batching.py                          # GPT-2 and Llama, 8 x 64 tokens
    python benchmarks/wrapped_batching.py --archs gpt2 --requests 4 --new-tokens 16      # quick
    PYTHONPATH=/path/to/other/checkout GENFN_BENCH_RESULTS=$PWD/benchmarks/results \\
        python benchmarks/wrapped_batching.py --tag before          # another genfn, same workload

A tiny random transformers GPT-2 (learned positions) and Llama (RoPE), wrapped by
``genfn.from_module``; ``--requests`` greedy requests (8) of 16..48 prompt tokens (seeded), each
decoding exactly ``--new-tokens`` (64: ``min_new_tokens = max_new_tokens``). Engines:

    cb              ``model.generate_batch``: the manager over the wrapped module's continuous-batching
                    cache (``genfn.models.module_packed``), warmed up on 2 tokens a request
    cb-rows-together  the same with the module's per-row mask turned off (``ModuleSpec.row_mask``
                    None): rows run together only where they sit at the same positions, as a module
                    without a per-row mask must (the measure of batching a decode step across
                    positions in one call); only where ``ModuleSpec`` has ``row_mask``
    generate        ``genfn.generate`` on each request alone, one after the other

Prints tokens/s (generated tokens / wall time) and each request's tokens' agreement with
``generate``'s, and writes them as JSON under ``benchmarks/results/`` (``--tag`` names the file).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

import torch

import genfn
from genfn.bench.results import write_results
from genfn.config.batching import ContinuousBatchingConfig


def wrapped_model(arch: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    if arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=1000, n_embd=128, n_layer=4, n_head=4, n_positions=256,
                                         bos_token_id=1, eos_token_id=2)
        module = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
        module = transformers.LlamaForCausalLM(config)
    return genfn.from_module(module.eval())


def rows_together(model):
    """``model`` with its module's per-row mask off (None when the spec has no such field)."""
    from genfn.models.model import Model

    if not hasattr(model.spec, "row_mask"):
        return None
    return Model(dataclasses.replace(model.spec, row_mask=None), model.params, model.apply_fn, model.init_cache_fn,
                 generation_config=model.generation_config)


def prompts_for(count: int, seed: int = 1):
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randint(16, 48))] for _ in range(count)]


def run_cb(model, prompts, new_tokens):
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=128,
                                  max_requests_per_batch=len(prompts))
    settings = dict(do_sample=False, continuous_batching_config=cb)
    model.generate_batch(prompts, max_new_tokens=2, min_new_tokens=2, **settings)  # warm-up
    start = time.perf_counter()
    results = model.generate_batch(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **settings)
    wall = time.perf_counter() - start
    return wall, [out.generated_tokens for out in results.values()]


def run_generate(model, prompts, new_tokens):
    start = time.perf_counter()
    tokens = [genfn.generate(model, torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False)[0, len(p):].tolist() for p in prompts]
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--tag", default=None, help="names the results file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = prompts_for(args.requests)
    print(f"genfn from {genfn.__file__}; {args.requests} requests x {args.new_tokens} new tokens, "
          f"{args.threads} thread(s)")
    rows = []
    for arch in args.archs:
        model = wrapped_model(arch)
        generate_wall, reference = run_generate(model, prompts, args.new_tokens)
        first = len(rows)
        for name, engine_model in (("cb", model), ("cb-rows-together", rows_together(model))):
            if engine_model is None:
                continue
            wall, tokens = run_cb(engine_model, prompts, args.new_tokens)
            rows.append({"arch": arch, "engine": name, "wall_s": wall, "tokens_per_s": sum(map(len, tokens)) / wall,
                         "equal_to_generate": sum(t == r for t, r in zip(tokens, reference))})
        rows.append({"arch": arch, "engine": "generate", "wall_s": generate_wall,
                     "tokens_per_s": args.requests * args.new_tokens / generate_wall,
                     "equal_to_generate": args.requests})
        for row in rows[first:]:
            print(f"{arch:6s} {row['engine']:17s} {row['tokens_per_s']:9.1f} tokens/s  wall {row['wall_s']:7.2f} s  "
                  f"equal to generate: {row['equal_to_generate']}/{args.requests}")
    out = write_results("wrapped-batching", {"genfn": genfn.__file__, "requests": args.requests,
                                             "new_tokens": args.new_tokens, "threads": args.threads, "rows": rows},
                        tag=args.tag)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
