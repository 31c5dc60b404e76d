"""Decode, prefill, load time and memory of one model file, genfn against llama.cpp (and ik_llama.cpp).

    python benchmarks/model_bench.py --model ~/.cache/genfn/models/llama-1b-q4_0.gguf
    python benchmarks/model_bench.py --model A.gguf,B.gguf --batches 1 --model-engines genfn,llama.cpp
    python benchmarks/model_bench.py --model F.gguf --llama-bench ~/ik_llama.cpp/build/bin/llama-bench

``--model`` takes GGUF files (``benchmarks/make_model.py`` writes random-weight ones in real
shapes) or Hugging Face directories. Each (file, engine) runs in a fresh child process, so its
load time and peak RSS are its own; with ``--rounds N`` every engine (``llama-bench`` too) runs
once a round, back to back, and the ratios of each round and their median are printed beside the
best of all rounds: on a VM whose read bandwidth drifts from minute to minute only runs close in
time compare. Engines:

    genfn           genfn eager: ``genfn.load(file, quantize="gguf")`` for quantized files (their
                    blocks as stored), bfloat16 for F16/BF16 files, float32 for F32 ones
    genfn-compiled  the same model, ``cache_implementation="static"`` (the step compiled)
    genfn-coded     genfn-compiled with an F16/BF16 file's linears coded in 12.2 bits, every weight
                    kept (``quantize="coded_bf16"``; a quantized file loads as for genfn-compiled)
    genfn-avx2      genfn eager as a CPU without AVX-512 runs it (``genfn.bench.avx2``: no decode
                    library, the K-quant kernels' AVX2 path, torch's kernels at
                    ``ATEN_CPU_CAPABILITY=avx2``, oneDNN's and MKL's at AVX2 since session 46,
                    where their AVX-512 GEMMs had made a bfloat16 prefill look 8x faster than
                    such a CPU runs it); ``genfn-avx2-compiled`` compiled, the step's
                    generated code 256 bits wide: compare them with a ``--llama-bench`` built for
                    AVX2 (benchmarks/results/avx2-aten-2026-12-07-s44-zen4.log has the build)
    llama.cpp       llama-cpp-python (``GENFN_LLAMA_REPACK=0`` turns its repacked/AMX buffers off)
    llama-bench     ``--llama-bench PATH``: a ``llama-bench`` binary (llama.cpp's or ik_llama.cpp's;
                    extra flags with ``--llama-bench-args``, e.g. ``"-rtr 1"``), tg and pp512

Per engine: tok/s of greedy decoding at each batch (random prompts of 16 tokens, ``--new-tokens``
new ones each, best of ``--repeats``), prefill tok/s of one ``--prefill``-token prompt, load
seconds (the load alone: imports and genfn's native kernels come before it, as in
``benchmarks/load_memory.py``), the load's peak (``VmHWM`` reset before it, over the resident memory
before it) and the run's peak RSS from the load on; per file: its size, the bytes of matrices a
batch-1 token reads, and the roofline (those bytes / the read bandwidth measured here) with each
engine's share of it. Each
child is bracketed by two samples of ``tensor.sum``'s read rate, and every round's batch-1 share of
the faster of them is printed too: the share that means something where the memory's rate drifts.
Results go to ``--json`` (default ``benchmarks/results/model-<time>.json``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

PROMPT_LEN = 16
# genfn's engines whose decode is put over each peer's: the compiled ones (the coded one over the
# plain compiled one too), or the eager one where neither ran.
_COMPILED = ("genfn-coded", "genfn-compiled")
_AVX2 = ("genfn-avx2", "genfn-avx2-compiled")
ENGINES = ("genfn", *_COMPILED, *_AVX2, "llama.cpp")


def _pairs(present) -> list[tuple[str, str]]:
    """(genfn engine, peer) among the engines `present`, in the order their ratios print; the AVX2
    engines' compiled one, or their eager one where it did not run, over the peers too."""
    ours = [e for e in _COMPILED if e in present] or ["genfn"]
    ours += [e for e in _AVX2[::-1] if e in present][:1]
    peers = {o: (("genfn-compiled",) if o == "genfn-coded" else ()) + ("llama.cpp", "llama-bench") for o in ours}
    peers.update({o: ("genfn", "llama.cpp", "llama-bench") for o in _AVX2})
    return [(o, p) for o in ours for p in peers[o] if o in present and p in present]


