"""One prompt-lookup verification round against one plain step, timed step by step in one process.

    python benchmarks/lookup_steps.py --quantize gguf                   # eager and compiled, k = 7 and 10
    python benchmarks/lookup_steps.py --inductor-option cpp.min_chunk_size=512 --calls 200
    python benchmarks/lookup_steps.py --model llama-1b-q4_k_m.gguf --no-eager   # a real-size file's blocks

``benchmarks/lookup_rounds.py`` times whole ``generate`` calls, so on a shared machine a round's
figure carries every other process's bursts. Here each case's step function and state are taken
from a ``generate`` call (SmolLM2, the rewriting task, static cache, ``--new-tokens`` tokens
decoded before the state is kept), and then the cases run in turn, ``--calls`` times each, so a
burst of load hits every case alike; each case keeps its fastest call. A step is pure and its
state is left where it was (the cache writes the same slots again), so every call repeats the
same round. Cases: the plain step and the round at each k, eager, compiled, and compiled with each
``--inductor-option`` (``name=value``, an inductor config entry, e.g. the previous default of a
setting genfn's backend changes); with ``--tensor-ops-proposal`` each round also as it runs where the
native kernels are not (prompt lookup's proposal as tensor ops, not ``lookup_ops.cpp``'s scan).
Prints one JSON line per engine: the step and round in ms and the round in plain steps (issue 31's
bar: ~1.33). ``--profile CALLS`` then profiles each case and prints its ops' self time a call.
``--hold K SECONDS`` then calls the compiled round at k = K (0: the plain step) for SECONDS more, after
printing its pid, so that a native profiler can attach to what runs inside the step's kernels:

    python benchmarks/lookup_steps.py --model llama-1b-q4_0.gguf --lookup-tokens 7 --no-eager --hold 7 30 &
    perf record -e cpu-clock -g -p PID -- sleep 15; perf report --no-children --sort sym
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import genfn  # noqa: E402
from genfn import driver  # noqa: E402
from genfn.strategies.assisted import prompt_lookup  # noqa: E402
from assisted import prompts  # noqa: E402


def kept_step(model, ids, mask, compiled: bool, new_tokens: int, **settings):
    """``(strategy, state, compile_options)`` of the last state a ``generate`` call stepped from."""
    kept = {}
    run = driver.run

    def keeping_run(strategy, model_, state, **kwargs):
        kept["last"] = (strategy, state, kwargs.get("compile_options"))
        return run(strategy, model_, state, **kwargs)

    driver.run = keeping_run
    try:
        genfn.generate(model, ids, attention_mask=mask, cache_implementation="static", max_cache_len=512,
                       max_new_tokens=new_tokens, disable_compile=not compiled, **settings)
    finally:
        driver.run = run
    strategy, state, options = kept["last"]
    # The driver's own span for this state (the compiled step attends over it, as in a real loop).
    return strategy, driver.limit_attention(state, int(state.cur_len.max()) + strategy.tokens_per_step - 1), options


def profile_ops(fn, state, proposal, calls: int, top: int = 8) -> dict:
    """Where a case's time goes: ``torch.profiler`` over ``calls`` calls, each op's self CPU time a call
    (the ``top`` largest, the rest summed) in ms, and the wall time a call."""
    from torch.profiler import ProfilerActivity, profile

    prompt_lookup.decode_linear_available = proposal
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            fn(state)
        wall = (time.perf_counter() - start) / calls
    ops = sorted(((e.key, e.self_cpu_time_total / 1e3 / calls) for e in prof.key_averages()), key=lambda kv: -kv[1])
    out = {name: round(ms, 3) for name, ms in ops[:top]}
    out["other ops"] = round(sum(ms for _, ms in ops[top:]), 3)
    return {"wall_ms": round(wall * 1e3, 3), "self_ms": out}


def inductor_option(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--inductor-option takes name=value, got {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lookup-tokens", default="7,10", help="comma-separated prompt_lookup_num_tokens")
    parser.add_argument("--quantize", choices=["gguf"], default=None, help="keep the file's blocks")
    parser.add_argument("--model", default=None,
                        help="a GGUF file with SmolLM2's vocabulary (benchmarks/make_model.py), its blocks kept")
    parser.add_argument("--calls", type=int, default=100, help="timed calls of each case (the fastest counts)")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens decoded before the state is kept")
    parser.add_argument("--inductor-option", type=inductor_option, action="append", default=[],
                        help="name=value: one more compiled engine with this inductor option (repeatable)")
    parser.add_argument("--no-eager", action="store_true")
    parser.add_argument("--profile", type=int, default=0, metavar="CALLS",
                        help="then profile CALLS calls of each case and print its ops' self time a call")
    parser.add_argument("--tensor-ops-proposal", action="store_true",
                        help="also time each round with prompt lookup's proposal as tensor ops")
    parser.add_argument("--hold", nargs=2, type=float, metavar=("K", "SECONDS"), default=None,
                        help="then call the compiled case at k = K (0: the plain step) for SECONDS, for a profiler")
    args = parser.parse_args()
    if args.hold is not None and int(args.hold[0]) not in [0] + [int(v) for v in args.lookup_tokens.split(",")]:
        parser.error(f"--hold K must be 0 or one of --lookup-tokens ({args.lookup_tokens}), got {args.hold[0]:g}")
    model = genfn.load(args.model, quantize="gguf") if args.model else genfn.load(quantize=args.quantize)
    ids, mask = prompts(model.tokenizer, 1)
    engines = {"compiled": {}} if args.no_eager else {"eager": None, "compiled": {}}
    for name, value in args.inductor_option:
        engines[f"compiled {name}={value}"] = {name: value}
    ks = [0] + [int(v) for v in args.lookup_tokens.split(",")]
    native = prompt_lookup.decode_linear_available
    variants = {"": native, " tensor-ops": lambda: False} if args.tensor_ops_proposal else {"": native}
    cases = {}
    for k in ks:
        settings = {"prompt_lookup_num_tokens": k} if k else {}
        for engine, options in engines.items():
            for suffix, proposal in variants.items() if k else [("", native)]:
                # The proposal's path is read as the step runs (and as a compiled step is traced).
                prompt_lookup.decode_linear_available = proposal
                strategy, state, compile_options = kept_step(model, ids, mask, options is not None,
                                                             args.new_tokens, **settings)
                if options is None:
                    fn = driver.eager_step(strategy.step, model)
                else:
                    compile_options = dict(compile_options)
                    compile_options["options"] = {**compile_options.get("options", {}), **options}
                    fn = driver.compiled_step(strategy.step, model, state, compile_options)
                fn(state)
                cases[engine + suffix, k] = (fn, state, proposal)
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(args.calls):
        for case, (fn, state, proposal) in cases.items():
            prompt_lookup.decode_linear_available = proposal
            start = time.perf_counter()
            fn(state)
            best[case] = min(best[case], time.perf_counter() - start)
    prompt_lookup.decode_linear_available = native
    if args.profile:
        for case, (fn, state, proposal) in cases.items():
            print(json.dumps({"case": f"{case[0]} k={case[1]}", **profile_ops(fn, state, proposal, args.profile)}),
                  flush=True)
        prompt_lookup.decode_linear_available = native
    for engine in engines:
        step = best[engine, 0]
        weights = os.path.basename(args.model) if args.model else "blocks" if args.quantize else "float32"
        line = dict(engine=engine, weights=weights, threads=torch.get_num_threads(),
                    load_average=round(os.getloadavg()[0], 2), calls=args.calls, step_ms=round(step * 1e3, 3))
        for k in ks[1:]:
            for suffix in variants:
                name = f"k{k}" + suffix.replace(" ", "_")
                line[f"round_ms_{name}"] = round(best[engine + suffix, k] * 1e3, 3)
                line[f"steps_per_round_{name}"] = round(best[engine + suffix, k] / step, 2)
        print(json.dumps(line), flush=True)
    if args.hold is not None:
        hold(cases[("compiled", int(args.hold[0]))], args.hold[1])


def hold(case, seconds: float) -> None:
    """Calls one case for ``seconds`` (its pid printed first), then prints its calls' mean and best."""
    fn, state, proposal = case
    prompt_lookup.decode_linear_available = proposal
    print(f"holding pid {os.getpid()} for {seconds:g} s", flush=True)
    calls, best, start = 0, float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        began = time.perf_counter()
        fn(state)
        best = min(best, time.perf_counter() - began)
        calls += 1
    mean = (time.perf_counter() - start) / calls
    print(json.dumps(dict(held_calls=calls, mean_ms=round(mean * 1e3, 3), best_ms=round(best * 1e3, 3))), flush=True)


if __name__ == "__main__":
    main()
