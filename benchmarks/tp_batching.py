"""Continuous batching under tensor parallelism on this machine: SmolLM2 requests through the
manager at TP=1 and TP=2, and what rank 0's commands to the other rank cost, in one run.

    python benchmarks/tp_batching.py                 # 8 requests x 16 tokens, Q4_1 blocks, eager

Two gloo ranks are spawned, each with one intra-op thread. Rounds alternate: ``tp1``: rank 0's
manager over the whole model while rank 1 waits; ``tp2``: the leader on rank 0 and the follower
on rank 1 (``genfn.batching.tensor_parallel``). ``command_share``: the part of rank 0's TP=2 wall
time spent inside ``Channel.send`` (the broadcasts of each step's inputs; a send also waits for a
follower still finishing its previous command). Prints medians and writes JSON under
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
           "Once upon a time, in a small village,", "The best way to learn Python is", "Translate 'cat' to French:",
           "A short story about a robot who", "The three primary colors are"]


def _run(model, prompts, args, cb) -> tuple[float, list]:
    start = time.perf_counter()
    results = model.generate_batch(prompts, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                   do_sample=False, continuous_batching_config=cb, warmup=False)
    return time.perf_counter() - start, [r.generated_tokens for r in results.values()]


def rank_main(rank: int, port: int, args, results) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    import genfn
    from genfn.batching import tensor_parallel
    from genfn.config.batching import ContinuousBatchingConfig
    from genfn.distributed import init_tensor_parallel, shutdown

    shard = init_tensor_parallel(2, rank=rank, init_method=f"tcp://127.0.0.1:{port}", timeout=1800, set_threads=False)
    options = {} if args.quantize == "none" else {"quantize": args.quantize}
    sharded = genfn.load(args.model, **options, tensor_shard=shard)
    whole = genfn.load(args.model, **options) if rank == 0 else None
    prompts = [sharded.tokenizer.encode(text) for text in PROMPTS[:args.requests]]
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=128, max_batch_tokens=256, max_requests_per_batch=16)
    spent = [0.0]
    send = tensor_parallel.Channel.send

    def timed_send(self, *a, **k):
        began = time.perf_counter()
        try:
            return send(self, *a, **k)
        finally:
            spent[0] += time.perf_counter() - began

    tensor_parallel.Channel.send = timed_send
    runs, shares, tokens = {"tp1": [], "tp2": []}, [], {}
    for _ in range(args.rounds + 1):  # the first round warms up
        if rank == 0:
            seconds, tokens["tp1"] = _run(whole, prompts, args, cb)
            runs["tp1"].append(seconds)
        dist.barrier()
        spent[0] = 0.0
        seconds, tokens["tp2"] = _run(sharded, prompts, args, cb)
        runs["tp2"].append(seconds)
        shares.append(spent[0] / seconds)
        dist.barrier()
    generated = len(prompts) * args.new_tokens
    report = {"rank": rank, "requests": len(prompts), "generated_tokens": generated}
    if rank == 0:
        report["tokens_per_s"] = {name: generated / statistics.median(times[1:]) for name, times in runs.items()}
        report["command_share"] = statistics.median(shares[1:])
        # requests whose TP=2 tokens are TP=1's (SmolLM2's Q4_1 blocks: see docs/guides/distributed.md)
        report["requests_equal_tp1"] = sum(a == b for a, b in zip(tokens["tp2"], tokens["tp1"]))
    results.put(report)
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a checkpoint (default: the shipped SmolLM2 Q4_1 GGUF)")
    parser.add_argument("--quantize", default="gguf", help="gguf (the file's blocks), none (float32), q8_0, ...")
    parser.add_argument("--requests", type=int, default=8, choices=range(1, len(PROMPTS) + 1))
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from genfn.bench.ranks import run_local_ranks
    from genfn.bench.results import write_results

    reports = run_local_ranks(rank_main, args)
    r0 = reports[0]
    print(f"SmolLM2 ({args.quantize}), {r0['requests']} requests x {args.new_tokens} tokens, continuous batching, "
          f"{args.rounds} rounds, median; {os.cpu_count()} cores (shared with other work while measured)")
    base = r0["tokens_per_s"]["tp1"]
    for name, tps in r0["tokens_per_s"].items():
        print(f"  {name:5s} {tps:7.2f} tok/s  ({tps / base:.2f}x tp1)")
    print(f"  requests whose TP=2 tokens equal TP=1's: {r0['requests_equal_tp1']} of {r0['requests']}; "
          f"rank 0's time in command broadcasts: "
          f"{100 * r0['command_share']:.1f} %")
    print(f"results: {write_results('tp-batching', {'args': vars(args), 'ranks': reports}, args.out)}")


if __name__ == "__main__":
    main()