def _peak_mb() -> float:
    """The peak resident memory since the load began: ``VmHWM``, which ``_forget_peak`` reset before it.
    Where ``/proc`` has none, getrusage's peak, which counts more: after a fork and an exec it starts
    from the parent's resident memory at the fork (Linux keeps the old address space's peak)."""
    peak = _status_mb("VmHWM:")
    return peak if not math.isnan(peak) else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _status_mb(key: str) -> float:
    """A ``/proc/self/status`` figure (``VmRSS:``, ``VmHWM:``) in MB; NaN where there is none."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key))
    except (OSError, StopIteration):
        return float("nan")


def _forget_peak() -> None:
    """Reset ``VmHWM`` to the resident memory now (Linux), so that the next peak read is the load's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _gguf_kind(path: str) -> str:
    """"quantized", "bfloat16" or "float32": how genfn loads the file."""
    from gguf import GGMLQuantizationType

    from genfn.models.loaders.gguf import read_gguf

    types = {GGMLQuantizationType(info.ggml_type).name for info in read_gguf(path).tensors.values()
             if len(info.shape) == 2}
    if types - {"F32", "F16", "BF16"}:
        return "quantized"
    return "float32" if types == {"F32"} else "bfloat16"


def child(args) -> dict:
    """One engine on one file, in this process: load, decode per batch, prefill."""
    import torch

    torch.set_num_threads(args.threads)
    out: dict = {"engine": args.engine, "model": args.model}
    gen = torch.Generator().manual_seed(0)
    # The load alone is timed (issue 31's bar, as benchmarks/load_memory.py times it): the engine's
    # imports and genfn's native kernels come first, and the load's peak is read from VmHWM reset
    # just before it.
    t = time.perf_counter()
    if args.engine == "llama.cpp":
        from genfn.bench import llamacpp
    else:
        if args.engine in _AVX2:
            from genfn.bench.avx2 import run_as_avx2_cpu

            run_as_avx2_cpu()
            if args.engine == "genfn-avx2-compiled":
                import torch._inductor.config

                torch._inductor.config.cpp.simdlen = 256
        import genfn
        from genfn import kernels

        kernels.quant_linear_available()
        is_gguf = args.model.endswith(".gguf")
        kind = _gguf_kind(args.model) if is_gguf else "float32"
    out["import_s"] = time.perf_counter() - t
    out["rss_before_mb"] = _status_mb("VmRSS:")
    _forget_peak()
    t = time.perf_counter()
    if args.engine == "llama.cpp":
        runner = llamacpp.LlamaCpp(args.model, args.threads, max(args.batches),
                                   max(PROMPT_LEN + args.new_tokens + 8, args.prefill + 8))
        vocab = runner.n_vocab
    else:
        coded = args.engine == "genfn-coded" and kind == "bfloat16"
        model = (genfn.load(args.model, quantize="gguf") if kind == "quantized"
                 else genfn.load(args.model, dtype=getattr(torch, kind), quantize="coded_bf16" if coded else None))
        vocab = model.spec.vocab_size
    out["load_s"] = time.perf_counter() - t
    out["rss_after_load_mb"] = _status_mb("VmRSS:")
    out["load_peak_mb"] = _status_mb("VmHWM:")

    def prompts(batch: int, length: int) -> torch.Tensor:
        return torch.randint(100, vocab - 100, (batch, length), generator=gen)

    def run(ids: torch.Tensor, new_tokens: int, cache_len: int):
        """``cache_len``: one per phase, so the 1-token call subtracted from a timed one runs the
        same compiled graph (a cache of another length would be another graph, built in the call)."""
        if args.engine == "llama.cpp":
            return runner.generate(ids.tolist(), new_tokens)
        compiled = args.engine in ("genfn-compiled", "genfn-coded", "genfn-avx2-compiled")
        extra = {"cache_implementation": "static", "max_cache_len": cache_len} if compiled else {}
        with torch.no_grad():
            return genfn.generate(model, ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=0, **extra)

    out["decode_tok_s"], out["first_call_s"], out["tokens_digest"] = {}, {}, {}
    decode_cache, prefill_cache = PROMPT_LEN + args.new_tokens + 8, args.prefill + 8
    for batch in args.batches:
        ids = prompts(batch, PROMPT_LEN)
        t = time.perf_counter()
        run(ids, args.new_tokens, decode_cache)  # warm-up (compiles for genfn-compiled)
        out["first_call_s"][batch] = time.perf_counter() - t
        best = float("inf")
        for _ in range(args.repeats):
            # New tokens only: a 1-token call's time (prefill of the same prompt) is subtracted.
            t = time.perf_counter()
            run(ids, 1, decode_cache)
            one = time.perf_counter() - t
            t = time.perf_counter()
            tokens = run(ids, args.new_tokens, decode_cache)
            best = min(best, time.perf_counter() - t - one)
        out["decode_tok_s"][batch] = batch * (args.new_tokens - 1) / best
        # Which tokens were decoded, to compare one engine across source trees (benchmarks/trees_ab.py).
        listed = tokens.tolist() if hasattr(tokens, "tolist") else tokens
        out["tokens_digest"][batch] = hashlib.sha256(json.dumps(listed).encode()).hexdigest()[:16]
    if args.prefill:
        ids = prompts(1, args.prefill)
        run(ids, 1, prefill_cache)  # warm-up: the compiled engine's graph for this cache length
        best = float("inf")
        for _ in range(max(1, args.repeats - 1)):
            t = time.perf_counter()
            run(ids, 1, prefill_cache)
            best = min(best, time.perf_counter() - t)
        out["prefill_tok_s"] = args.prefill / best
    out["peak_rss_mb"] = _peak_mb()
    return out


