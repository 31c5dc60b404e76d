"""How fast each way of running SmolLM2's batch-1 linears streams its weights, on this machine.

    python benchmarks/gemv_kernels.py float32 [rows]
    python benchmarks/gemv_kernels.py bfloat16 [rows]

A chain of 30 layers of SmolLM2's fused gate/up [3072, 576] and down [576, 1536] projections
(far larger than the caches) is run at batch 1 (or ``rows``) six ways: eager ``F.linear``; genfn's
decode kernel (``genfn.kernels.linear``, eager); compiled with the weights frozen as constants
(default mode, and max-autotune, where inductor may pick its own C++ GEMM kernels); and the GEMV
written as a multiply + sum reduction for inductor to generate (plain and with its C++ wrapper). Prints the median time, weight bytes streamed per second, and
the largest difference from eager; ``tensor.sum()`` over 1 GiB gives the read bandwidth for scale.
"""

from __future__ import annotations

import sys
import time

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

LAYERS = 30


class Weights(torch.nn.Module):
    """The weights as module buffers, so inductor's freezing can fold them into constants."""

    def __init__(self, dtype):
        super().__init__()
        for i in range(LAYERS):
            self.register_buffer(f"gate_up{i}", (torch.randn(3072, 576) * 0.02).to(dtype))
            self.register_buffer(f"down{i}", (torch.randn(576, 1536) * 0.02).to(dtype))


def linear(x, w):
    return F.linear(x, w)


def reduction(x, w):
    return (x.unsqueeze(-2).float() * w.float()).sum(-1).to(x.dtype)


def mlp_chain(weights, project):
    def run(x):
        for i in range(LAYERS):
            gate, up = project(x, getattr(weights, f"gate_up{i}")).chunk(2, -1)
            x = x + project(F.silu(gate) * up, getattr(weights, f"down{i}"))
        return x
    return run


def read_bandwidth_gbs() -> float:
    big = torch.ones(256 * 1024 * 1024)
    best = min(_timed(big.sum) for _ in range(5))
    return big.numel() * 4 / best / 1e9


def _timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def main(dtype_name: str = "float32", rows: str = "1") -> None:
    from genfn import kernels

    torch.set_grad_enabled(False)
    dtype = getattr(torch, dtype_name)
    weights = Weights(dtype)
    weight_bytes = sum(b.numel() * b.element_size() for b in weights.buffers())
    x = torch.randn(int(rows), 576).to(dtype)
    print(f"{dtype_name}, {rows} row(s): {weight_bytes / 1e6:.0f} MB of weights; sum() read bandwidth {read_bandwidth_gbs():.1f} GB/s")
    variants = {"eager F.linear": mlp_chain(weights, linear)}
    if kernels.decode_linear_available():
        variants["genfn decode_linear (eager)"] = mlp_chain(weights, kernels.linear)
    else:
        print(f"  genfn decode kernel: {kernels.kernel_status()}")
    with inductor_config.patch(freezing=True):
        for name, project, options in [("frozen, default mode", linear, {}),
                                       ("frozen, max-autotune", linear, {"max_autotune": True}),
                                       ("frozen, reduction", reduction, {}),
                                       ("frozen, reduction, cpp_wrapper", reduction, {"cpp_wrapper": True})]:
            fn = torch.compile(mlp_chain(weights, project), fullgraph=True, dynamic=False, options=options)
            print(f"  compiling {name}: {_timed(fn, x):.1f} s", flush=True)
            variants[name] = fn
        reference = variants["eager F.linear"](x)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(15):  # interleaved, so machine noise hits every variant alike
            for name, fn in variants.items():
                times[name].append(_timed(fn, x))
        for name, fn in variants.items():
            median = sorted(times[name])[len(times[name]) // 2]
            diff = float((fn(x) - reference).abs().max())
            print(f"  {name:32s} {median * 1e3:7.2f} ms  {weight_bytes / median / 1e9:5.1f} GB/s  max |diff| {diff:.1e}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
