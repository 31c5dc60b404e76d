"""Linear layers on weights packed once for oneDNN's GEMM: the eager steps of continuous batching.

A continuous-batching step multiplies tens to hundreds of token rows by every weight, where
``F.linear`` is a GEMM, not a GEMV. In float32 the library GEMM behind ``F.linear`` (MKL) reads
the weight in its plain layout at every call; oneDNN's, given the weight reordered once into its
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what inductor does for frozen
weights), ran 1.4x (512 rows) to 3x (the 49152-row LM head at 32 rows) faster on the 2-core
Zen 4 machine; bfloat16 gains 10-30 % (``F.linear`` already calls oneDNN there, unpacked).

``pack_linear_weights(params)`` returns the parameter tree with each linear weight replaced by a
``PackedWeight`` (the plain weight is kept: at a few rows genfn's decode kernel, which streams it,
is faster); ``packed_linear(x, weight, bias)`` runs either kind. The packed object is opaque to
``torch.compile``: it is for eager forwards only. Where oneDNN is missing or refuses the packing,
the weights stay plain and nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from genfn.kernels import MAX_DECODE_ROWS, linear

__all__ = ["PackedWeight", "pack_linear_weights", "packed_linear", "packing_available"]

# The batch size oneDNN is told to expect when it picks the packed layout (a hint only: any row
# count runs on it): a decode step of a few dozen requests.
_EXPECTED_ROWS = 32
_DTYPES = (torch.float32, torch.bfloat16)


class PackedWeight:
    """A ``[out, in]`` weight in oneDNN's blocked GEMM layout, with the plain weight beside it."""

    __slots__ = ("weight", "packed")

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _EXPECTED_ROWS)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype


_works: bool | None = None


def packing_available() -> bool:
    """Whether this torch has oneDNN's packed linear and it gives ``F.linear``'s values."""
    global _works
    if _works is None:
        try:
            weight = torch.randn(24, 16)
            x = torch.randn(5, 16)
            out = torch.ops.mkldnn._linear_pointwise(x, PackedWeight(weight).packed, None, "none", [], "")
            _works = bool(torch.allclose(out, torch.nn.functional.linear(x, weight), atol=1e-4, rtol=1e-4))
        except (AttributeError, RuntimeError, NotImplementedError):
            _works = False
    return _works


def packed_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a plain, quantized or ``PackedWeight`` weight (``x [N, in]``)."""
    if not isinstance(weight, PackedWeight):
        return linear(x, weight, bias)
    if x.shape[0] <= MAX_DECODE_ROWS.get(weight.dtype, 0):
        return linear(x, weight.weight, bias)  # genfn's decode kernel, where it is built
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight.packed, bias, "none", [], "")


def _packable(value) -> bool:
    return (isinstance(value, torch.Tensor) and value.dim() == 2 and value.device.type == "cpu"
            and value.dtype in _DTYPES)


def pack_linear_weights(params: Mapping[str, Any], names: Iterable[str], layer_names: Iterable[str]) -> dict:
    """``params`` with ``params[name]`` (``names``) and every ``params["layers"][i][name]``
    (``layer_names``) packed; a shallow copy (the other leaves are shared). Unchanged where
    packing is unavailable."""
    out = dict(params)
    if not packing_available():
        return out
    for name in names:
        if _packable(out.get(name)):
            out[name] = PackedWeight(out[name])
    layer_names = tuple(layer_names)
    if "layers" in out:
        out["layers"] = [{k: PackedWeight(v) if k in layer_names and _packable(v) else v for k, v in layer.items()}
                         for layer in out["layers"]]
    return out
