"""The native side of ``genfn.quant.coded_bf16.CodedBfloat16`` (``coded_bf16.cpp``): encoding a
bfloat16 matrix, and the linear that multiplies by one.

Every output of ``coded_linear`` is summed as the plain bfloat16 kernel sums it (``linear`` on the
decoded matrix, up to ``MAX_LINEAR_ROWS`` rows of x), so a coded model gives its plain model's bits;
past those rows the matrix is decoded and ``linear`` takes it, as it takes a plain one. The native
prefill layer (``genfn.models.prefill_layer``) runs its GEMM through ``coded_bf16_gemm`` instead: the
matrix decoded into a reused scratch for genfn's bfloat16 GEMM, the plain model's path there.
"""

from __future__ import annotations

import torch

from genfn.quant.coded_bf16 import GROUP, CodedBfloat16, encodable

__all__ = ["coded_linear", "coded_rows", "encode_coded_bf16", "register_coded_fake"]


def encode_coded_bf16(weight: torch.Tensor, arena=None) -> CodedBfloat16:
    """``weight`` (bfloat16 ``[N, K]``, ``K`` a multiple of 64) coded in 12.2 bits a weight; its
    ``decode()`` gives back every bit. ``arena`` (a ``genfn.models.weight_arena.WeightArena``): where
    the records and bases are written (a loaded model's weights, on huge pages)."""
    from genfn import kernels

    if not encodable(weight):
        raise ValueError(f"encode_coded_bf16: weight must be a bfloat16 [N, K] CPU tensor with K a multiple of 64 "
                         f"and no gradient, got {getattr(weight, 'dtype', type(weight))} "
                         f"{list(getattr(weight, 'shape', ()))}")
    if not (kernels.native.cpu_has("avx512_bf16") and kernels.decode_linear_available()):
        raise RuntimeError("encode_coded_bf16: coded bfloat16 weights need the native kernels on a CPU with "
                           f"AVX512_BF16 (vdpbf16ps); the kernels are {kernels.kernel_status()}")
    rows, groups = weight.shape[0], weight.shape[1] // GROUP

    def empty(shape):
        return torch.empty(shape, dtype=torch.uint8) if arena is None else arena.empty(shape, torch.uint8)

    records, bases = empty((rows, groups * 96)), empty((rows, groups))
    raw, raw_start = torch.ops.genfn_kernels.coded_bf16_encode(weight, records, bases)
    return CodedBfloat16(records, bases, raw, raw_start, out_features=weight.shape[0], in_features=weight.shape[1])


def coded_linear(x: torch.Tensor, weight: CodedBfloat16) -> torch.Tensor:
    """``x @ weight.decode().T``, the bits ``genfn.kernels.linear`` gives on the decoded matrix."""
    from genfn import kernels

    if x.shape[-1] != weight.in_features:
        raise ValueError(f"linear: x has {x.shape[-1]} features, the coded weight expects {weight.in_features}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"linear: a coded bfloat16 weight takes bfloat16 x, got {x.dtype}")
    rows = x.numel() // max(weight.in_features, 1)
    if rows > kernels.MAX_LINEAR_ROWS[torch.bfloat16] or (torch.is_grad_enabled() and x.requires_grad):
        return kernels.linear(x, torch.ops.genfn_kernels.coded_bf16_decode(*weight.tensors()))
    return torch.ops.genfn_kernels.coded_bf16_linear(x, *weight.tensors())


def coded_rows(weight: CodedBfloat16, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` (int64, any shape) of ``weight.decode()``, ``[*index.shape, in_features]``,
    reading only those rows: an embedding lookup in a tied head's coded table."""
    rows = torch.ops.genfn_kernels.coded_bf16_rows(*weight.tensors(), index.reshape(-1))
    return rows.view(*index.shape, weight.in_features)


def register_coded_fake(namespace: str) -> None:
    @torch.library.register_fake(f"{namespace}::coded_bf16_gemm")
    def _(x, records, bases, raw, raw_start, swiglu):
        rows = records.shape[0] // 2 if swiglu else records.shape[0]
        return x.new_empty((*x.shape[:-1], rows))

    @torch.library.register_fake(f"{namespace}::coded_bf16_rows")
    def _(records, bases, raw, raw_start, index):
        return records.new_empty((index.shape[0], records.shape[1] // 96 * 64), dtype=torch.bfloat16)

    @torch.library.register_fake(f"{namespace}::coded_bf16_linear")
    def _(x, records, bases, raw, raw_start):
        return x.new_empty((*x.shape[:-1], records.shape[0]))

    @torch.library.register_fake(f"{namespace}::coded_bf16_decode")
    def _(records, bases, raw, raw_start):
        return records.new_empty((records.shape[0], records.shape[1] // 96 * 64), dtype=torch.bfloat16)
