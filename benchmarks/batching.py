"""Continuous batching throughput and latency on SmolLM2-135M, side by side in one process.

    python benchmarks/batching.py                         # the issue's workloads, float32 + bfloat16
    python benchmarks/batching.py --requests 16 --new-tokens 16 --parallel 8 --dtypes float32   # quick
    OMP_WAIT_POLICY=PASSIVE flock /tmp/genfn-bench.lock python benchmarks/batching.py   # on a shared machine

Workloads (greedy, ``min_new_tokens = max_new_tokens`` so every request decodes the same count):

    mixed     ``--requests`` requests (64) x ``--new-tokens`` (128) new tokens, prompt lengths
              drawn from 16..512 (seeded)
    parallel  ``--parallel`` (32) sequences of 30 prompt tokens + ``--new-tokens`` new tokens
    copy      ``--copy-requests`` (16) copy requests: a passage of genfn's own source (about
              ``--copy-chars`` characters, a different one each) then "the same code, copied
              exactly:" and its first line; greedy answers repeat the prompt, so prompt lookup
              drafts well (the workload of ``genfn-cb-lookup``). Not in the default workloads

Engines:

    genfn-cb      genfn ``model.generate_batch`` (paged cache, packed forward, the manager thread;
                  prompts take whatever of the token budget decoding leaves, its default)
    genfn-cb-lookup  genfn-cb with prompt-lookup speculation (``prompt_lookup_num_tokens``:
                  ``--prompt-lookup-tokens``, 10); its line gives its ratio over genfn-cb in the
                  same run (the same tokens, fewer forwards); warmed up on 32 tokens a request
                  (genfn-cb on 2), as its forwards' shapes vary with what is accepted
    genfn-cb-draft   genfn-cb with draft-model speculation (``assistant_model``): the draft is
                  SmolLM2's own first ``--draft-layers`` (8) layers with its final norm and LM
                  head, loaded as a separate model with a cache of its own (no download; a
                  truncated model predicts the full one's tokens far worse than a trained draft
                  would), ``--draft-tokens`` (4) drafts a round; each request drafts at batch size
                  1 beside the batch (``genfn.batching.drafting``)
    genfn-cb-capped  the same with prompt tokens capped at a quarter of the budget while requests
                  decode (the manager's default, for serving): what the cap costs or saves
    hf-cb         transformers ``model.generate_batch`` (its continuous batching, paged attention)
    genfn-static           genfn ``generate`` on the left-padded batch (static cache, eager)
    genfn-static-compiled  the same, its decode step compiled (genfn's default CPU compile:
                           max-autotune over frozen weights); warmed up on the same batch and
                           cache size, so its compile stays out of the timing
    llama.cpp-Q4_1         llama-cpp-python on the shipped GGUF, every sequence in one
                           ``llama_decode`` per step (``benchmarks/llamacpp.py``); also
                           llama.cpp-F32 (float32 runs) and llama.cpp-F16 (bfloat16 runs) when
                           ``benchmarks/llamacpp.py make-variants`` has made those files. The
                           issue runs it on the parallel workload; ``--llamacpp-workloads``
                           adds the mixed one

The padded static batch is the one continuous batching must beat by 1.5x: the ratio is taken
against the faster of the two genfn-static engines.

Prints tokens/s (generated tokens / wall time), time to first token (from submission) and
inter-token latency percentiles (p50, p90, p99), and writes them as JSON under
``benchmarks/results/`` (``--tag`` names the file). Each line also gives the engine's wall time
including its warm-up (``total``), so a long run shows where its time goes. On a shared CPU, run with ``OMP_WAIT_POLICY=PASSIVE`` and compare ratios
(see benchmarks/decode.py); the header prints the policy in effect.
"""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import datetime
import random
import time
import warnings
from pathlib import Path

import torch

from genfn.bench.results import write_results  # noqa: E402
from genfn.bench.workloads import copy_prompts  # noqa: E402


def percentiles(values):
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def at(q):
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def summarize(name, wall, generated, ttfts, itls):
    return {"engine": name, "wall_s": wall, "tokens": generated, "tokens_per_s": generated / wall,
            "ttft_s": percentiles(ttfts), "itl_s": percentiles(itls)}


