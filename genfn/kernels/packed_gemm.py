"""Linear layers on weights packed once for a GEMM: the eager steps of continuous batching.

A continuous-batching step multiplies tens to hundreds of token rows by every weight, where
``F.linear`` is a GEMM, not a GEMV, and a weight laid out for the GEMM's inner loop once beats
re-reading the plain layout at every call.

- bfloat16 on CPUs with AVX512_BF16 and without AMX: genfn's own kernel (``bf16_gemm.cpp``: panels
  of 48 output columns, k-pairs interleaved for ``vdpbf16ps``, 8 x 48 float32 accumulators).
  Against oneDNN's GEMM on its own packed weight, interleaved on the 2-core Zen 4 (``python
  benchmarks/gemm.py``): 1.1-1.9x at 16-64 rows for SmolLM2's five linear shapes, alike at 512
  rows (the LM head 0.93x).
- bfloat16 where the CPU has AMX-BF16 tiles, float32, and bfloat16 without AVX512_BF16: oneDNN's
  GEMM on the weight reordered into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
  what inductor does for frozen weights): float32 1.4x (512 rows) to 3x (the 49152-row LM head at
  32 rows) MKL's ``F.linear`` on the Zen 4. On AMX, oneDNN multiplies bfloat16 on the tiles,
  which ``vdpbf16ps`` cannot approach: see ``bf16_gemm_preferred``.

``pack_linear_weights(params)`` returns the parameter tree with each linear weight replaced by a
``PackedWeight`` (the plain weight is kept: at a few rows genfn's decode kernel, which streams it,
is faster); ``packed_linear(x, weight, bias)`` runs either kind. The packed object is opaque to
``torch.compile``: it is for eager forwards only. Where neither packing is available the weights
stay plain and nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from genfn.kernels import MAX_DECODE_ROWS, decode_linear_available, linear
from genfn.kernels.native import cpu_has

__all__ = ["PackedWeight", "bf16_gemm_available", "bf16_gemm_preferred", "onednn_has_amx_bf16", "pack_linear_weights",
           "packed_linear", "packing_available"]

# The batch size oneDNN is told to expect when it picks the packed layout (a hint only: any row
# count runs on it): a decode step of a few dozen requests.
_EXPECTED_ROWS = 32
_DTYPES = (torch.float32, torch.bfloat16)


class PackedWeight:
    """An ``[out, in]`` weight packed for a GEMM (``kind``: ``"genfn"``, genfn's bfloat16 kernel,
    or ``"onednn"``), with the plain weight beside it."""

    __slots__ = ("weight", "packed", "kind")

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        if weight.dtype == torch.bfloat16 and bf16_gemm_preferred():
            self.kind = "genfn"
            self.packed = torch.ops.genfn_kernels.pack_bf16_gemm_weight(weight)
        else:
            self.kind = "onednn"
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _EXPECTED_ROWS)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype


_works: bool | None = None
_bf16_works: bool | None = None
_ONEDNN_AMX_BF16 = cpu_has("amx_bf16") and torch.backends.mkldnn.is_available()


def packing_available() -> bool:
    """Whether this torch has oneDNN's packed linear and it gives ``F.linear``'s values."""
    global _works
    if _works is None:
        try:
            weight = torch.randn(24, 16)
            x = torch.randn(5, 16)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, _EXPECTED_ROWS)
            out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            _works = bool(torch.allclose(out, torch.nn.functional.linear(x, weight), atol=1e-4, rtol=1e-4))
        except (AttributeError, RuntimeError, NotImplementedError):
            _works = False
    return _works


def bf16_gemm_available() -> bool:
    """Whether genfn's bfloat16 GEMM is built and runs here (it needs AVX512_BF16)."""
    global _bf16_works
    if _bf16_works is None:
        _bf16_works = False
        if decode_linear_available():
            try:
                weight = torch.randn(50, 7).bfloat16()
                x = torch.randn(3, 7).bfloat16()
                packed = torch.ops.genfn_kernels.pack_bf16_gemm_weight(weight)
                out = torch.ops.genfn_kernels.bf16_gemm(x, packed, 50, None, True)
                _bf16_works = bool(torch.allclose(out, x.float() @ weight.float().t(), atol=1e-3, rtol=1e-3))
            except RuntimeError:  # a CPU without AVX512_BF16
                pass
    return _bf16_works


def onednn_has_amx_bf16() -> bool:
    """Whether oneDNN's bfloat16 GEMM runs on AMX tiles here: the CPU (and its kernel) has AMX-BF16
    and torch has oneDNN, whose GEMM picks its AMX kernels itself. Read from ``/proc/cpuinfo`` at
    import, not timed (the choice is the same in every process on the machine, and a step being
    traced must not open files)."""
    return _ONEDNN_AMX_BF16


def bf16_gemm_preferred() -> bool:
    """Whether a bfloat16 GEMM of many rows runs on genfn's ``vdpbf16ps`` kernel rather than oneDNN's:
    where genfn's is built and the CPU has no AMX tiles. On a 2-core Sapphire Rapids-class Xeon
    with AMX-BF16 oneDNN's GEMM ran 4-11x genfn's at 32-512 rows (``python benchmarks/gemm.py``,
    docs/guides/k-quants-and-scale.md, *bfloat16 on AMX tiles*); on the Zen 4 genfn's ran 1.1-1.9x
    oneDNN's."""
    return bf16_gemm_available() and not onednn_has_amx_bf16()


def packed_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None, *,
                  out_float32: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a plain, quantized or ``PackedWeight`` weight (``x [N, in]``);
    ``out_float32``: the result in float32 (genfn's bfloat16 GEMM writes it so directly)."""
    # A few rows take genfn's decode kernel on the plain weight, where it is built.
    gemm = isinstance(weight, PackedWeight) and x.shape[0] > MAX_DECODE_ROWS.get(weight.dtype, 0)
    if gemm and weight.kind == "genfn" and x.dtype == torch.bfloat16:
        return torch.ops.genfn_kernels.bf16_gemm(x, weight.packed, weight.shape[0], bias, out_float32)
    if gemm and weight.kind == "onednn":
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight.packed, bias, "none", [], "")
    else:  # a plain weight, few rows, or activations of another dtype than the packed weight's
        y = linear(x, weight.weight if isinstance(weight, PackedWeight) else weight, bias)
    return y.to(torch.float32) if out_float32 else y


def _packable(value) -> bool:
    if not (isinstance(value, torch.Tensor) and value.dim() == 2 and value.device.type == "cpu"
            and value.dtype in _DTYPES):
        return False
    return (value.dtype == torch.bfloat16 and bf16_gemm_preferred()) or packing_available()


def pack_linear_weights(params: Mapping[str, Any], names: Iterable[str], layer_names: Iterable[str]) -> dict:
    """``params`` with ``params[name]`` (``names``) and every ``params["layers"][i][name]``
    (``layer_names``) packed; a shallow copy (the other leaves are shared). Unchanged where
    packing is unavailable."""
    out = dict(params)
    for name in names:
        if _packable(out.get(name)):
            out[name] = PackedWeight(out[name])
    layer_names = tuple(layer_names)
    if "layers" in out:
        out["layers"] = [{k: PackedWeight(v) if k in layer_names and _packable(v) else v for k, v in layer.items()}
                         for layer in out["layers"]]
    return out
