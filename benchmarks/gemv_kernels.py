"""How fast each way of running SmolLM2's batch-1 linears streams its weights, on this machine.

    python benchmarks/gemv_kernels.py float32 [rows]
    python benchmarks/gemv_kernels.py bfloat16 [rows]
    python benchmarks/gemv_kernels.py step [formats] [rows] [--against REV] [--gap-us US]

``step``: every linear of one SmolLM2 decode step (30 x qkv [960, 576], o [576, 576], gate/up
[3072, 576], down [576, 1536], and the head [49152, 576]; random weights, quantized heads in
8 bits as ``genfn.models.quantized`` stores them) through ``genfn.kernels.linear``, eagerly, per
format (default float32,bfloat16,q8_0,q4_1) and rows of x (default 1,8). ``--against REV``
also builds the kernels' sources at git revision REV under another op namespace and times them
in the same loop, interleaved, so the ratio survives a noisy machine; float formats also time
``F.linear``. ``cpu`` is the best process CPU time of a step (all threads): on a shared machine,
with ``--threads 1``, it leaves out the time the thread waited for a core. The streaming
ceiling is printed beside them: ``tensor.sum()`` over the same bytes, once per weight (one call
per linear, as the kernels make) and as one buffer (the read bandwidth with no per-call cost).
genfn is imported before torch, so ``GENFN_WAIT_POLICY=auto`` gives the OpenMP wait policy genfn's
command line chooses (printed; without it, OpenMP's default or the one you set). ``--gap-us`` busy-waits on the calling thread after each linear, as the compiled
step's norms, attention and RoPE do, which is when a sleeping worker's wake-up shows.

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

# Before torch, so that GENFN_WAIT_POLICY=auto can choose the OpenMP wait policy as genfn's command line does.
import genfn  # noqa: E402,F401

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


STEP_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def build_baseline(rev: str):
    """The kernels' sources at ``rev``, built under the op namespace ``genfn_baseline``; its ops."""
    from genfn.bench.revision_kernels import build_at_revision
    from genfn.kernels import native

    torch.ops.load_library(str(build_at_revision(native.DECODE, rev, {"genfn_kernels": "genfn_baseline"})))
    return torch.ops.genfn_baseline


def step_weights(fmt: str):
    from genfn.models.quantized import HEAD_FORMAT
    from genfn.quant import QuantizedWeight, quantize

    torch.manual_seed(0)
    out = []
    for i, (n, k) in enumerate(STEP_SHAPES):
        w = torch.randn(n, k) * 0.02
        if fmt in ("float32", "bfloat16"):
            out.append(w.to(getattr(torch, fmt)))
        else:
            head = i == len(STEP_SHAPES) - 1
            out.append(QuantizedWeight.from_rows(quantize(w, HEAD_FORMAT.get(fmt, fmt) if head else fmt)))
    return out


def _float_views(w) -> list:
    """The tensors holding a weight's bytes, viewed as float32 (what a summing stream reads)."""
    from genfn.quant import QuantizedWeight

    parts = [w.codes, w.scales] + ([] if w.mins is None else [w.mins]) if isinstance(w, QuantizedWeight) else [w]
    return [p.view(torch.float32) for p in parts]


