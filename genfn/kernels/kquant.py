"""The K-quant linear (``kquant_linear.cpp``; the IQ4_NL/IQ4_XS rows in ``iq4_linear.cpp``): ``x @ W.T``
for a ``genfn.quant.KQuantWeight``.

The library is built apart from the decode kernels and without global ISA flags: its AVX-512 and
AVX2 paths are compiled per function and picked at run time, so it runs on any x86-64 CPU with
AVX2 and FMA (every one since 2013-2015). It is built, found and loaded like the decode kernels
(``genfn.kernels.native``). Where it cannot be built or loaded (no compiler,
``GENFN_KERNELS=0``, not x86-64 Linux) the op is registered with the torch reference
(``genfn.quant.kquants.reference_linear_k``: the same numbers, far slower); on an x86-64 CPU
without AVX2 the native op refuses with a ``RuntimeError`` that says so.
"""

from __future__ import annotations

import torch

from genfn.kernels import native
from genfn.quant.kquants import (BLOCK_BYTES, BLOCK_INPUTS, FORMAT_ID, FORMAT_NAME, INTERLEAVED, R8_ROWS, KQuantWeight,
                                 dequantize_k, reference_linear_k, unpack_r8)
from genfn.quant.weight import QuantizedWeight

__all__ = ["kquant_linear", "kquant_lookup", "kquant_available", "kquant_isa", "force_isa", "gemm_min_rows",
           "tiles_linear", "tiles_kernel_runs",
           "kquant_status", "needs_build"]

_NAMESPACE = "genfn_kquant"
_ISA_NAMES = {0: "none", 1: "avx2", 2: "avx512"}

_native: bool | None = None
_status = "not loaded yet"


def kquant_status() -> str:
    kquant_available()
    return _status


def needs_build() -> bool:
    """Whether using the K-quant kernels would first compile them (``False`` once loaded)."""
    return _native is None and native.plan(native.KQUANT).action == "build"


def _load() -> bool:
    global _status
    loaded, _status = native.load(native.KQUANT)
    return loaded


def _register_fake(native_ops: bool) -> None:
    @torch.library.register_fake(f"{_NAMESPACE}::kquant_linear")
    def _(x, data, format, out_features, row_kernels=False):
        return x.new_empty((*x.shape[:-1], out_features))

    if native_ops:  # the MoE step, the lookup and the tiles' AVX2 product exist only in the native library
        @torch.library.register_fake(f"{_NAMESPACE}::tiles_linear")
        def _(x, codes, scales, mins, kind, out_features, init=None):
            return x.new_empty((*x.shape[:-1], out_features))

        @torch.library.register_fake(f"{_NAMESPACE}::kquant_moe_decode")
        def _(x, experts, weights, gate_up, gate_up_format, down, down_format):
            return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((), dtype=torch.int64)

        @torch.library.register_fake(f"{_NAMESPACE}::kquant_lookup")
        def _(data, format, out_features, index):
            inputs = data.shape[1] // BLOCK_BYTES[FORMAT_NAME[format]] * BLOCK_INPUTS[FORMAT_NAME[format]]
            return data.new_empty((index.shape[0], inputs), dtype=torch.float32)


def _define_reference_op() -> None:
    """The op in plain torch under the native name and schema, where the library is not built."""
    library = torch.library.Library(_NAMESPACE, "FRAGMENT")
    library.define("kquant_linear(Tensor x, Tensor data, int format, int out_features, bool row_kernels=False) "
                   "-> Tensor")

    def reference(x, data, format, out_features, row_kernels=False):
        weight = KQuantWeight(data, FORMAT_NAME[format], out_features, x.shape[-1])
        return reference_linear_k(x, weight, dtype=torch.float32)

    library.impl("kquant_linear", reference, "CPU")
    _define_reference_op.library = library  # the registration lives as long as this object


def kquant_available() -> bool:
    """Whether K-quant linears run the native kernel (else the torch reference)."""
    global _native
    if _native is None:
        _native = _load()
        if not _native:
            _define_reference_op()
        _register_fake(_native)
    return _native


def kquant_isa() -> str:
    """The path the native kernel takes here: ``"avx512"``, ``"avx2"``, ``"none"`` (it refuses) or
    ``"reference"`` (no native library)."""
    if not kquant_available():
        return "reference"
    return _ISA_NAMES[int(torch.ops.genfn_kquant.kquant_isa())]


def group_kernel_runs(fmt: str) -> bool:
    """Whether interleaved format ``fmt``'s group kernel runs here (the native library's answer):
    ``q4_k_r8``'s and ``q5_k_r8``'s wherever the library loads; ``q6_k_r8``'s and ``iq4_xs_r8``'s on
    its AVX-512 path on a CPU with VNNI, and elsewhere their groups go a row at a time through the
    stored format's row kernel (the same bits, slower than the format as stored). The GGUF loader
    interleaves a format only where this holds."""
    if fmt not in INTERLEAVED:
        raise ValueError(f"group_kernel_runs: fmt must be one of {sorted(INTERLEAVED)}, got {fmt!r}")
    return kquant_available() and bool(torch.ops.genfn_kquant.kquant_own_kernel_runs(FORMAT_ID[fmt]))


