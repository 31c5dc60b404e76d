"""``QuantizedExperts``: a mixture of experts' stacked projection (``[E, out, in]``) kept in a
block format, each expert's blocks one contiguous slice of the stack.

llama.cpp stores each MoE projection as one 3-D tensor (``ffn_gate_exps``, ``ffn_up_exps``,
``ffn_down_exps``: ``[E, rows, cols]``) in the file's quantization. Its blocks never cross a row,
so expert ``e`` is rows ``e * out .. (e + 1) * out`` of the flattened matrix, and every expert is
kept as the kernels read it:

    q8_0 / q4_0 / q4_1 (and int8 / int4 when ``quantize=`` makes them): the tile layout of
        ``QuantizedWeight`` per expert, stacked: codes ``[E, tiles, blocks, bytes]``, scales (and
        mins) ``[E, tiles, blocks, 16]``; expert e is ``QuantizedWeight(codes[e], scales[e], ...)``
    q4_k / q5_k / q6_k / iq4_nl / iq4_xs: the file's blocks row by row, ``codes`` uint8 ``[E, out, row bytes]``
        (``scales``/``mins`` None); expert e is ``KQuantWeight(codes[e])``

A decode step's native MoE kernels (``genfn/kernels/moe_decode.cpp`` for the tile formats,
``kquant_linear.cpp``'s ``kquant_moe_decode`` for the K-quants) take the stacks and read only the
chosen experts' slices; other calls take ``expert(e)`` views into the ordinary quantized linears.
"""

from __future__ import annotations

import torch

from genfn.quant.blocks import RowBlocks, dequantize
from genfn.quant.kquants import K_FORMATS, KQuantWeight
from genfn.quant.weight import KERNEL_KIND, TILE, QuantizedWeight
from genfn.state.base import pytree_dataclass, static_field

__all__ = ["QuantizedExperts", "fuse_expert_rows"]


@pytree_dataclass
class QuantizedExperts:
    codes: torch.Tensor
    scales: torch.Tensor | None
    mins: torch.Tensor | None
    format: str = static_field()
    out_features: int = static_field()
    in_features: int = static_field()

    @property
    def num_experts(self) -> int:
        return self.codes.shape[0]

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_experts, self.out_features, self.in_features)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def is_k_quant(self) -> bool:
        return self.format in K_FORMATS

    @property
    def kind(self) -> int:
        """The tile kernel's dot product (``QuantizedWeight.kind``); K-quants have none."""
        return KERNEL_KIND[self.format]

    @property
    def nbytes(self) -> int:
        parts = [p for p in (self.codes, self.scales, self.mins) if p is not None]
        return sum(p.numel() * p.element_size() for p in parts)

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert's blocks: what the kernels read per chosen expert."""
        return self.nbytes // self.num_experts

    def expert(self, e: int) -> QuantizedWeight | KQuantWeight:
        """Expert ``e``'s matrix as the quantized linears take it (a view, no copy)."""
        if self.is_k_quant:
            return KQuantWeight(self.codes[e], self.format, self.out_features, self.in_features)
        return QuantizedWeight(self.codes[e], self.scales[e], None if self.mins is None else self.mins[e], self.format,
                               self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[E, out, in]``: the values the kernels multiply by."""
        return torch.stack([self.expert(e).dequantize() for e in range(self.num_experts)])

    @classmethod
    def from_blocks(cls, blocks: RowBlocks | KQuantWeight, num_experts: int) -> "QuantizedExperts":
        """The stack of ``num_experts`` experts from their blocks flattened to ``[E * out, in]`` rows."""
        rows, cols = blocks.shape
        if num_experts < 1 or rows % num_experts:
            raise ValueError(f"num_experts must divide the {rows} rows of the stacked blocks; got {num_experts}")
        out = rows // num_experts
        if isinstance(blocks, KQuantWeight):
            return cls(blocks.data.reshape(num_experts, out, -1), None, None, blocks.format, out, cols)
        if out % TILE:  # rows are the inputs of another projection: always a multiple of 32 in these formats
            raise ValueError(f"each expert's rows ({out}) must fill whole tiles of {TILE}")
        # Every expert fills whole tiles: tile the stack at once, then split it per expert.
        whole = QuantizedWeight.from_rows(blocks)
        split = [None if t is None else t.reshape(num_experts, -1, *t.shape[1:])
                 for t in (whole.codes, whole.scales, whole.mins)]
        return cls(*split, whole.format, out, cols)

    def __repr__(self) -> str:
        return f"QuantizedExperts({self.format}, {self.num_experts}x{self.out_features}x{self.in_features})"


def _per_expert_cat(tensors: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """Row-concatenation per expert of ``[E * n_i, ...]`` tensors: ``[E * sum(n_i), ...]``."""
    parts = [t.reshape(num_experts, -1, *t.shape[1:]) for t in tensors]
    return torch.cat(parts, dim=1).reshape(-1, *tensors[0].shape[1:])


def fuse_expert_rows(parts: list, num_experts: int) -> "QuantizedExperts | torch.Tensor":
    """Each expert's rows of ``parts`` concatenated (llama.cpp's gate and up stacks -> one
    ``[E, 2I, H]`` gate/up stack), blocks untouched: ``parts`` are ``RowBlocks`` or ``KQuantWeight``
    of one format, each ``[E * n_i, in]`` rows, or float ``[E, n_i, in]`` tensors. Parts in
    different formats (or float among blocks) are dequantized to float32 ``[E, sum(n_i), in]``."""
    first = parts[0]
    same = all(type(p) is type(first) and not isinstance(p, torch.Tensor) and p.format == first.format
               and p.shape[1] == first.shape[1] for p in parts)
    if same and isinstance(first, KQuantWeight):
        data = _per_expert_cat([p.data for p in parts], num_experts)
        return QuantizedExperts.from_blocks(KQuantWeight(data, first.format, data.shape[0], first.in_features),
                                            num_experts)
    if same and isinstance(first, RowBlocks) and len({p.group_size for p in parts}) == 1:
        mins = None if first.mins is None else _per_expert_cat([p.mins for p in parts], num_experts)
        fused = RowBlocks(first.format, _per_expert_cat([p.codes for p in parts], num_experts),
                          _per_expert_cat([p.scales for p in parts], num_experts), mins)
        return QuantizedExperts.from_blocks(fused, num_experts)

    def dense(p) -> torch.Tensor:
        if isinstance(p, torch.Tensor):
            return p
        values = dequantize(p) if isinstance(p, RowBlocks) else p.dequantize()
        return values.reshape(num_experts, -1, values.shape[-1])

    floats = [dense(p) for p in parts]
    if any(not isinstance(p, torch.Tensor) for p in parts):
        floats = [f.float() for f in floats]
    return torch.cat(floats, dim=1).contiguous() if len(floats) > 1 else floats[0]
