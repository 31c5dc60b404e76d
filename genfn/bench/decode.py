"""Decode speed: genfn against transformers and llama.cpp, side by side in one process, on SmolLM2-135M.

    python -m genfn.bench                            # float32 + bfloat16, batch 1 and 8, 128 tokens
    python -m genfn.bench --quick                    # float32, batch 1, 32 tokens, no transformers compile
    python -m genfn.bench --dtypes bfloat16 --batches 1 --new-tokens 64
    python -m genfn.bench --dtypes float32,bfloat16,q8_0,q4_1 --engines genfn-compiled,llama.cpp

(``python benchmarks/decode.py`` in a source checkout and ``genfn bench`` run the same.)

``--dtypes`` names weight formats: ``float32``/``bfloat16``, or a quantized one. ``q4_1`` is the
shipped GGUF file's own blocks (``genfn.load(quantize="gguf")``); ``q8_0``/``q4_0`` are files
made from it (``genfn.bench.llamacpp``), loaded the same way; ``int8``/``int4`` quantize the
float weights on load. transformers runs the float formats only.

Engines (all greedy, ``min_new_tokens = max_new_tokens`` so every row decodes the same count):

    hf            transformers ``generate`` with its defaults (dynamic cache, eager)
    hf-compiled   transformers static cache + ``torch.compile`` of the forward (``compile_config``
                  with ``_compile_all_devices``: transformers only auto-compiles on GPUs)
    genfn         genfn eager (the same pure step, run in a Python loop)
    genfn-compiled  genfn ``cache_implementation="static"``: the whole step compiled
    genfn-loop    genfn ``compile_loop=True``: the whole decoding loop as one ``while_loop`` graph
    llama.cpp     llama-cpp-python (the ``bench`` extra), greedy, all sequences in one
                  ``llama_decode`` per step, on the GGUF file of the same format (float32: F32,
                  bfloat16: F16); skipped when llama_cpp is not importable

Prints tok/s (best of ``--repeats`` timed runs after a warm-up, engines interleaved so machine
noise hits them alike), ratios genfn/transformers, first-call compile time (warm-up time minus
the steady time of the same call), the bandwidth roofline share at batch 1 (weight bytes per
token / the faster of ``tensor.sum()`` and ``torch.mv`` over 512 MiB), whether genfn's tokens
equal transformers', the per-token latency at a 100-token context for max_cache_len 4096 vs 256,
and the first-call times of a second process that finds the on-disk compile caches filled.

Run it on a quiet machine with OpenMP's default wait policy (threads spin briefly between
parallel regions): a decode step runs hundreds of short kernels, and ``OMP_WAIT_POLICY=PASSIVE``
(threads sleep at once) cost every engine 30-40 % here (genfn compiled f32: 37 -> 20 tok/s).
Only when other processes compete for the two cores does the default spin collapse (10-20x
slower GEMVs); then run ``OMP_WAIT_POLICY=PASSIVE python -m genfn.bench`` and compare
ratios only. The policy in effect is printed in the header (``genfn.wait_policy``: a library
import of genfn sets none; ``genfn bench`` and ``benchmarks/decode.py`` keep OpenMP's).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import os
import sys
import time
import warnings

from pathlib import Path

import torch

from genfn.bench import llamacpp

PROMPTS = [
    "The history of the Roman Empire is long and complicated. It began when Augustus became the first "
    "emperor, and over the following centuries",
    "Photosynthesis is the process by which green plants use sunlight to make food. In this short "
    "explanation we will look at",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    "To install the package, first make sure that Python is available on your system. Then open a "
    "terminal and",
    "The three most important things to remember when learning a new language are",
    "Water boils at one hundred degrees Celsius at sea level, but at higher altitudes the boiling point",
    "In mathematics, a prime number is a natural number greater than one that",
    "The recipe calls for two cups of flour, one cup of sugar, three eggs and a pinch of salt. Start by",
]
LONG_CONTEXT = 100
COMPILED_ENGINES = ("hf-compiled", "genfn-compiled", "genfn-loop")
FLOAT_FORMATS = ("float32", "bfloat16")
# Weight format -> the ggml type of the GGUF file llama.cpp (and genfn's "gguf" load) reads.
GGUF_TYPE_OF = {"float32": "F32", "bfloat16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}


@dataclasses.dataclass
class Result:
    engine: str
    dtype: str
    batch: int
    first_call_s: float | None = None
    times: list = dataclasses.field(default_factory=list)
    tokens: torch.Tensor | None = None
    error: str | None = None
    new_tokens: int = 0

    @property
    def best(self) -> float | None:
        return min(self.times) if self.times else None

    @property
    def tok_s(self) -> float | None:
        return None if self.best is None else self.batch * self.new_tokens / self.best


def log(*args):
    print(*args, flush=True)


def read_bandwidth_gbs(mib: int = 512, repeats: int = 7) -> tuple[float, float]:
    """Best-of-N read bandwidth over a buffer far larger than the caches, in GB/s: through
    ``tensor.sum()`` and through ``torch.mv`` (a GEMV of the same bytes, the kernel decoding runs).
    The buffer lies on huge pages where the weight arena has them, as genfn's weights do: on 4 KiB
    pages a 2-core Xeon's ``tensor.sum`` read 24.6 GB/s against 32.1 (``torch.mv`` 31.6 against 32.8)."""
    from genfn.models.weight_arena import WeightArena

    big = WeightArena().empty((mib * 1024 * 1024 // 4,), torch.float32).fill_(1.0)
    matrix, vector = big.view(-1, 1024), torch.ones(1024)

    def best(fn):
        fn()
        fastest = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            fastest = min(fastest, time.perf_counter() - t)
        return mib * 1024 * 1024 / fastest / 1e9

    rates = best(big.sum), best(lambda: torch.mv(matrix, vector))
    del big, matrix
    return rates


def thread_meeting_ns(meetings: int = 20000) -> float | None:
    """Nanoseconds a meeting of torch's intra-op threads at the decode kernels' barrier takes (best of
    three runs; None without the native kernels): how far apart the cores they run on sit. On sessions
    23-35's 2-core Zen 5 VM it read ~30-60 ns in some minutes and ~170-300 in others: the two vCPUs sat
    on one die, or on two. On two each die reads memory through its own link (``tensor.sum`` ~90
    against ~55 GB/s), so a one-row step, which streams its weights, runs faster, and every cache
    line that one thread writes and the other reads costs several times as much, so the few-row
    steps, which are bound by arithmetic and pass lines between the threads at each meeting, run
    slower (SmolLM2 Q4_1's 8-row stack 2.6-2.7 ms against ~2.0)."""
    from genfn.kernels import decode_linear_available

    if not decode_linear_available():
        return None
    return float(torch.ops.genfn_kernels.barrier_meeting_ns(meetings))


def weight_bytes_per_token(model) -> int:
    """Bytes of weights a batch-1 decode step streams: every matrix once (tied head counted once),
    the embedding table only when it is not also the LM head (then one row is read, ~0)."""
    params = model.params
    seen, total = set(), 0
    leaves = torch.utils._pytree.tree_leaves({k: v for k, v in params.items() if k != "embed"})
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _huge_page_share(model) -> str:
    """How much of the model's weight arena the kernel backed with huge pages (genfn.models.weight_arena)."""
    from genfn.models.weight_arena import huge_page_bytes
    from genfn.state.base import tree_flatten

    tensors = {t.data_ptr(): t for t in tree_flatten(model.params)[0] if isinstance(t, torch.Tensor)}.values()
    total = sum(t.untyped_storage().nbytes() for t in tensors)
    return (f"weights on huge pages: {huge_page_bytes(next(iter(tensors))) / 2 ** 20:.0f} of "
            f"{total / 2 ** 20:.0f} MiB")


def batch_inputs(tokenizer, batch: int, pad_id: int, min_len: int | None = None):
    """Left-padded ids and mask for the first ``batch`` prompts (each repeated up to ``min_len`` tokens)."""
    rows = []
    for i in range(batch):
        ids = tokenizer.encode(PROMPTS[i % len(PROMPTS)])
        if min_len is not None:
            while len(ids) < min_len:
                ids = ids + tokenizer.encode(" " + PROMPTS[(i + len(ids)) % len(PROMPTS)])
            ids = ids[:min_len]
        rows.append(ids)
    width = max(len(r) for r in rows)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.int64)
    mask = torch.zeros((batch, width), dtype=torch.int64)
    for i, r in enumerate(rows):
        input_ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return input_ids, mask


def _show_kernel_builds() -> None:
    """Print genfn.kernels' status (a first build of the native kernels takes minutes) in the log."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("# %(name)s: %(message)s"))
    kernels_logger = logging.getLogger("genfn.kernels")
    kernels_logger.addHandler(handler)
    kernels_logger.setLevel(logging.INFO)


def _pad_id(model) -> int:
    """The padding id of a model given with --model: its own, else its (first) EOS, else 0."""
    config = model.generation_config
    for value in (config.pad_token_id, config.eos_token_id):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def first_mismatch(a: torch.Tensor, b: torch.Tensor, prompt_len: int) -> str:
    if a.shape != b.shape:
        return f"shapes differ {tuple(a.shape)} vs {tuple(b.shape)}"
    diff = (a != b).any(0).nonzero()
    if len(diff) == 0:
        return "equal"
    rows = int((a != b).any(1).sum())
    return f"DIFFER from new token {int(diff[0]) - prompt_len} ({rows}/{a.shape[0]} rows)"


def main(argv=None):
    # The benchmark is a program: its tokenizer threads must not fork-warn under its child processes.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ap = argparse.ArgumentParser(prog="python -m genfn.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="a GGUF file or a transformers directory (default: the embedded SmolLM2); quantized "
                         "formats and llama.cpp need a GGUF file")
    ap.add_argument("--quick", action="store_true", help="float32, batch 1, 32 tokens, 1 repeat, no hf-compiled")
    ap.add_argument("--dtypes", default="float32,bfloat16,q8_0,q4_1",
                    help="weight formats: float32, bfloat16, q8_0, q4_0, q4_1 (the shipped file's), int8, int4")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per engine after the warm-up")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile-mode", default="max-autotune-no-cudagraphs",
                    help="torch.compile mode for hf-compiled ('default' for none)")
    ap.add_argument("--genfn-compile-mode", default="auto",
                    help="compile_config mode for genfn's compiled engines; 'auto' (default) passes no "
                         "compile_config, i.e. genfn's CPU default: max-autotune options + the C++ wrapper")
    ap.add_argument("--engines", default="hf,hf-compiled,genfn,genfn-compiled,genfn-loop,llama.cpp")
    ap.add_argument("--json", default=None, help="where to write the results (default: genfn.bench.results.results_dir()/decode-<time>.json)")
    ap.add_argument("--no-second-process", action="store_true",
                    help="skip timing the first call of a fresh process that reuses the on-disk compile cache")
    ap.add_argument("--no-latency", action="store_true", help="skip the max_cache_len 4096 vs 256 latency check")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--latency-dtypes", default=None, help="dtypes for the latency check (default: the first)")
    args = ap.parse_args(argv)
    if args.quick:
        args.dtypes = "float32" if args.dtypes == ap.get_default("dtypes") else args.dtypes
        args.batches = "1" if args.batches == ap.get_default("batches") else args.batches
        args.new_tokens = 32 if args.new_tokens == ap.get_default("new_tokens") else args.new_tokens
        args.repeats = 1 if args.repeats == ap.get_default("repeats") else args.repeats
        if args.engines == ap.get_default("engines"):
            args.engines = "hf,genfn,genfn-compiled"

    gguf_only = [d for d in args.dtypes.split(",") if d.strip() in GGUF_TYPE_OF and d.strip() not in FLOAT_FORMATS]
    if args.model and not args.model.endswith(".gguf") and gguf_only:
        ap.error(f"--dtypes {','.join(gguf_only)} read a GGUF file's blocks; --model {args.model} is not one "
                 f"(int8/int4 quantize any model on load)")
    warnings.filterwarnings("ignore")
    _show_kernel_builds()
    torch.set_num_threads(args.threads)
    import genfn
    import genfn.quant
    import transformers
    from transformers import AutoModelForCausalLM
    from genfn.default_model import default_model_path

    transformers.logging.set_verbosity_error()
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    except Exception:
        pass

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in FLOAT_FORMATS + tuple(genfn.quant.FORMATS)]
    if unknown:
        ap.error(f"unknown --dtypes {unknown}; choose from {FLOAT_FORMATS + tuple(genfn.quant.FORMATS)}")
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    latency_dtypes = args.latency_dtypes.split(",") if args.latency_dtypes else dtypes[:1]
    if "llama.cpp" in engines and not llamacpp.available():
        log("# llama_cpp is not importable (the bench extra installs it): llama.cpp skipped")
        engines.remove("llama.cpp")
    N = args.new_tokens
    mode = None if args.compile_mode == "default" else args.compile_mode
    genfn_mode = None if args.genfn_compile_mode == "auto" else args.genfn_compile_mode

    log(f"# genfn decode benchmark  torch {torch.__version__}  transformers {transformers.__version__}  "
        f"threads {torch.get_num_threads()}  OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}  "
        f"load avg {os.getloadavg()[0]:.1f}")
    log(f"# {N} greedy tokens, batches {batches}, formats {dtypes}, engines {engines}, "
        f"compile mode hf {args.compile_mode}, genfn {args.genfn_compile_mode}, best of {args.repeats} after a warm-up")
    sum_rate, mv_rate = read_bandwidth_gbs()
    bandwidth = max(sum_rate, mv_rate)
    log(f"# read bandwidth over 512 MiB, best of 7: tensor.sum() {sum_rate:.1f} GB/s, torch.mv {mv_rate:.1f} GB/s; "
        f"the roofline uses the larger")

    path = args.model or default_model_path()
    is_gguf = path.endswith(".gguf")
    results: list[Result] = []
    latency_rows = []
    roofline: dict[str, float] = {}  # format -> batch-1 bandwidth roofline, tok/s
    weight_mb: dict[str, tuple] = {}  # format -> (genfn's, llama.cpp file's) weight MB per token
    t_start = time.perf_counter()

    for dname in dtypes:
        is_float = dname in FLOAT_FORMATS
        dtype = getattr(torch, dname) if is_float else torch.float32
        gguf_type = GGUF_TYPE_OF.get(dname)
        # A float format's GGUF variant is llama.cpp's input only: made (minutes, once) when it runs.
        wants_file = gguf_type is not None and is_gguf and (not is_float or "llama.cpp" in engines)
        gguf_file = llamacpp.variant_path(path, gguf_type) if wants_file else None
        t_load = time.perf_counter()
        if is_float:
            model = genfn.load(path, dtype=dtype)
        elif gguf_type is not None:
            model = genfn.load(gguf_file, quantize="gguf")
        else:
            model = genfn.load(path, quantize=dname)
        log(f"\n# loaded genfn {dname} in {time.perf_counter() - t_load:.1f} s; {_huge_page_share(model)}")
        tok = model.tokenizer
        pad_id = 2 if args.model is None else _pad_id(model)
        hf = None
        runner = None
        format_engines = [e for e in engines if is_float or not e.startswith("hf")]
        if "llama.cpp" in format_engines and gguf_file is None:
            format_engines.remove("llama.cpp")
        if "llama.cpp" in format_engines:
            prompt_max = max(len(tok.encode(p)) for p in PROMPTS)
            runner = llamacpp.LlamaCpp(gguf_file, args.threads, max(batches), prompt_max + N + 8)
        if any(e.startswith("hf") for e in format_engines):
            with contextlib.redirect_stderr(open(os.devnull, "w")):
                hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                          dtype=dtype) if is_gguf else \
                    AutoModelForCausalLM.from_pretrained(path,
                                                          dtype=dtype)
            hf.eval()
        wbytes = weight_bytes_per_token(model)
        roofline[dname] = bandwidth * 1e9 / wbytes
        file_bytes = llamacpp.file_weight_bytes(gguf_file) if gguf_file is not None else None
        weight_mb[dname] = (wbytes / 1e6, None if file_bytes is None else file_bytes / 1e6)
        log(f"\n## {dname}: weight bytes per token {wbytes / 1e6:.0f} MB -> roofline "
            f"{bandwidth * 1e9 / wbytes:.1f} tok/s at batch 1"
            + ("" if file_bytes is None else f"; llama.cpp's file {Path(gguf_file).name}: {file_bytes / 1e6:.0f} MB"))

        for batch in batches:
            input_ids, mask = batch_inputs(tok, batch, pad_id)
            prompt_len = input_ids.shape[1]
            max_cache_len = max(256, prompt_len + N)

            def call(engine, new_tokens):
                common = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=pad_id)
                if engine == "llama.cpp":
                    return torch.tensor(runner.generate(prompt_ids, new_tokens))
                with torch.no_grad():
                    if engine == "hf":
                        return hf.generate(input_ids, **common)
                    if engine == "hf-compiled":
                        cc = transformers.CompileConfig(fullgraph=True, mode=mode or "default")
                        cc._compile_all_devices = True  # transformers compiles only on GPUs otherwise
                        return hf.generate(input_ids, cache_implementation="static", compile_config=cc, **common)
                    if engine == "genfn":
                        return genfn.generate(model, input_ids, **common)
                    if engine in ("genfn-compiled", "genfn-loop"):
                        extra = {}
                        if genfn_mode is not None:
                            extra["compile_config"] = genfn.CompileConfig(fullgraph=True, mode=genfn_mode)
                        if engine == "genfn-loop":
                            extra["compile_loop"] = True
                        return genfn.generate(model, input_ids, cache_implementation="static",
                                              max_cache_len=max_cache_len, **common, **extra)
                raise ValueError(engine)

            prompt_ids = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(batch)]
            rows = {e: Result(e, dname, batch, new_tokens=N) for e in format_engines}
            # Warm-up: the first call of each engine (compiles where it compiles).
            for e in format_engines:
                t = time.perf_counter()
                try:
                    out = call(e, N)
                    rows[e].first_call_s = time.perf_counter() - t
                    rows[e].tokens = out
                except Exception as exc:  # keep going: report the failure in the table
                    rows[e].error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"
                    log(f"  {e} b={batch} FAILED: {rows[e].error}")
            for r in range(args.repeats):
                for e in format_engines:
                    if rows[e].error:
                        continue
                    gc.collect()
                    t = time.perf_counter()
                    out = call(e, N)
                    rows[e].times.append(time.perf_counter() - t)
            for e in format_engines:
                res = rows[e]
                results.append(res)
                if res.error:
                    continue
                compile_s = res.first_call_s - res.best
                log(f"  {dname} b={batch} {e:15s} {res.tok_s:7.1f} tok/s   first call {res.first_call_s:6.1f} s "
                    f"(~{max(compile_s, 0):.0f} s compile/warm-up)")
            cpp, ours = rows.get("llama.cpp"), rows.get("genfn-compiled") or rows.get("genfn")
            if cpp is not None and cpp.tokens is not None and ours is not None and ours.tokens is not None:
                log(f"    new tokens {ours.engine} vs llama.cpp: "
                    f"{first_mismatch(ours.tokens[:, prompt_len:], cpp.tokens, 0)}")
            ref = rows.get("hf")
            if ref is not None and ref.tokens is not None:
                for e in format_engines:
                    if e.startswith("genfn") and rows[e].tokens is not None:
                        log(f"    tokens {e} vs hf: {first_mismatch(rows[e].tokens, ref.tokens, prompt_len)}")
                if "hf-compiled" in rows and rows["hf-compiled"].tokens is not None:
                    log(f"    tokens hf-compiled vs hf: "
                        f"{first_mismatch(rows['hf-compiled'].tokens, ref.tokens, prompt_len)}")

        if not args.no_latency and dname in latency_dtypes and "genfn-compiled" in engines:
            latency_rows += latency_check(genfn, model, tok, pad_id, genfn_mode, args.repeats + 1)
        if runner is not None:
            runner.close()
        del model, hf, runner
        gc.collect()

    # ---- summary
    log("\n## summary (tok/s; ratios > 1 mean genfn is faster)")
    log(f"{'format':9s} {'batch':>5s} " + " ".join(f"{e:>15s}" for e in engines)
        + "   genfn-c/hf  genfn-c/hf-c  genfn/hf  genfn-c/llama.cpp  genfn/llama.cpp  roofline(b=1)"
        "  MB/token genfn, llama.cpp")
    by = {(r.dtype, r.batch, r.engine): r for r in results}
    for dname in dtypes:
        for batch in batches:
            cells = []
            for e in engines:
                r = by.get((dname, batch, e))
                cells.append(f"{r.tok_s:15.1f}" if r is not None and r.tok_s else
                             f"{'failed' if r is not None else '-':>15s}")

            def ratio(a, b):
                ra, rb = by.get((dname, batch, a)), by.get((dname, batch, b))
                if ra is None or rb is None or not ra.tok_s or not rb.tok_s:
                    return "     -"
                return f"{ra.tok_s / rb.tok_s:6.2f}"

            roof = ""
            gc_row = by.get((dname, batch, "genfn-compiled"))
            if batch == 1 and gc_row is not None and gc_row.tok_s and dname in roofline:
                roof = f"{gc_row.tok_s / roofline[dname]:6.0%}"
            ours_mb, cpp_mb = weight_mb.get(dname, (None, None))
            log(f"{dname:9s} {batch:5d} " + " ".join(cells)
                + f"   {ratio('genfn-compiled', 'hf'):>10s}  {ratio('genfn-compiled', 'hf-compiled'):>12s}"
                  f"  {ratio('genfn', 'hf'):>8s}  {ratio('genfn-compiled', 'llama.cpp'):>17s}  {ratio('genfn', 'llama.cpp'):>15s}"
                  f"  {roof:>13s}"
                  f"  {ours_mb or 0:8.0f}, {cpp_mb or 0:.0f}")
    log("first-call seconds (compile + warm-up): " + ", ".join(
        f"{r.engine}/{r.dtype}/b{r.batch}={r.first_call_s:.0f}" for r in results
        if r.first_call_s is not None and r.engine in COMPILED_ENGINES))
    for row in latency_rows:
        log(row)
    compiled_engines = [e for e in engines if e in COMPILED_ENGINES]
    if compiled_engines and not args.no_second_process and not args.child:
        second_process(args, compiled_engines, dtypes[0], batches[0])
    log(f"# total {time.perf_counter() - t_start:.0f} s, load avg {os.getloadavg()[0]:.1f}")
    if not args.child:
        write_json(args, results, weight_mb, bandwidth)


def write_json(args, results, weight_mb, bandwidth):
    from genfn.bench.results import write_results

    payload = {
        "args": vars(args), "torch": torch.__version__, "threads": args.threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "load_avg_end": os.getloadavg()[0],
        "read_bandwidth_gbs": bandwidth, "weight_mb_per_token": weight_mb,
        "results": [{"engine": r.engine, "format": r.dtype, "batch": r.batch, "tok_s": r.tok_s,
                     "first_call_s": r.first_call_s, "times_s": r.times, "error": r.error} for r in results],
    }
    log(f"# wrote {write_results('decode', payload, args.json)}")


def second_process(args, engines, dtype, batch):
    """First-call times in a fresh process, whose compiles can reuse inductor's on-disk caches
    (FX graph and autotune caches) filled by this one; dynamo still traces anew."""
    import subprocess

    cmd = [sys.executable, "-m", "genfn.bench", "--child", "--no-latency", "--repeats", "1",
           "--engines", ",".join(engines), "--dtypes", str(dtype).split(".")[-1], "--batches", str(batch),
           "--new-tokens", str(args.new_tokens), "--threads", str(args.threads), "--compile-mode", args.compile_mode,
           "--genfn-compile-mode", args.genfn_compile_mode]
    log(f"\n## second process (reuses the on-disk compile cache): {' '.join(cmd[3:])}")
    t = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        log("  second process timed out after 1800 s")
        return
    for line in done.stdout.splitlines():
        if "first call" in line:
            log("  " + line.strip())
    if done.returncode != 0:
        log(f"  second process failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    log(f"  second process wall time {time.perf_counter() - t:.0f} s (model loads included)")


def latency_check(genfn, model, tok, pad_id, mode, repeats):
    """Per-token latency of the compiled step at a 100-token context, max_cache_len 4096 vs 256.

    latency = (time(generate 33 tokens) - time(generate 1 token)) / 32: the prefill cancels out.
    """
    input_ids, mask = batch_inputs(tok, 1, pad_id, min_len=LONG_CONTEXT)
    extra = {} if mode is None else {"compile_config": genfn.CompileConfig(fullgraph=True, mode=mode)}
    k = 32
    out = []

    def gen(T, n, compiled=True):
        kw = dict(cache_implementation="static", max_cache_len=T, **extra) if compiled else dict(max_cache_len=T)
        t = time.perf_counter()
        with torch.no_grad():
            genfn.generate(model, input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=pad_id, **kw)
        return time.perf_counter() - t

    first = {}
    for T in (256, 4096):
        first[T] = gen(T, k + 1)
    best = {}
    for _ in range(repeats):
        for T in (256, 4096):
            per_tok = (gen(T, k + 1) - gen(T, 1)) / k
            best[T] = min(best.get(T, float("inf")), per_tok)
    dname = str(model.dtype).split(".")[-1]
    out.append(f"latency {dname} b=1 context {LONG_CONTEXT}: genfn-compiled {best[256] * 1e3:.1f} ms/token at "
               f"max_cache_len 256, {best[4096] * 1e3:.1f} ms/token at 4096 (ratio {best[4096] / best[256]:.2f}; "
               f"first call at 4096: {first[4096]:.0f} s)")
    return out


if __name__ == "__main__":
    sys.exit(main())
