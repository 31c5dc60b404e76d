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

``--linears 32``: instead, each of the model's linear shapes (layer 0's fused q/k/v, o, gate/up,
down, and the LM head) at 32 rows, in one process, interleaved: continuous batching's kernel
outside the mode (``packed_linear``: oneDNN's float32 GEMM, genfn's bfloat16 GEMM), the mode's
(``invariant.linear``), and the mode's earlier tiles of 8 rows through the decode kernel; median
milliseconds of ``--rounds`` rounds. ``--profile``: the continuous workload once in the mode under
``torch.profiler``, its ops by self CPU time (where a mode's step spends it).
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def _median_ms(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _linears(model, rows: int, rounds: int) -> list[dict]:
    """The model's linear shapes at ``rows`` rows through the three kernels (module docstring)."""
    from genfn import kernels
    from genfn.kernels import invariant
    from genfn.kernels.packed_gemm import PackedWeight, packed_linear

    layer = model.params["layers"][0]
    weights = {name: layer[name] for name in ("wqkv", "wo", "w_gate_up", "w_down")}
    weights["lm_head"] = model.params["lm_head"]
    out = []
    for name, weight in weights.items():
        x = torch.randn(rows, weight.shape[1]).to(weight.dtype)
        packed = PackedWeight(weight)
        tile = kernels.MAX_DECODE_ROWS[weight.dtype]
        runs = {"default (packed GEMM)": lambda: packed_linear(x, packed),
                "mode": lambda: invariant.linear(x, weight),
                "mode before (8-row tiles)": lambda: torch.cat([kernels.linear(x[i:i + tile], weight)
                                                                for i in range(0, rows, tile)])}
        ms = {key: [] for key in runs}
        for _ in range(rounds):  # interleaved, so that the machine's load hits each alike
            for key, fn in runs.items():
                ms[key].append(_median_ms(fn, 3))
        row = {"linear": f"{name} {tuple(weight.shape)}", **{k: round(statistics.median(v), 3) for k, v in ms.items()}}
        row["mode / default"] = round(row["mode"] / row["default (packed GEMM)"], 3)
        out.append(row)
    return out


def _profile(model, requests: int, new_tokens: int, top: int = 14) -> str:
    """The continuous workload once in each mode under ``torch.profiler`` (every thread's ops): the
    ops with the most self CPU time in either mode, with their time in each."""
    from torch.profiler import ProfilerActivity, profile

    prompts = _ids(model, requests)
    seconds: dict[bool, dict[str, float]] = {}
    for invariant in (False, True):
        _continuous(model, prompts, 2, invariant)  # warm-up: kernels loaded, pools started
        # The manager's forwards run on its own thread: profile every thread's ops.
        every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
            _continuous(model, prompts, new_tokens, invariant)
        seconds[invariant] = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    names = sorted(set(seconds[True]) | set(seconds[False]),
                   key=lambda n: max(seconds[True].get(n, 0.0), seconds[False].get(n, 0.0)), reverse=True)[:top]
    lines = [f"  {'op':<48} {'default s':>10} {'mode s':>10}",
             f"  {'(all ops)':<48} {sum(seconds[False].values()):10.2f} {sum(seconds[True].values()):10.2f}"]
    lines += [f"  {name[:48]:<48} {seconds[False].get(name, 0.0):10.2f} {seconds[True].get(name, 0.0):10.2f}" for name in names]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantize", default=None, choices=[None, "gguf"], help="keep the file's Q4_1 blocks")
    parser.add_argument("--prompts", type=int, default=4, help="prompts of the batch-1 workload")
    parser.add_argument("--requests", type=int, default=32, help="requests of the continuous-batching workload")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--linears", type=int, default=0, metavar="ROWS",
                        help="time the linear kernels at ROWS rows instead (module docstring)")
    parser.add_argument("--profile", action="store_true", help="profile the continuous workload in the mode")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (default: torch's own); on a loaded machine 1 keeps a straggler "
                             "thread from setting the pace")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.linears and args.quantize:
        parser.error("--linears times the float kernels: leave out --quantize")
    model = genfn.load(default_model_path(), dtype=getattr(torch, args.dtype), quantize=args.quantize)
    if args.linears:
        rows = _linears(model, args.linears, args.rounds)
        print(json.dumps(rows, indent=2) if args.json else "\n".join(
            f"  {r['linear']:<28} " + "   ".join(f"{k} {v}" for k, v in r.items() if k != "linear") for r in rows))
        return
    if args.profile:
        print(_profile(model, args.requests, args.new_tokens))
        return
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
