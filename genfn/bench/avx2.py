"""Run genfn in this process as a CPU with AVX2 but without AVX-512 runs it, on a CPU that has both:
for benchmarks and tests of that path (``tiles_avx2.cpp``, the K-quant kernels' AVX2 path).

The decode library is built for AVX-512, so such a CPU cannot load it: its AVX2 build
(``native.DECODE_AVX2``) runs the ops ``genfn.kernels.portable_ops_available`` names there (the stack,
the plain linears, the attention, the token ops, the GGUF tile fill), and the other ops fall back
(block-quantized linears to the K-quant library's AVX2 kernel of the same tiles, GEMMs to torch). Here
the library is refused as it is there, by a CPU feature this one lacks, and the K-quant library is
pinned to its AVX2 path. torch's own kernels keep this CPU's paths: benchmarks hold them to AVX2
(``model_bench.py``'s AVX2 engines)."""

from __future__ import annotations

import dataclasses

from genfn.kernels import native

__all__ = ["run_as_avx2_cpu"]


def run_as_avx2_cpu() -> None:
    """Make this process's genfn take the paths of a CPU without AVX-512. Call it before anything
    loads the decode library (the first model load or native op does)."""
    from genfn import kernels

    if kernels._available is not None:
        raise RuntimeError("run_as_avx2_cpu: this process already loaded (or tried to load) the decode library")
    native.DECODE = dataclasses.replace(native.DECODE, cpu_features=native.DECODE.cpu_features + ("none_has_this",))
    from genfn.kernels import kquant

    if kquant.force_isa("avx2") != "avx2":
        raise RuntimeError("run_as_avx2_cpu: the K-quant library does not run its AVX2 path here")