def llama_bench(binary: str, model: str, args) -> dict:
    """tg and pp tok/s from a llama-bench binary's JSON output."""
    command = [binary, "-m", model, "-t", str(args.threads), "-n", str(args.new_tokens), "-p", str(args.prefill),
               "-r", str(args.repeats), "-o", "json", *args.llama_bench_args.split()]
    t = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return {"engine": "llama-bench", "error": done.stderr[-500:]}
    rows = json.loads(done.stdout)
    out = {"engine": "llama-bench", "model": model, "decode_tok_s": {}, "wall_s": time.perf_counter() - t}
    for row in rows:
        if row.get("n_gen"):
            out["decode_tok_s"][1] = row["avg_ts"]
        elif row.get("n_prompt"):
            out["prefill_tok_s"] = row["avg_ts"]
    return out


def run_child(args, model: str, engine: str, tree: str | None = None) -> dict:
    """``child`` in a fresh process; with ``tree``, genfn imported from that source tree."""
    command = [sys.executable, __file__, "--child", "--model", model, "--engine", engine,
               "--batches", ",".join(map(str, args.batches)), "--new-tokens", str(args.new_tokens),
               "--prefill", str(args.prefill), "--repeats", str(args.repeats), "--threads", str(args.threads)]
    env = dict(os.environ, PYTHONPATH=tree) if tree else dict(os.environ)
    if engine in _AVX2:  # torch's own kernels on their AVX2 forms too, as on such a CPU: ATen's, oneDNN's, MKL's
        env.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2")
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"engine": engine, "model": model, "error": (done.stderr or done.stdout)[-800:]}
    result = json.loads(lines[-1])
    # JSON keys are strings; batch sizes are compared with llama-bench's (ints) in the ratios
    for key in ("decode_tok_s", "tokens_digest"):
        result[key] = {int(b): v for b, v in result.get(key, {}).items()}
    return result


def paired_ratios(runs: dict[str, list]) -> dict[str, list[float]]:
    """genfn's decode tok/s over each peer's in the same round, per batch: on a VM whose read
    bandwidth drifts between minutes, runs back to back compare where best-of-rounds across
    minutes need not."""
    out = {}
    for ours, peer in _pairs(runs):
        for i, (a, b) in enumerate(zip(runs[ours], runs[peer])):
            if "error" in a or "error" in b:
                continue
            # children's batch keys come back from JSON as strings, llama-bench's are ints
            theirs_by_batch = {str(k): v for k, v in b["decode_tok_s"].items()}
            for batch, v in a["decode_tok_s"].items():
                theirs = theirs_by_batch.get(str(batch))
                if theirs:
                    out.setdefault(f"{ours} / {peer} b{batch}", []).append(v / theirs)
    return out


