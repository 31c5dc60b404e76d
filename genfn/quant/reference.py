"""The quantized linear in plain torch: the definition the native kernel is tested against.

The kernel quantizes each activation row once per linear, per block of 32 inputs, to 8 bits
(``d = max|x| / 127``, codes ``round(x / d)``, ties to even), then takes integer dot products
with the weight codes and scales them in float32. In exact arithmetic that is
``dequantized(x) @ dequantized(W).T``; ``reference_linear`` computes it in float64, so the only
difference left to the kernel is its float32 summation order.
"""

from __future__ import annotations

import torch

from genfn.quant.blocks import BLOCK
from genfn.quant.weight import QuantizedWeight

__all__ = ["quantize_activations", "reference_linear"]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``x [..., K]``: int8-valued float32 ``[..., K // 32, 32]`` and
    float32 ``[..., K // 32]``, computed in float32 exactly as the kernel does."""
    x = x.to(torch.float32)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)
    d = amax / 127
    inverse = torch.where(amax > 0, 1.0 / d, torch.zeros_like(d))
    codes = torch.round(blocks * inverse.unsqueeze(-1)).clamp(-127, 127)
    return codes, d


def reference_linear(x: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """What ``genfn.kernels.linear(x, weight)`` computes, in ``dtype``, returned as ``x.dtype``."""
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"x has {x.shape[-1]} features; the weight expects {weight.in_features}")
    codes, d = quantize_activations(x)
    x_values = (codes.to(dtype) * d.to(dtype).unsqueeze(-1)).reshape(x.shape)
    return torch.nn.functional.linear(x_values, weight.dequantize().to(dtype)).to(x.dtype)
