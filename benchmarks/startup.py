"""Start-up time: how long a new process takes to reach its first compiled token, cold and warm.

    flock /tmp/genfn-bench.lock timeout 900 python benchmarks/startup.py                 # float32 and q4_1
    flock /tmp/genfn-bench.lock timeout 900 python benchmarks/startup.py --formats q4_1
    flock /tmp/genfn-bench.lock timeout 900 python benchmarks/startup.py --formats q4_1 --freezing on  # the old way
    flock /tmp/genfn-bench.lock timeout 900 python benchmarks/startup.py --paths eager   # `genfn generate`'s default

For each weight format (``float32``: the embedded SmolLM2 inflated to float32; ``q4_1``: the
GGUF file's own Q4_1 blocks, ``genfn.load(quantize="gguf")``) it runs two fresh processes on one
fresh temporary cache directory (inductor's ``TORCHINDUCTOR_CACHE_DIR`` and genfn's
``GENFN_KERNEL_CACHE``):

    cold   nothing cached: kernel build, dynamo trace, inductor compile (C++ codegen + g++)
    warm   a second process on the caches the first one filled: what a user sees every later run

Each child process times, from its own start: ``import genfn``, ``genfn.load``, the native kernel
build or load, the import of dynamo and inductor (compiled path; ``import genfn`` leaves them out),
and ``genfn.generate(..., cache_implementation="static", max_new_tokens=2)`` (the first compiled
step yields the second token; ``--paths eager``: the same call on the dynamic cache, nothing
compiled, which is what ``genfn generate`` runs without ``--compile``; ``--paths eager-static``: the static
cache with ``disable_compile=True``), then the steady time of that same call, so
"first token" minus "steady" is what compiling cost. The child also counts recompiles and records
the ``genfn.*`` log lines with their times. Tokens of the cold and warm processes are compared
(the same compiled step must give the same tokens). Prints a table and writes JSON to
``benchmarks/results/startup-<date>.json``.
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("float32", "bfloat16", "q4_1")
PROMPT = "The history of the Roman Empire is long and complicated. It began when"
CHILD_TIMEOUT_S = 900


def _compile_breakdown() -> list[dict]:
    """Per dynamo frame compile: where its seconds went (dynamo trace, AOT autograd, inductor and its
    code generation, autotuning, guards) and whether the on-disk caches answered."""
    import torch._dynamo.utils

    def seconds(value):
        return None if value is None else round(value / 1e6, 2)

    rows = []
    for m in torch._dynamo.utils.get_compilation_metrics():
        rows.append({
            "frame": m.co_name, "entire_s": m.entire_frame_compile_time_s,
            "dynamo_s": seconds(m.dynamo_cumulative_compile_time_us),
            "aot_autograd_s": seconds(m.aot_autograd_cumulative_compile_time_us),
            "inductor_s": seconds(m.inductor_cumulative_compile_time_us),
            "code_gen_s": seconds(m.inductor_code_gen_cumulative_compile_time_us),
            "autotune_s": seconds(m.compile_time_autotune_time_us),
            "pre_grad_s": seconds(m.pre_grad_pass_time_us), "post_grad_s": seconds(m.post_grad_pass_time_us),
            "guards": m.guard_count, "graph_ops": m.graph_op_count,
            "fx_cache_hits": m.inductor_fx_local_cache_hit_count, "fx_cache_misses": m.inductor_fx_local_cache_miss_count,
            "aot_cache_hits": m.aotautograd_local_cache_hit_count,
            "aot_cache_misses": m.aotautograd_local_cache_miss_count,
        })
    return rows


def child(fmt: str, new_tokens: int, freezing: str, options: dict, path: str = "compiled") -> dict:
    """Runs in the measured process: phase times from process start, as a dict (printed as JSON)."""
    import logging

    phases = {}
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append((round(time.perf_counter() - PROCESS_START, 2), record.name, record.getMessage()))

    t = time.perf_counter()
    import genfn
    import torch
    logging.getLogger("genfn").addHandler(Collect())
    logging.getLogger("genfn").setLevel(logging.INFO)
    phases["import_s"] = time.perf_counter() - t

    t = time.perf_counter()
    model = genfn.load(quantize="gguf") if fmt == "q4_1" else genfn.load(dtype=getattr(torch, fmt))
    phases["load_s"] = time.perf_counter() - t

    from genfn import kernels
    t = time.perf_counter()
    kernels.decode_linear_available()
    phases["kernels_s"] = time.perf_counter() - t
    phases["kernel_status"] = kernels.kernel_status()

    ids = torch.tensor([model.tokenizer.encode(PROMPT)])
    phases["compiler_modules_before"] = sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
    t = time.perf_counter()
    if path == "compiled":
        import torch._dynamo.utils  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
    phases["compiler_import_s"] = time.perf_counter() - t
    cache = {"cache_implementation": "static", "max_cache_len": 128} if path != "eager" else {}
    if path == "eager-static":
        cache["disable_compile"] = True

    extra = {}
    if freezing != "auto" or options:
        # genfn's CPU options with freezing forced or options overridden, for an A/B of the compile.
        from genfn.compile_boundary import _CPU_COMPILE_OPTIONS
        forced = {} if freezing == "auto" else {"freezing": freezing == "on"}
        extra["compile_config"] = genfn.CompileConfig(fullgraph=True, mode=None,
                                                      options={**_CPU_COMPILE_OPTIONS, **options, **forced})

    def generate(n):
        with torch.no_grad():
            return genfn.generate(model, ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=2, **cache, **extra)

    t = time.perf_counter()
    first = generate(2)
    phases["first_token_call_s"] = time.perf_counter() - t
    phases["first_token_since_start_s"] = time.perf_counter() - PROCESS_START
    phases["compile_breakdown"] = _compile_breakdown() if "torch._dynamo" in sys.modules else []
    # CPU seconds, which a busy machine stretches less than wall time: this process's own (dynamo,
    # AOT autograd, inductor) and its finished children's (g++ of the kernels and the wrapper).
    import resource
    phases["self_cpu_s"] = round(sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), 1)
    phases["children_cpu_s"] = round(sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2]), 1)
    steady = []
    for _ in range(3):
        t = time.perf_counter()
        generate(2)
        steady.append(time.perf_counter() - t)
    phases["steady_call_s"] = min(steady)
    tokens = generate(new_tokens)
    phases["compiler_modules_after"] = sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
    counters = sys.modules["torch._dynamo.utils"].counters if "torch._dynamo.utils" in sys.modules else {}
    phases["recompiles"] = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
    phases["graph_breaks"] = sum(counters["graph_break"].values()) if "graph_break" in counters else 0
    phases["unique_graphs"] = counters["stats"].get("unique_graphs", 0) if "stats" in counters else 0
    phases["inductor"] = {k: v for k, v in counters.get("inductor", {}).items() if "cache" in k or "fxgraph" in k}
    phases["aot_autograd"] = {k: v for k, v in counters.get("aot_autograd", {}).items() if "cache" in k}
    phases["first_tokens"] = first[0, ids.shape[1]:].tolist()
    phases["tokens"] = tokens[0, ids.shape[1]:].tolist()
    phases["log"] = records
    phases["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    phases["gomp_spincount"] = os.environ.get("GOMP_SPINCOUNT")
    return phases


def run_child(fmt: str, new_tokens: int, cache: Path, freezing: str, options: str, genfn_root: Path,
              path: str = "compiled") -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), GENFN_KERNEL_CACHE=str(cache / "kernels"),
               PYTHONPATH=str(genfn_root) + os.pathsep + os.environ.get("PYTHONPATH", ""), TOKENIZERS_PARALLELISM="false")
    t = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", fmt, "--new-tokens", str(new_tokens),
                           "--freezing", freezing, "--options", options, "--paths", path], env=env,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-5:], "wall_s": wall}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    return result


def _parse_options(text: str) -> dict:
    options = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--options: {item!r} is not KEY=VALUE")
        options[key] = {"0": False, "1": True, "false": False, "true": True}.get(value.lower(), value)
    return options


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="float32,q4_1", help=f"comma-separated, from {FORMATS}")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens of the cold/warm equality check")
    ap.add_argument("--paths", default="compiled",
                    help="comma-separated, from compiled (static cache, torch.compile), eager (genfn generate's "
                         "default) and eager-static (the static cache, disable_compile=True)")
    ap.add_argument("--warm-only", action="store_true",
                    help="skip the cold process: reuse --cache-dir (a previous run's caches) for the warm one")
    ap.add_argument("--cache-dir", default=None, help="cache directory to use (default: a fresh temporary one)")
    ap.add_argument("--freezing", default="auto", choices=("auto", "on", "off"),
                    help="auto: genfn's per-graph choice; on/off: forced (an A/B of the compile times)")
    ap.add_argument("--options", default="",
                    help="inductor options over genfn's CPU ones, e.g. max_autotune=0,cpp_wrapper=1 (an A/B)")
    ap.add_argument("--genfn-root", default=str(ROOT),
                    help="checkout whose genfn the measured processes import (default this one): a before/after")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.new_tokens, args.freezing, _parse_options(args.options), args.paths)))
        return 0
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        ap.error(f"unknown --formats {unknown}; choose from {FORMATS}")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths or set(paths) - {"compiled", "eager", "eager-static"}:
        ap.error(f"--paths {args.paths!r}: choose from compiled, eager, eager-static")

    def log(line=""):
        print(line, flush=True)

    log(f"# genfn start-up benchmark  uptime: {os.popen('uptime').read().strip()}")
    # PYTHONDONTWRITEBYTECODE=1 makes every process compile genfn's sources again (~0.4 s of "import").
    log(f"# OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}  GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}  "
        f"PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE')}  "
        f"cpus {os.cpu_count()}  freezing {args.freezing}  options {_parse_options(args.options) or 'genfn default'}  "
        f"genfn from {args.genfn_root}")
    rows = []
    for path, fmt in ((path, fmt) for path in paths for fmt in formats):
        if args.cache_dir:
            cache = Path(args.cache_dir) / fmt
            cache.mkdir(parents=True, exist_ok=True)
            holder = None
        else:
            holder = tempfile.TemporaryDirectory(prefix="genfn-startup-")
            cache = Path(holder.name)
        runs = {}
        for phase in (("warm",) if args.warm_only else ("cold", "warm")):
            runs[phase] = run_child(fmt, args.new_tokens, cache, args.freezing, args.options, Path(args.genfn_root),
                                    path)
            r = runs[phase]
            if "error" in r:
                log(f"{fmt:8s} {path} {phase}: FAILED after {r['wall_s']:.0f} s: {r['error']}")
                continue
            log(f"{fmt:8s} {path} {phase}: first token {r['first_token_since_start_s']:6.1f} s after start "
                f"(import {r['import_s']:.1f}, load {r['load_s']:.1f}, kernels {r['kernels_s']:.1f}, "
                f"dynamo+inductor import {r['compiler_import_s']:.1f}, "
                f"generate {r['first_token_call_s']:.1f} of which steady {r['steady_call_s']:.2f}); "
                f"cpu: own {r['self_cpu_s']} s, g++ and other children {r['children_cpu_s']} s; "
                f"recompiles {r['recompiles']}, graphs {r['unique_graphs']}, breaks {r['graph_breaks']}; "
                f"inductor {r['inductor']} aot {r['aot_autograd']}")
            for when, name, message in r["log"]:
                log(f"           {when:7.2f} s  {name}: {message}")
            for frame in r.get("compile_breakdown", []):
                log(f"           compile of {frame['frame']}: " + ", ".join(
                    f"{key} {value}" for key, value in frame.items() if key != "frame" and value not in (None, 0)))
        if "cold" in runs and "warm" in runs and "tokens" in runs["cold"] and "tokens" in runs["warm"]:
            same = runs["cold"]["tokens"] == runs["warm"]["tokens"]
            log(f"{fmt:8s} {path} cold and warm tokens {'equal' if same else 'DIFFER'}")
            runs["tokens_equal"] = same
        rows.append({"format": fmt, "path": path, **runs})
        if holder is not None:
            holder.cleanup()
    for fmt in formats:
        by_path = {row["path"]: row.get("warm", {}).get("tokens") for row in rows if row["format"] == fmt}
        if by_path.get("eager") and by_path.get("compiled"):
            log(f"{fmt:8s} eager and compiled tokens {'equal' if by_path['eager'] == by_path['compiled'] else 'DIFFER'}")
    log(f"# uptime at end: {os.popen('uptime').read().strip()}")
    log()
    log("| format | path | cold: first token | warm second process: first token | steady 2-token call |")
    log("|---|---|---|---|---|")
    for row in rows:
        cold, warm = row.get("cold", {}), row.get("warm", {})
        fmt_s = lambda r, key: f"{r[key]:.1f} s" if key in r else "—"  # noqa: E731
        log(f"| {row['format']} | {row['path']} | {fmt_s(cold, 'first_token_since_start_s')} | "
            f"{fmt_s(warm, 'first_token_since_start_s')} | {fmt_s(warm, 'steady_call_s')} |")
    from genfn.bench.results import write_results  # here: the child times its own ``import genfn``

    out = write_results("startup", {"args": vars(args), "load_avg": os.getloadavg(), "rows": rows}, args.out)
    log(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
