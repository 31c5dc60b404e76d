"""``CodedBfloat16``: a bfloat16 linear weight in 12.2 bits a weight, every weight kept.

A decode step at batch 1 waits on memory, and a bfloat16 weight's high byte (its sign and the top 7
bits of its exponent) carries little: within 64 weights of a row the exponents lie close together.
Each weight keeps its low byte as it is; its high byte becomes a 4-bit code against the group's
base (the largest exponent byte of its 64 weights): ``sign << 3 | (base - exponent byte)``. A group
with a weight more than 7 below its base (~0.5 % of a normal matrix's groups, ~1 % with heavier
tails, and any group holding an exact zero) keeps its 64 high bytes whole, "raw". 1.5 bytes a
weight, one a group and 64 a raw group: 0.76x the bytes of bfloat16, and ``decode()`` gives back
every bit of the matrix that was encoded.

Layout of an ``[N, K]`` matrix (``K`` a multiple of 64, ``G = K // 64`` groups a row):

    records    uint8 [N, G * 96]   per pair of groups 192 bytes: group a's 64 low bytes, group b's,
                                   then a's 32 code bytes and b's (an odd last group: 96, its low
                                   bytes then its codes)
    bases      uint8 [N, G]        the group's base; bit 7 set where the group is raw
    raw        uint8 [R, 64]       the raw groups' high bytes, row by row
    raw_start  int64 [N + 1]       row n's raw groups are raw[raw_start[n]:raw_start[n + 1]]

Within a group, low byte (and code) position ``p`` holds word ``8 (p // 16) + p % 16`` for
``p % 16 < 8``, else word ``32 + 8 (p // 16) + p % 16 - 8``: the order in which AVX-512's
``unpacklo/hi_epi8`` of the low and high bytes give back words 0-31 and 32-63. Code byte ``j``
holds position ``j``'s code in its low nibble and position ``32 + j``'s in its high one.

``genfn.kernels.encode_coded_bf16`` encodes (natively); ``genfn.kernels.linear`` multiplies by one
(``genfn/kernels/coded_bf16.cpp``, the plain bfloat16 kernel's sums, so the same bits); the native
layer stack reads the coded layers of a ``quantize="coded_bf16"`` model. ``decode`` here is the
reference, in tensor ops.
"""

from __future__ import annotations

import functools

import torch

from genfn.state.base import pytree_dataclass, static_field

__all__ = ["CodedBfloat16", "GROUP", "encodable"]

GROUP = 64
_GROUP_BYTES = 96


def encodable(weight) -> bool:
    """Whether ``weight`` can be coded: a 2-D bfloat16 CPU tensor whose rows are whole groups of 64."""
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and weight.shape[1] % GROUP == 0 and weight.shape[1] > 0
            and not weight.requires_grad)


@pytree_dataclass
class CodedBfloat16:
    records: torch.Tensor
    bases: torch.Tensor
    raw: torch.Tensor
    raw_start: torch.Tensor
    out_features: int = static_field()
    in_features: int = static_field()

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    @property
    def device(self) -> torch.device:
        return self.records.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.records, self.bases, self.raw, self.raw_start))

    @property
    def raw_groups(self) -> int:
        return self.raw.shape[0]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.records, self.bases, self.raw, self.raw_start)

    def decode(self) -> torch.Tensor:
        """The bfloat16 ``[out_features, in_features]`` matrix that was encoded, bit for bit."""
        n, k = self.shape
        groups = k // GROUP
        low_at, codes_at, word_of = _offsets(groups)
        records = self.records.reshape(n, groups * _GROUP_BYTES).to(torch.int32)
        low = records[:, low_at]                                          # [n, groups, 64]
        packed = records[:, codes_at]                                     # [n, groups, 32]
        codes = torch.cat((packed & 0x0F, packed >> 4), dim=-1)           # [n, groups, 64]
        base = self.bases.reshape(n, groups).to(torch.int32)
        high = ((base & 0x7F).unsqueeze(-1) - (codes & 7)) | ((codes & 8) << 4)
        raw = (base & 0x80) != 0
        if bool(raw.any()):
            high[raw] = self.raw.to(torch.int32)  # raw groups in row-major order: the raw list's order
        words = (high << 8) | low                                         # [n, groups, 64] by position
        out = torch.empty_like(words)
        out[..., word_of] = words
        return out.reshape(n, k).to(torch.int16).view(torch.bfloat16)

    def dequantize(self) -> torch.Tensor:
        """``decode()``: the values the kernels multiply by (as ``QuantizedWeight.dequantize`` names them)."""
        return self.decode()

    def __repr__(self) -> str:
        return (f"CodedBfloat16({self.out_features}x{self.in_features}, {self.raw_groups} raw groups, "
                f"{8 * self.nbytes / (self.out_features * self.in_features):.2f} bits a weight)")


@functools.lru_cache(maxsize=16)
def _offsets(groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indices into a row's records of each group's low bytes ``[groups, 64]`` and code bytes
    ``[groups, 32]``, and the word each position holds ``[64]``."""
    g = torch.arange(groups)
    pair_start = (g // 2) * 2 * _GROUP_BYTES
    paired = (g | 1) < groups
    low_start = pair_start + (g % 2) * GROUP
    codes_start = pair_start + torch.where(paired, 2 * GROUP, GROUP) + (g % 2) * (GROUP // 2)
    low_at = low_start.unsqueeze(1) + torch.arange(GROUP)
    codes_at = codes_start.unsqueeze(1) + torch.arange(GROUP // 2)
    p = torch.arange(GROUP)
    lane, k = p // 16, p % 16
    word_of = torch.where(k < 8, 8 * lane + k, 32 + 8 * lane + k - 8)
    return low_at, codes_at, word_of