def workloads(args, vocab, tokenizer=None):
    rng = random.Random(0)

    def prompt(length):
        return [rng.randrange(100, vocab - 1) for _ in range(length)]

    found = {
        "mixed": [prompt(rng.randint(16, 512)) for _ in range(args.requests)],
        "parallel": [prompt(30) for _ in range(args.parallel)],
    }
    if "copy" in args.workloads and tokenizer is not None:
        found["copy"] = copy_prompts(tokenizer, args.copy_requests, args.copy_chars)
    return found


def run_genfn_cb(model, prompts, new_tokens, max_batch_tokens=512, prefill_tokens_while_decoding=None, **settings):
    from genfn.config.batching import ContinuousBatchingConfig

    cb = ContinuousBatchingConfig(page_size=32, max_requests_per_batch=min(len(prompts), 64),
                                  max_batch_tokens=max_batch_tokens)
    cap = {} if prefill_tokens_while_decoding is None else {"prefill_tokens_while_decoding": prefill_tokens_while_decoding}
    start = time.perf_counter()
    results = model.generate_batch(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                   record_timestamps=True, continuous_batching_config=cb, warmup=False, **cap,
                                   **settings)
    wall = time.perf_counter() - start
    return _from_outputs("genfn-cb", results.values(), start, wall)


def truncated_draft(model, num_layers):
    """``model``'s first ``num_layers`` layers, final norm and LM head as a model of its own (the
    same tensors, not copies): a draft model sharing the tokenizer, made without a download."""
    import dataclasses

    from genfn.models.model import Model

    layers = model.params["layers"]
    if not 1 <= num_layers < len(layers):
        raise ValueError(f"--draft-layers must be in [1, {len(layers) - 1}], got {num_layers}")
    params = {**model.params, "layers": type(layers)(layers[:num_layers])}
    return Model(dataclasses.replace(model.spec, num_layers=num_layers), params, model.apply_fn,
                 model.init_cache_fn, tokenizer=model.tokenizer, generation_config=model.generation_config)


def _from_outputs(name, outputs, start, wall):
    ttfts, itls, generated = [], [], 0
    for out in outputs:
        generated += len(out.generated_tokens)
        stamps = out.timestamps or []
        if stamps:
            ttfts.append(stamps[0] - start)
            itls += [b - a for a, b in zip(stamps, stamps[1:])]
    return summarize(name, wall, generated, ttfts, itls)


def run_hf_cb(hf_model, prompts, new_tokens):
    import transformers

    config = transformers.GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                           eos_token_id=-1, pad_token_id=0)
    start = time.perf_counter()
    results = hf_model.generate_batch(prompts, generation_config=config, record_timestamps=True)
    wall = time.perf_counter() - start
    return _from_outputs("hf-cb", results.values(), start, wall)


