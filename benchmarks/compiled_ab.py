"""Interleaved A/B of genfn's compiled step on SmolLM2: what the decode kernel and the C++ wrapper each buy.

    python benchmarks/compiled_ab.py bfloat16 1
    python benchmarks/compiled_ab.py float32 8

Three copies of the model compile the same greedy step three ways: genfn's CPU default (decode
kernel + max-autotune options + cpp_wrapper), the same without the C++ wrapper, and the default
with the decode kernel turned off (inductor's frozen max-autotune GEMMs take the linears). Their
timed calls alternate, so machine noise hits all alike. Prints each one's first call (compile)
and ms per decode step ((64-token call - 1-token call) / 64), best and median of five.
"""

from __future__ import annotations

import sys
import time

import torch

import genfn
from genfn import kernels
from genfn.compile_boundary import _CPU_COMPILE_OPTIONS

PROMPT = "The history of the Roman Empire is long and complicated. It began when"


def main(dtype_name: str = "bfloat16", batch: str = "1") -> None:
    torch.set_grad_enabled(False)
    if not kernels.decode_linear_available():
        sys.exit(f"the decode kernel is not available: {kernels.kernel_status()}")
    dtype = getattr(torch, dtype_name)
    without_wrapper = {k: v for k, v in _CPU_COMPILE_OPTIONS.items() if k != "cpp_wrapper"}
    variants = {  # name: (uses the kernel, compile_config)
        "default (kernel, cpp_wrapper)": (True, None),
        "kernel, Python wrapper": (True, genfn.CompileConfig(fullgraph=True, mode=None, options=without_wrapper)),
        "inductor GEMMs, cpp_wrapper": (False, None),
    }
    models = {name: genfn.load(dtype=dtype) for name in variants}
    ids = torch.tensor([models[next(iter(models))].tokenizer.encode(PROMPT)] * int(batch))

    def generate(name: str, new_tokens: int) -> float:
        use_kernel, compile_config = variants[name]
        # The choice is read while the step is traced, so each model's graph keeps its own.
        kernels._available = use_kernel
        try:
            start = time.perf_counter()
            genfn.generate(models[name], ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           max_cache_len=256, pad_token_id=2, cache_implementation="static",
                           compile_config=compile_config)
            return time.perf_counter() - start
        finally:
            kernels._available = True

    for name in variants:
        print(f"{dtype_name} b={batch} {name:30s} first call {generate(name, 8):6.1f} s", flush=True)
    per_step: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(5):
        for name in variants:
            per_step[name].append((generate(name, 65) - generate(name, 1)) / 64)
    for name, times in per_step.items():
        times.sort()
        print(f"{dtype_name} b={batch} {name:30s} best {times[0] * 1e3:6.2f}  median {times[2] * 1e3:6.2f} ms/step")


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        raise SystemExit(print(__doc__))
    main(*sys.argv[1:3])