def _best(runs: list[dict]) -> dict:
    """Per engine, the best of its runs (fastest decode/prefill, least load time and memory)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    best = dict(ok[0])
    for r in ok[1:]:
        for key in ("decode_tok_s",):
            best[key] = {b: max(v, r[key].get(b, 0)) for b, v in best[key].items()}
        for key in ("prefill_tok_s",):
            if key in r:
                best[key] = max(best.get(key, 0), r[key])
        for key in ("load_s", "load_peak_mb", "peak_rss_mb"):
            if key in r:
                best[key] = min(best.get(key, r[key]), r[key])
    return best


def sampled(run) -> dict:
    """``run()``'s result with ``read_gbs``: ``tensor.sum``'s read rate sampled here just before and
    just after it, and ``meeting_ns``: the threads' meeting time beside each (``thread_meeting_ns``:
    whether they sat on one die or on two). The VM's memory moves from one minute to the next (45-90
    GB/s on sessions 23-35's Zen 5, the fast minutes those on two dies), so a step's share of the read
    rate means something only against the rate of its minute; sampled in this process, not the
    child's, so the sample's buffer is not in the child's peak RSS."""
    from genfn.bench.decode import read_bandwidth_gbs, thread_meeting_ns

    before, meeting_before = read_bandwidth_gbs(mib=256, repeats=3)[0], thread_meeting_ns()
    result = run()
    result["read_gbs"] = [before, read_bandwidth_gbs(mib=256, repeats=3)[0]]
    result["meeting_ns"] = [meeting_before, thread_meeting_ns()]
    return result


def main(args) -> int:
    import torch

    from genfn.bench import llamacpp
    from genfn.bench.decode import read_bandwidth_gbs

    torch.set_num_threads(args.threads)
    engines = list(args.engines)
    if "llama.cpp" in engines and not llamacpp.available():
        print("# llama_cpp is not importable: llama.cpp skipped", flush=True)
        engines.remove("llama.cpp")
    sum_rate, mv_rate = read_bandwidth_gbs()
    bandwidth = max(sum_rate, mv_rate)
    print(f"# model benchmark: threads {args.threads}, load avg {os.getloadavg()[0]:.1f}, read bandwidth "
          f"{bandwidth:.1f} GB/s (tensor.sum {sum_rate:.1f}, torch.mv {mv_rate:.1f}); batches {args.batches}, "
          f"{args.new_tokens} new tokens, prefill {args.prefill}, best of {args.repeats}", flush=True)
    report = {"args": {k: v for k, v in vars(args).items()}, "read_bandwidth_gbs": bandwidth,
              "load_avg_start": os.getloadavg()[0], "models": []}
    for model in args.models:
        size = os.path.getsize(model) if os.path.isfile(model) else sum(
            p.stat().st_size for p in Path(model).rglob("*") if p.is_file())
        token_bytes = llamacpp.file_weight_bytes(model) if model.endswith(".gguf") else None
        runs: dict[str, list] = {e: [] for e in engines + (["llama-bench"] if args.llama_bench else [])}
        for _ in range(args.rounds):
            for engine in engines:
                runs[engine].append(sampled(lambda: run_child(args, model, engine)))
            if args.llama_bench:
                runs["llama-bench"].append(sampled(lambda: llama_bench(args.llama_bench, model, args)))
        results = [_best(r) for r in runs.values()]
        roofline = None if token_bytes is None else bandwidth * 1e9 / token_bytes
        print(f"\n## {Path(model).name}: {size / 1e9:.2f} GB file"
              + ("" if token_bytes is None else f", {token_bytes / 1e9:.2f} GB of matrices a token -> roofline "
                 f"{roofline:.1f} tok/s at batch 1"), flush=True)
        for r in results:
            if "error" in r:
                print(f"  {r['engine']:15s} FAILED: {r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}")
                continue
            decode = "  ".join(f"b{b} {v:7.1f}" for b, v in r["decode_tok_s"].items())
            share = "" if roofline is None or 1 not in r["decode_tok_s"] and "1" not in r["decode_tok_s"] else \
                f"  roofline share {r['decode_tok_s'].get(1, r['decode_tok_s'].get('1')) / roofline:5.0%}"
            extra = ""
            if "load_s" in r:
                extra = f"  load {r['load_s']:5.2f} s ({r['load_s'] * 1e9 / size:4.2f} s/GB)"
                if not math.isnan(r.get("load_peak_mb", math.nan)):  # read where /proc/self/status is
                    grown = r["load_peak_mb"] - r["rss_before_mb"]
                    extra += f"  the load's peak {grown / 1e3:5.2f} GB ({grown * 1e6 / size:4.2f}x file)"
                extra += (f"  the run's peak RSS {r['peak_rss_mb'] / 1e3:5.2f} GB "
                          f"({r['peak_rss_mb'] * 1e6 / size:4.2f}x file; {r['rss_before_mb'] / 1e3:.2f} GB before load)")
            prefill = f"  pp{args.prefill} {r['prefill_tok_s']:7.1f}" if "prefill_tok_s" in r else ""
            print(f"  {r['engine']:15s} decode tok/s {decode}{share}{prefill}{extra}", flush=True)
        by = {r["engine"]: r for r in results if "error" not in r}
        for ours, peer in ((by[name], peer) for name, peer in _pairs(by)):
            ratios = "  ".join(f"b{b} {v / by[peer]['decode_tok_s'][b]:.2f}" for b, v in ours["decode_tok_s"].items()
                               if b in by[peer]["decode_tok_s"])
            pp = (f"  pp {ours['prefill_tok_s'] / by[peer]['prefill_tok_s']:.2f}"
                  if "prefill_tok_s" in ours and "prefill_tok_s" in by[peer] else "")
            print(f"  {ours['engine']} / {peer}: {ratios}{pp}")
        paired = paired_ratios(runs) if args.rounds > 1 else {}
        for name, per_round in paired.items():
            print(f"  {name} per round: {'  '.join(f'{v:.2f}' for v in per_round)}  median {statistics.median(per_round):.2f}")
        if token_bytes is not None:
            for engine, per_round in runs.items():
                shares = [token_bytes * r["decode_tok_s"][1] / (max(r["read_gbs"]) * 1e9) for r in per_round
                          if "error" not in r and 1 in r["decode_tok_s"]]
                if shares:
                    print(f"  {engine} b1 share of the read rate sampled beside it, per round: "
                          f"{'  '.join(f'{v:.0%}' for v in shares)}  median {statistics.median(shares):.0%}")
                meetings = [r["meeting_ns"] for r in per_round if None not in r.get("meeting_ns", [None])]
                if meetings:  # before/after the run: a pair that differs is a run the VM moved during
                    print(f"  {engine} threads' meeting before/after it, ns per round (~30-60: one die; ~170-300: two): "
                          f"{'  '.join(f'{b:.0f}/{a:.0f}' for b, a in meetings)}")
        report["models"].append({"model": model, "file_bytes": size, "token_bytes": token_bytes,
                                 "roofline_tok_s": roofline, "results": results, "rounds": runs,
                                 "paired_ratios": paired})
    report["load_avg_end"] = os.getloadavg()[0]
    from genfn.bench.results import write_results

    path = write_results("model", report, args.json)
    print(f"# results: {path}")
    return 0