class _StepClock:
    """A streamer that records when each decoding step's tokens arrive."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_genfn_static(model, prompts, new_tokens, compile_step, cache_len):
    """``cache_len``: the static cache's size, the same for the warm-up and the timed run, so a
    compiled step is compiled once for both."""
    longest = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    clock = _StepClock()
    start = time.perf_counter()
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, cache_implementation="static", disable_compile=not compile_step,
                         max_cache_len=cache_len, pad_token_id=0, streamer=clock)
    wall = time.perf_counter() - start
    steps = clock.times[1:]  # the first put is the prompt
    generated = (out.shape[1] - longest) * len(prompts)
    itls = [b - a for a, b in zip(steps, steps[1:])] * len(prompts)
    name = "genfn-static-compiled" if compile_step else "genfn-static"
    return summarize(name, wall, generated, [steps[0] - start] * len(prompts) if steps else [], itls)


def llamacpp_files(dtype_name, path):
    """``{engine name: GGUF path}``: the shipped file, and the float variant of ``dtype_name`` if made."""
    from llamacpp import variant_dir

    files = {"llama.cpp-Q4_1": path}
    variant = {"float32": "F32", "bfloat16": "F16"}.get(dtype_name)
    if variant is not None:
        made = variant_dir() / f"{Path(path).name.split('.')[0]}.{variant}.gguf"
        if made.exists():
            files[f"llama.cpp-{variant}"] = str(made)
    return files


def run_llamacpp(runner, name, prompts, new_tokens):
    """Greedy decoding of every prompt at once (one ``llama_decode`` per step, all sequences)."""
    runner._clear()
    start = time.perf_counter()
    entries, last = [], []
    for s, ids in enumerate(prompts):
        for p, token in enumerate(ids):
            entries.append((token, p, s, p == len(ids) - 1))
        last.append(len(entries) - 1)
    runner._decode(entries)
    out = [[int(runner._logits(i).argmax())] for i in last]
    stamps = [time.perf_counter()]
    for step in range(1, new_tokens):
        runner._decode([(out[s][-1], len(ids) + step - 1, s, True) for s, ids in enumerate(prompts)])
        for s in range(len(prompts)):
            out[s].append(int(runner._logits(s).argmax()))
        stamps.append(time.perf_counter())
    wall = time.perf_counter() - start
    itls = [b - a for a, b in zip(stamps, stamps[1:])] * len(prompts)
    return summarize(name, wall, sum(map(len, out)), [stamps[0] - start] * len(prompts), itls)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--parallel", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--quantize", choices=["none", "gguf"], default="none",
                        help="'gguf' keeps the file's Q4_1 blocks (genfn engines; float32 activations), as "
                             "`genfn serve --quantize gguf` does")
    parser.add_argument("--engines", nargs="+",
                        default=["genfn-cb", "hf-cb", "genfn-static", "genfn-static-compiled", "llama.cpp"])
    parser.add_argument("--workloads", nargs="+", default=["mixed", "parallel"])
    parser.add_argument("--max-batch-tokens", type=int, default=512,
                        help="genfn-cb's token budget per forward (smaller: shorter prefill stalls, lower ITL)")
    parser.add_argument("--prefill-tokens-while-decoding", type=int, default=None,
                        help="genfn-cb's prompt tokens per forward while requests decode (default: generate_batch's, "
                             "the whole budget)")
    parser.add_argument("--llamacpp-workloads", nargs="+", default=["parallel"],
                        help="the workloads llama.cpp runs (the issue compares it on the parallel one)")
    parser.add_argument("--copy-requests", type=int, default=16, help="requests of the copy workload")
    parser.add_argument("--copy-chars", type=int, default=1200, help="characters of source each copy request holds")
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10,
                        help="genfn-cb-lookup's prompt_lookup_num_tokens (drafts per step)")
    parser.add_argument("--draft-layers", type=int, default=8,
                        help="genfn-cb-draft's draft model: SmolLM2's first that many layers")
    parser.add_argument("--draft-tokens", type=int, default=4, help="genfn-cb-draft's num_assistant_tokens")
    parser.add_argument("--tag", default=None, help="appended to the JSON file's name (e.g. the branch)")
    args = parser.parse_args()
    began = time.perf_counter()

    import genfn
    from genfn.bench.llamacpp import LlamaCpp
    from genfn.bench.llamacpp import available as llamacpp_available
    from genfn.default_model import default_model_path

    warnings.filterwarnings("ignore")
    path = default_model_path()
    print(f"# continuous batching on SmolLM2-135M: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')}, device cpu, quantize {args.quantize}")
    load = os.getloadavg()
    print(f"# load average (1/5/15 min) at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    report = {"args": vars(args), "load_average_start": load, "runs": []}
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        model = genfn.load(path, dtype=dtype, quantize=None if args.quantize == "none" else args.quantize)
        hf_model = None
        if "hf-cb" in args.engines:
            import transformers

            hf_model = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype).eval()
        for workload, prompts in workloads(args, model.vocab_size, model.tokenizer).items():
            if workload not in args.workloads:
                continue
            # Warm-up at a small size, so first-call costs (kernel builds, allocations) stay out;
            # the static batch warms up on the batch itself (its compiled step keys on the shape).
            small = prompts[:2]
            cache_len = max(map(len, prompts)) + args.new_tokens
            runs = []
            for engine in args.engines:
                if engine == "llama.cpp":
                    if workload not in args.llamacpp_workloads:
                        continue
                    if not llamacpp_available():
                        print(f"# llama.cpp: llama-cpp-python is not installed, skipped")
                        continue
                    runs += [(name, gguf) for name, gguf in llamacpp_files(dtype_name, path).items()]
                else:
                    runs.append((engine, None))
            for engine, gguf in runs:
                engine_began = time.perf_counter()
                try:
                    with torch.inference_mode():
                        if engine == "genfn-cb":
                            # Eight prompts, so oneDNN has met most of the run's row counts (its
                            # first call at a new shape builds a kernel; the first engine to run
                            # otherwise pays for them).
                            run_genfn_cb(model, prompts[:8], 2)
                            result = run_genfn_cb(model, prompts, args.new_tokens, args.max_batch_tokens,
                                                  args.prefill_tokens_while_decoding)
                        elif engine == "genfn-cb-lookup":
                            lookup = {"prompt_lookup_num_tokens": args.prompt_lookup_tokens}
                            # Longer: its forwards' token counts vary with what is accepted, and
                            # oneDNN builds a kernel at each new count the first time it meets it.
                            run_genfn_cb(model, prompts[:8], 32, **lookup)
                            result = run_genfn_cb(model, prompts, args.new_tokens, args.max_batch_tokens,
                                                  args.prefill_tokens_while_decoding, **lookup)
                            result["engine"] = engine
                        elif engine == "genfn-cb-draft":
                            draft = {"assistant_model": truncated_draft(model, args.draft_layers),
                                     "num_assistant_tokens": args.draft_tokens}
                            run_genfn_cb(model, prompts[:8], 16, **draft)
                            result = run_genfn_cb(model, prompts, args.new_tokens, args.max_batch_tokens,
                                                  args.prefill_tokens_while_decoding, **draft)
                            result["engine"] = engine
                        elif engine == "genfn-cb-capped":
                            run_genfn_cb(model, prompts[:8], 2)
                            result = run_genfn_cb(model, prompts, args.new_tokens, args.max_batch_tokens,
                                                  max(32, args.max_batch_tokens // 4))
                            result["engine"] = engine
                        elif engine == "hf-cb":
                            run_hf_cb(hf_model, small, 2)
                            result = run_hf_cb(hf_model, prompts, args.new_tokens)
                        elif engine.startswith("genfn-static"):
                            compiled = engine == "genfn-static-compiled"
                            run_genfn_static(model, prompts, 2, compiled, cache_len)
                            result = run_genfn_static(model, prompts, args.new_tokens, compiled, cache_len)
                        else:
                            runner = LlamaCpp(gguf, torch.get_num_threads(), len(prompts), cache_len)
                            try:
                                run_llamacpp(runner, engine, small, 2)
                                result = run_llamacpp(runner, engine, prompts, args.new_tokens)
                            finally:
                                runner.close()
                except Exception as exc:  # report and go on: one engine failing must not hide the others
                    result = {"engine": engine, "error": f"{type(exc).__name__}: {exc}"}
                result.update(dtype=dtype_name, workload=workload, requests=len(prompts),
                              total_s=time.perf_counter() - engine_began)
                report["runs"].append(result)
                if "error" in result:
                    print(f"{dtype_name:9s} {workload:9s} {engine:21s} ERROR {result['error']}")
                    continue
                ttft, itl = result["ttft_s"], result["itl_s"]
                fmt = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
                print(f"{dtype_name:9s} {workload:9s} {engine:21s} {result['tokens_per_s']:8.1f} tok/s  "
                      f"TTFT p50/p90/p99 {fmt(ttft['p50'])}/{fmt(ttft['p90'])}/{fmt(ttft['p99'])} ms  "
                      f"ITL p50/p90/p99 {fmt(itl['p50'])}/{fmt(itl['p90'])}/{fmt(itl['p99'])} ms  "
                      f"total {result['total_s']:.0f} s", flush=True)
            by_engine = {r["engine"]: r for r in report["runs"]
                         if r.get("dtype") == dtype_name and r.get("workload") == workload and "error" not in r}
            statics = [by_engine[e] for e in ("genfn-static", "genfn-static-compiled") if e in by_engine]
            if statics:
                by_engine["best genfn-static"] = max(statics, key=lambda r: r["tokens_per_s"])
            cb = by_engine.get("genfn-cb")
            for other in by_engine:
                if cb and other != "genfn-cb":
                    ratio = cb["tokens_per_s"] / by_engine[other]["tokens_per_s"]
                    print(f"{'':20s} genfn-cb / {other}: {ratio:.2f}x")
                    report.setdefault("ratios", []).append(
                        {"dtype": dtype_name, "workload": workload, "against": other, "genfn_cb_over": ratio})
    report["load_average_end"] = os.getloadavg()
    report["wall_s"] = time.perf_counter() - began
    load = report["load_average_end"]
    print(f"# whole run {report['wall_s'] / 60:.1f} min; load average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"# wrote {write_results('batching', report, tag=args.tag, indent=2)}")


if __name__ == "__main__":
    main()