def tiles_kernel_runs() -> bool:
    """Whether ``tiles_linear`` runs here: the library is loaded and the CPU has AVX2, FMA and F16C."""
    return kquant_available() and int(torch.ops.genfn_kquant.kquant_isa()) != 0


def tiles_linear(x: torch.Tensor, weight: QuantizedWeight, init: torch.Tensor | None = None) -> torch.Tensor:
    """``genfn.kernels.quantized_linear`` on AVX2 (``tiles_avx2.cpp``): ``x @ weight.dequantize().T``
    for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 tiles, bit for bit what the decode library's VNNI kernel gives
    (``init`` included). ``quantized_linear`` runs it wherever the decode library has no VNNI kernel
    (a CPU without AVX-512, where that library cannot load, or without VNNI); here it is for tests
    and benchmarks of that path."""
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"tiles_linear: x has {x.shape[-1]} features, the quantized weight expects "
                         f"{weight.in_features}")
    if weight.layout != "tiles16":
        raise ValueError(f"tiles_linear: weight must be in the kernel's tiles (layout 'tiles16'), got {weight.layout!r}")
    if not tiles_kernel_runs():
        raise RuntimeError(f"tiles_linear needs the K-quant kernels on a CPU with AVX2 (they are {_status})")
    return torch.ops.genfn_kquant.tiles_linear(x, weight.codes, weight.scales, weight.mins, weight.kind,
                                               weight.out_features, init)


def force_isa(isa: str | None) -> str:
    """Pin the native kernel's path (``"avx2"`` or ``"avx512"``; ``None``: the best this CPU has),
    for tests and benchmarks of the AVX2 path on an AVX-512 machine. Returns the path now active."""
    codes = {None: 0, "avx2": 1, "avx512": 2}
    if isa not in codes:
        raise ValueError(f"isa must be None, 'avx2' or 'avx512'; got {isa!r}")
    if not kquant_available():
        raise RuntimeError(f"the K-quant kernels are {_status}")
    return _ISA_NAMES[int(torch.ops.genfn_kquant.kquant_force_isa(codes[isa]))]


def gemm_min_rows(rows: int | None) -> int:
    """Set the fewest rows of ``x`` that a Q4_K/Q5_K/Q6_K/IQ4_XS product hands to the GEMM
    (``kquant_gemm.cpp``) instead of the row kernels, for every format, for tests and benchmarks of
    either path; returns the count now in force. ``None``: the defaults, 16 rows, and 48 for
    interleaved Q4_K and Q5_K rows on the AVX2 path, whose row kernels stay faster up to there
    (returns 16)."""
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        raise ValueError(f"rows must be None or a positive int; got {rows!r}")
    if not kquant_available():
        raise RuntimeError(f"the K-quant kernels are {_status}")
    return int(torch.ops.genfn_kquant.kquant_gemm_min_rows(0 if rows is None else rows))


def kquant_lookup(table: KQuantWeight, tokens: torch.Tensor) -> torch.Tensor:
    """The float32 rows ``tokens [n]`` of ``table`` (``[n, in_features]``): ``dequantize_k`` of just those
    rows, bit for bit, in one native pass (``kquant_lookup.cpp``; a token of an interleaved table reads
    its own row out of its group of 8). The torch path where the library is not built, or off the CPU."""
    if not (kquant_available() and table.data.is_cpu and tokens.device.type == "cpu"):
        if table.format in INTERLEAVED:
            row_bytes = table.data.shape[1]
            groups = table.data.view(-1, R8_ROWS * row_bytes)[tokens // R8_ROWS].view(-1, row_bytes)
            stored = unpack_r8(KQuantWeight(groups, table.format, groups.shape[0], table.in_features))
            picks = torch.arange(tokens.numel(), device=tokens.device), tokens % R8_ROWS
            own = stored.data.view(tokens.numel(), R8_ROWS, -1)[picks]
            return dequantize_k(own, stored.format)
        return dequantize_k(table.data[tokens], table.format)
    return torch.ops.genfn_kquant.kquant_lookup(table.data, FORMAT_ID[table.format], table.out_features, tokens)


def kquant_linear(x: torch.Tensor, weight: KQuantWeight, *, row_kernels: bool = False) -> torch.Tensor:
    """``x @ weight.dequantize().T`` with ``x`` quantized per 256 inputs (per 32 for iq4_nl) to 8 bits
    (llama.cpp's Q8_K). Q4_K/Q5_K/Q6_K/IQ4_XS products of many rows (``gemm_min_rows``) run the GEMM, which
    adds each super-block into an output in the row kernels' order (``add_block`` in kquant.h), so a
    row's result has the same bits whichever ran it; ``row_kernels`` keeps every row count on the
    row kernels (the batch-invariant mode's choice)."""
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"linear: x has {x.shape[-1]} features, the {weight.format} weight expects "
                         f"{weight.in_features}")
    kquant_available()
    return torch.ops.genfn_kquant.kquant_linear(x, weight.data, FORMAT_ID[weight.format], weight.out_features,
                                                row_kernels)
