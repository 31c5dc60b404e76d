"""Tensor parallelism on this machine: SmolLM2 decode tokens/s and memory per rank at TP=1 and
TP=2, and what the all-reduces of a step cost, in one run.

    python benchmarks/tp.py                      # Q4_1 blocks (the shipped file), eager steps
    python benchmarks/tp.py --quantize none      # float32 weights
    python benchmarks/tp.py --compile            # also the compiled step (minutes of compiling)

Two gloo ranks are spawned, each with one intra-op thread. Rounds alternate, side by side:
``tp1``: rank 0 alone decodes with the whole model (the fused native decode layer) while rank 1
waits; ``tp1-2threads`` (``--two-threads``): the same with two threads; ``tp1-op-by-op``:
rank 0 alone with a one-rank tensor-parallel shard (the op-by-op layer TP takes, collectives over
a group of one); ``tp2``: both ranks decode their halves, reducing through shared memory
(``genfn.local_all_reduce``, the default between ranks of one machine); ``tp2-gloo``: the same over
gloo's loopback TCP (a second group of both ranks, for which no shared memory is opened). Then the
collectives of a decode step alone: the hidden vector's all-reduces (per row-parallel linear one,
or one per rank where quantized blocks chain their sums, 2 linears a layer, plus the embedding's)
and the logits' all-reduce, timed in isolation through shared memory, functional collectives and
``dist.all_reduce``. Prints medians and writes JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

PROMPT = "The capital of France is"


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _param_mib(model) -> float:
    seen, total = set(), 0
    for leaf in torch.utils._pytree.tree_leaves(model.params):
        if isinstance(leaf, torch.Tensor) and leaf.data_ptr() not in seen:
            seen.add(leaf.data_ptr())
            total += leaf.numel() * leaf.element_size()
    return total / 2**20


def _decode_seconds(model, ids, new_tokens: int, compiled: bool) -> tuple[float, list]:
    import genfn

    extra = {"cache_implementation": "static"} if compiled else {}
    start = time.perf_counter()
    out = genfn.generate(model, ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens, **extra)
    return time.perf_counter() - start, out[0, ids.shape[1]:].tolist()


def _collective_ms(group_name: str, numel: int, calls: int) -> dict:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from genfn import local_all_reduce

    x = torch.randn(1, numel)
    out = {}
    kinds = [("functional", lambda: funcol.wait_tensor(funcol.all_reduce(x, "sum", group_name))),
             ("dist.all_reduce", lambda: dist.all_reduce(x.clone()))]
    shared = local_all_reduce.for_group(group_name)
    if shared is not None and shared.fits(x):
        kinds.append(("shared memory", lambda: shared.all_reduce(x.clone())))
    for name, fn in kinds:
        for _ in range(20):
            fn()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = (time.perf_counter() - start) / calls * 1e3
    return out


def rank_main(rank: int, port: int, args, results) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    import genfn
    from genfn.distributed import init_tensor_parallel, shutdown
    from genfn.models.tensor_parallel import TensorShard, current_shard

    shard = init_tensor_parallel(2, rank=rank, init_method=f"tcp://127.0.0.1:{port}", timeout=1800, set_threads=False)
    solo = dist.new_group([0])  # every rank must create it; rank 0 uses it for the one-rank shard
    gloo_only = dist.new_group([0, 1])  # the same ranks without a shared-memory reducer
    options = {} if args.quantize == "none" else {"quantize": args.quantize}
    rss_before = _rss_mib()
    sharded = genfn.load(args.model, **options, tensor_shard=shard)
    over_gloo = genfn.load(args.model, **options, tensor_shard=TensorShard(rank, 2, gloo_only.group_name))
    report = {"rank": rank, "tp2_param_mib": _param_mib(sharded), "tp2_rss_mib": _rss_mib(),
              "rss_before_load_mib": rss_before}
    ids = torch.tensor([sharded.tokenizer.encode(PROMPT)])
    whole = one_rank = None
    if rank == 0:
        whole = genfn.load(args.model, **options)
        one_rank = genfn.load(args.model, **options, tensor_shard=TensorShard(0, 1, solo.group_name))
        report["tp1_param_mib"] = _param_mib(whole)
    runs = {"tp1": [], **({"tp1-2threads": []} if args.two_threads else {}), "tp1-op-by-op": [], "tp2": [],
            "tp2-gloo": []}
    tokens = {}
    modes = [False] + ([True] if args.compile else [])
    for compiled in modes:
        suffix = "-compiled" if compiled else ""
        for name in list(runs):
            runs.setdefault(name + suffix, [])
        for _ in range(args.rounds + 1):  # the first round warms up (and compiles)
            rows = {}
            if rank == 0:
                rows["tp1"] = _decode_seconds(whole, ids, args.new_tokens, compiled)
                if args.two_threads:
                    torch.set_num_threads(2)
                    rows["tp1-2threads"] = _decode_seconds(whole, ids, args.new_tokens, compiled)
                    torch.set_num_threads(1)
                rows["tp1-op-by-op"] = _decode_seconds(one_rank, ids, args.new_tokens, compiled)
            dist.barrier()
            rows["tp2"] = _decode_seconds(sharded, ids, args.new_tokens, compiled)
            dist.barrier()
            rows["tp2-gloo"] = _decode_seconds(over_gloo, ids, args.new_tokens, compiled)
            dist.barrier()
            for name, (seconds, toks) in rows.items():
                runs[name + suffix].append(seconds)
                tokens[name + suffix] = toks
    report["tokens_per_s"] = {name: args.new_tokens / statistics.median(times[1:])
                              for name, times in runs.items() if len(times) > 1}
    report["tokens_equal_tp1"] = {name: toks == tokens.get("tp1") for name, toks in tokens.items()}
    spec = sharded.spec
    # float32 activations over quantized blocks chain o's and down's sums rank by rank (exact)
    per_linear = shard.world_size if args.quantize != "none" else 1
    hidden_calls = 2 * spec.num_layers * per_linear + 1
    report["collectives_per_step"] = hidden_calls + 1
    report["hidden_all_reduce_ms"] = _collective_ms(shard.group_name, spec.hidden_size, args.calls)
    report["logits_all_reduce_ms"] = _collective_ms(shard.group_name, spec.vocab_size, max(50, args.calls // 10))
    report["collectives_ms_per_step"] = {  # eager: shared memory, else dist.all_reduce; compiled: functional
        kind: hidden_calls * report["hidden_all_reduce_ms"][kind] + report["logits_all_reduce_ms"][kind]
        for kind in report["hidden_all_reduce_ms"] if kind in report["logits_all_reduce_ms"]}
    results.put(report)
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a checkpoint (default: the shipped SmolLM2 Q4_1 GGUF)")
    parser.add_argument("--quantize", default="gguf", help="gguf (the file's blocks), none (float32), q8_0, ...")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=500, help="all-reduces timed per size")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--two-threads", action="store_true",
                        help="also TP=1 with two threads while rank 1 waits (very slow on a loaded machine)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from genfn.bench.ranks import run_local_ranks
    from genfn.bench.results import write_results

    reports = run_local_ranks(rank_main, args)
    r0, r1 = reports
    print(f"SmolLM2 ({args.quantize}), {args.new_tokens} new tokens, {args.rounds} rounds, median; "
          f"{os.cpu_count()} cores (shared with other work while measured)")
    base = r0["tokens_per_s"]["tp1"]
    for name, tps in r0["tokens_per_s"].items():
        print(f"  {name:22s} {tps:7.2f} tok/s  ({tps / base:.2f}x tp1)  tokens equal tp1: "
              f"{r0['tokens_equal_tp1'].get(name)}")
    print(f"  params: whole {r0['tp1_param_mib']:.0f} MiB; TP=2 rank 0 {r0['tp2_param_mib']:.0f} MiB, "
          f"rank 1 {r1['tp2_param_mib']:.0f} MiB; RSS after loading its shard: rank 1 {r1['tp2_rss_mib']:.0f} MiB "
          f"(rank 0 also holds the TP=1 models)")
    for what in ("hidden_all_reduce_ms", "logits_all_reduce_ms"):
        print(f"  {what}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in r0[what].items()))
    print(f"  {r0['collectives_per_step']} all-reduces per decode step: " + ", ".join(
        f"{v:.1f} ms per token with {k}" for k, v in r0["collectives_ms_per_step"].items()))
    print(f"results: {write_results('tp', {'args': vars(args), 'ranks': reports}, args.out)}")


if __name__ == "__main__":
    main()
