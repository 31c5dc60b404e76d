"""``RowStack``: a matrix whose row ranges are stored in different formats.

A GGUF file's fused projections may mix formats (Q4_K_M files store some layers' v projection in
Q6_K beside Q4_K q and k). Concatenating such parts would mean dequantizing them; a ``RowStack``
keeps each part as it is, and ``genfn.kernels.linear`` multiplies by each part and concatenates
the outputs, so every part keeps its own kernel.
"""

from __future__ import annotations

import torch

from genfn.state.base import pytree_dataclass

__all__ = ["RowStack"]


@pytree_dataclass
class RowStack:
    parts: tuple

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def device(self) -> torch.device:
        first = self.parts[0]
        return first.device

    def map_parts(self, fn) -> "RowStack":
        return RowStack(tuple(fn(p) for p in self.parts))

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() if hasattr(p, "dequantize") else p.float() for p in self.parts])

    def __repr__(self) -> str:
        return f"RowStack({', '.join(map(repr, self.parts))})"