def _busy_wait(seconds: float) -> None:
    """Keep this thread busy (as the step's other, serial work does) while the kernels' threads idle."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def step_main(formats: str, rows: str, against: str | None, repeats: int, gap_s: float = 0.0) -> None:
    import os

    from genfn import kernels
    from genfn.quant import QuantizedWeight

    torch.set_grad_enabled(False)
    baseline = build_baseline(against) if against else None
    print(f"# step linears, threads {torch.get_num_threads()}, gap {gap_s * 1e6:.0f} us, load avg {os.getloadavg()[0]:.1f}, "
          f"wait policy {genfn.wait_policy.wait_policy()}, {kernels.kernel_status()}")

    def nbytes(w):
        return w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()

    for fmt in formats.split(","):
        weights = step_weights(fmt)
        total = sum(map(nbytes, weights))
        is_float = fmt in ("float32", "bfloat16")
        dtype = getattr(torch, fmt) if is_float else torch.float32
        for m in (int(r) for r in rows.split(",")):
            xs = {k: torch.randn(m, k).to(dtype) for k in (576, 1536)}
            variants = {"genfn": lambda w: kernels.linear(xs[w.shape[1]], w)}
            if is_float and m <= 8 and kernels.decode_linear_available():
                # The kernel itself, also where genfn.kernels.linear would route these rows elsewhere.
                variants = {"genfn": lambda w: torch.ops.genfn_kernels.decode_linear(xs[w.shape[1]], w)}
            if baseline is not None:
                if is_float:
                    variants[f"genfn@{against}"] = lambda w: baseline.decode_linear(xs[w.shape[1]], w)
                else:
                    variants[f"genfn@{against}"] = lambda w: baseline.quant_linear(
                        xs[w.shape[1]], w.codes, w.scales, w.mins, w.kind, w.out_features)
            if is_float:
                variants["F.linear"] = lambda w: F.linear(xs[w.shape[1]], w)
            # The streaming ceiling: the same bytes read by tensor.sum() (float32 views of each
            # weight's own tensors, one call per linear as the kernels make), and all of them as
            # one buffer (the bandwidth with no per-call cost).
            variants["sum() per weight"] = lambda w: [t.sum() for t in _float_views(w)]
            flat = torch.ones(total // 4)
            variants["sum() one buffer"] = lambda w: flat.sum() if w is weights[0] else None
            ref = {name: [fn(w) for w in weights[-3:]] for name, fn in variants.items() if not name.startswith("sum")}
            times = {name: [] for name in variants}
            cpu_times = {name: [] for name in variants}
            for _ in range(repeats):
                for name, fn in variants.items():
                    t, c = time.perf_counter(), time.process_time()
                    for w in weights:
                        fn(w)
                        if gap_s:
                            _busy_wait(gap_s)
                    times[name].append(time.perf_counter() - t - gap_s * len(weights))
                    cpu_times[name].append(time.process_time() - c)
            for name in variants:
                best, median = min(times[name]), sorted(times[name])[len(times[name]) // 2]
                cpu = min(cpu_times[name])
                diff = (max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref[name], ref["genfn"]))
                        if name in ref else float("nan"))
                print(f"  {fmt:9s} rows {m}  {name:22s} best {best * 1e3:7.2f} ms  median {median * 1e3:7.2f} ms  "
                      f"{total / best / 1e9:5.1f} GB/s ({total / 1e6:.0f} MB)  cpu {cpu * 1e3:7.2f} ms  max |diff| vs genfn {diff:.1e}",
                      flush=True)
    print(f"# load avg {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        raise SystemExit(print(__doc__))
    if sys.argv[1:2] == ["step"]:
        import argparse

        ap = argparse.ArgumentParser(prog="gemv_kernels.py step")
        ap.add_argument("formats", nargs="?", default="float32,bfloat16,q8_0,q4_1")
        ap.add_argument("rows", nargs="?", default="1,8")
        ap.add_argument("--against", default=None, help="git revision whose kernels to time beside these")
        ap.add_argument("--threads", type=int, default=2)
        ap.add_argument("--repeats", type=int, default=15, help="interleaved timed steps per variant (best is shown)")
        ap.add_argument("--gap-us", type=float, default=0.0,
                        help="busy-wait this long on the calling thread after each linear, as the compiled step's "
                             "other work does (subtracted from the times): the worker threads' wake-up then shows")
        a = ap.parse_args(sys.argv[2:])
        torch.set_num_threads(a.threads)
        step_main(a.formats, a.rows, a.against, a.repeats, a.gap_us * 1e-6)
    else:
        main(*sys.argv[1:3])
