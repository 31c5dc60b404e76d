"""Where a compiled decode step's time goes: guards, the linears, the rest of the graph, the driver.

    python benchmarks/step_profile.py --dtype q8_0 --batch 1
    flock /tmp/genfn-bench.lock timeout 600 python benchmarks/step_profile.py --dtype float32 --batch 8 --no-warm
    python benchmarks/step_profile.py --model /work/models-tmp/llama-1b-q4_k_m.gguf

``--model``: a GGUF file loaded with ``quantize="gguf"`` instead of SmolLM2 in ``--dtype``; each
native op's time per step is printed too (the fused layer's two calls, the K-quant LM head).

Runs ``genfn.generate(cache_implementation="static")`` on SmolLM2 (greedy, ``--new-tokens``
tokens), once to compile (untimed) and then under ``torch.profiler``, and splits the wall time of
a step into: dynamo's cache lookup (guard evaluation), the compiled region, within it the native
linears (``genfn_kernels::decode_linear`` / ``quant_linear``) and everything else the graph runs,
and what the driver does outside the compiled region. Prints ms per step for each, and the
OpenMP wait policy in effect (it is chosen once per process: run it once per policy to compare).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from genfn.bench.decode import GGUF_TYPE_OF, FLOAT_FORMATS, batch_inputs  # noqa: E402
from genfn.bench import llamacpp  # noqa: E402

# The native ops a step runs: the linears, and the fused layers that hold their own linears.
_NATIVE_OPS = ("genfn_kernels::decode_linear", "genfn_kernels::quant_linear", "genfn_kquant::kquant_linear",
               "genfn_kernels::decode_stack", "genfn_kernels::decode_stack_paged",
               *(f"genfn_kernels::decode_{half}{form}" for half in ("attention_input", "layer_output")
                 for form in ("", "_quant", "_kquant")))


def load(dname: str, path: str | None = None):
    import genfn
    from genfn.default_model import default_model_path

    if path is not None:
        return genfn.load(path, quantize="gguf")
    if dname in FLOAT_FORMATS:
        return genfn.load(dtype=getattr(torch, dname))
    gguf_type = GGUF_TYPE_OF.get(dname)
    if gguf_type is not None:
        return genfn.load(llamacpp.variant_path(default_model_path(), gguf_type), quantize="gguf")
    return genfn.load(quantize=dname)


def _native_in_region(events) -> dict[str, float]:
    """ms per native op called inside a compiled region (the prefill's eager calls left out)."""
    totals: dict[str, float] = {}
    for event in events:
        if event.name not in _NATIVE_OPS:
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("Torch-Compiled Region"):
            parent = parent.cpu_parent
        if parent is not None:
            totals[event.name] = totals.get(event.name, 0.0) + event.cpu_time_total / 1e3
    return totals


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="q8_0")
    ap.add_argument("--model", help="a GGUF file (quantize='gguf') instead of SmolLM2 in --dtype")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed generate calls (best is reported)")
    ap.add_argument("--table", type=int, default=0, help="also print the top N profiler rows by self CPU time")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import genfn
    from genfn.wait_policy import wait_policy

    model = load(args.dtype, args.model)
    name = args.model or args.dtype
    input_ids, mask = batch_inputs(model.tokenizer, args.batch, pad_id=2)
    N = args.new_tokens

    def call():
        with torch.no_grad():
            return genfn.generate(model, input_ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N,
                                  do_sample=False, pad_token_id=2, cache_implementation="static",
                                  max_cache_len=max(256, input_ids.shape[1] + N))

    t = time.perf_counter()
    call()
    print(f"# {name} b={args.batch}: first call (compile) {time.perf_counter() - t:.1f} s; "
          f"wait policy {wait_policy()}; load avg {os.getloadavg()[0]:.2f}", flush=True)
    best = float("inf")
    for _ in range(args.repeats):
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
    steps = N - 1  # init chooses the first token
    print(f"  generate: {best * 1e3 / N:.2f} ms/token ({args.batch * N / best:.1f} tok/s), best of {args.repeats}")

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        call()
        wall = time.perf_counter() - t
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        # "Torch-Compiled Region: 0/0" and the like: one per compiled frame
        key = event.key.split(":")[0] if event.key.startswith("Torch-Compiled Region") else event.key
        totals[key] = totals.get(key, 0.0) + event.cpu_time_total / 1e3  # ms
    lookup = totals.get("TorchDynamo Cache Lookup", 0.0)
    region = totals.get("Torch-Compiled Region", 0.0)
    native = _native_in_region(prof.events())
    linears = sum(native.values())
    print(f"  profiled call {wall * 1e3 / N:.2f} ms/token (profiler overhead included); per step:")
    print(f"    guard evaluation (dynamo cache lookup) {lookup / steps:7.3f} ms")
    print(f"    compiled region                        {region / steps:7.3f} ms")
    print(f"      native linears and layers            {linears / steps:7.3f} ms")
    for op, ms in native.items():
        print(f"        {op.split('::')[1]:34s} {ms / steps:7.3f} ms")
    print(f"      rest of the graph                    {(region - linears) / steps:7.3f} ms")
    print(f"    outside (driver, prefill/N, profiler)  {(wall * 1e3 - region - lookup) / steps:7.3f} ms")
    if args.table:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.table))


if __name__ == "__main__":
    main()