def add_arguments(ap) -> None:
    ap.add_argument("--model", default=None, help="GGUF files or HF directories, comma-separated")
    ap.add_argument("--model-engines", default="genfn,llama.cpp",
                    help="with --model: genfn, genfn-compiled, genfn-coded, genfn-avx2, genfn-avx2-compiled, "
                         "llama.cpp (comma list)")
    ap.add_argument("--llama-bench", default=None, help="with --model: path of a llama-bench binary to run too")
    ap.add_argument("--llama-bench-args", default="", help="extra llama-bench flags, e.g. '-rtr 1' for ik_llama.cpp")
    ap.add_argument("--prefill", type=int, default=512, help="with --model: prompt length of the prefill test (0: none)")
    ap.add_argument("--rounds", type=int, default=1, help="with --model: child processes per engine, alternating")
    ap.add_argument("--timeout", type=int, default=3600, help="with --model: seconds per child process")


def from_decode_args(args) -> int:
    """``benchmarks/model_bench.py --model ...``: the parsed options, lists split."""
    args.models = [m.strip() for m in args.model.split(",") if m.strip()]
    args.engines = [e.strip() for e in args.model_engines.split(",") if e.strip()]
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown:
        raise ValueError(f"--model-engines: {', '.join(unknown)} unknown; choose among {', '.join(ENGINES)}")
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    return main(args)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--engine", default="genfn")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    parsed = ap.parse_args()
    if parsed.child:
        parsed.batches = [int(b) for b in parsed.batches.split(",") if b.strip()]
        print(json.dumps(child(parsed)), flush=True)
    else:
        sys.exit(from_decode_args(parsed))
