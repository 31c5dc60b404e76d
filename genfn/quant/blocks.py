"""Block-quantized matrices in the row-major form GGUF stores them: ``RowBlocks``.

A ``RowBlocks`` value is what a loader hands over before the model is assembled: rows can be
permuted (llama.cpp's Q/K order) and concatenated (fused q/k/v, gate/up) without touching a
single code or scale, because every quantization block lies inside one row. Later
``QuantizedWeight.from_rows`` repacks it into the kernel's tiles.

Formats (``w`` a weight, ``u`` its stored code, ``d``/``m`` float16 scale/minimum per group):

    q8_0   groups of 32, w = d * q, q int8 in [-127, 127]     (GGUF Q8_0, 34 bytes / 32 weights)
    q4_0   groups of 32, w = d * (u - 8), u in [0, 15]        (GGUF Q4_0, 18 bytes / 32 weights)
    q4_1   groups of 32, w = d * u + m, u in [0, 15]          (GGUF Q4_1, 20 bytes / 32 weights)
    int8   one group per row (channel-wise), w = d * q        (torch-style weight-only int8)
    int4   groups of 64, w = d * u + m, u in [0, 15]          (torch-style group-wise int4)

Codes are always stored per block of 32 inputs as GGUF lays them out: 32 signed bytes for the
8-bit formats; 16 bytes for the 4-bit ones, byte ``j`` holding input ``j`` in its low nibble and
input ``j + 16`` in its high nibble. Quantizing from float follows ggml's reference rounding.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch


__all__ = ["RowBlocks", "FORMATS", "GGUF_FORMATS", "GGUF_WIDENED", "widen_gguf_blocks", "BLOCK", "quantize", "dequantize", "from_gguf_bytes",
           "gguf_block_fields"]

BLOCK = 32
# Inputs per scale; None means one scale for the whole row.
_GROUP = {"q8_0": 32, "q4_0": 32, "q4_1": 32, "int8": None, "int4": 64}
FORMATS = tuple(_GROUP)
EIGHT_BIT = frozenset({"q8_0", "int8"})
WITH_MINIMUM = frozenset({"q4_1", "int4"})
# ggml type names -> format; these are the GGUF types kept as blocks (others are dequantized).
GGUF_FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
# ggml types kept as another kept type's blocks, value for value (``widen_gguf_blocks``). llama.cpp
# writes Q5_0 where a Q4_K mix meets a matrix whose inputs are no multiple of 256 (every q/k/v/o and
# gate/up matrix of SmolLM2's 576-wide or Qwen2.5-0.5B's 896-wide layers): as Q8_0 it takes 8.5 bits a
# weight instead of float32's 32, and the 8-bit tiles' products give llama.cpp's Q5_0 sums (an
# integer dot per block, then its two scales).
GGUF_WIDENED = {"Q5_0": "Q8_0"}


@dataclasses.dataclass(frozen=True)
class RowBlocks:
    """An ``[out_features, in_features]`` matrix of quantization blocks, rows in storage order.

    codes:  uint8 ``[N, K // 32, 32]`` (8-bit formats; int8 values as their bytes) or
            ``[N, K // 32, 16]`` (4-bit formats, two inputs a byte).
    scales: float16 ``[N, groups]``; mins: float16 ``[N, groups]`` for q4_1/int4, else None.
    """

    format: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1] * BLOCK)

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scales.shape[1]

    def map_rows(self, fn) -> "RowBlocks":
        """The same blocks with ``fn`` (a function of a tensor whose dim 0 is rows) applied to every part."""
        # Codes move four bytes at a time (a quarter of the elements to copy).
        codes = fn(self.codes.view(torch.int32)).contiguous().view(torch.uint8)
        return RowBlocks(self.format, codes, fn(self.scales).contiguous(),
                         None if self.mins is None else fn(self.mins).contiguous())


def _check_format(fmt: str) -> None:
    if fmt not in _GROUP:
        raise ValueError(f"quantization format must be one of {', '.join(FORMATS)}; got {fmt!r}")


# ---------------------------------------------------------------------------------------------
# GGUF bytes


def gguf_block_fields(raw: np.ndarray, ggml_type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A GGUF tensor's blocks (``raw``: its uint8 data, e.g. a view of the file mapping) as a numpy
    structured view ``[rows, cols // 32]``, no copy: fields ``d`` (float16 scale), ``m`` (float16
    minimum, Q4_1 only), ``q`` (the code bytes) and ``words`` (the same codes as uint32, four bytes
    a word: the unit the kernel's tiles interleave)."""
    fmt = GGUF_FORMATS[ggml_type_name]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    code_bytes = 32 if fmt in EIGHT_BIT else 16
    head = 4 if fmt == "q4_1" else 2
    names, formats, offsets = ["d", "q", "words"], ["<f2", ("u1", code_bytes), ("<u4", code_bytes // 4)], [0, head, head]
    if fmt == "q4_1":
        names, formats, offsets = names + ["m"], formats + ["<f2"], offsets + [2]
    block = np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": head + code_bytes})
    return np.ascontiguousarray(raw).reshape(-1).view(block).reshape(rows, cols // BLOCK)


def widen_gguf_blocks(raw: np.ndarray, ggml_type_name: str) -> tuple[np.ndarray, str]:
    """``(raw, type)``: a tensor's blocks in the kept type ``GGUF_WIDENED`` names for its type (a
    fresh array), or ``raw`` and its type as they are. A Q5_0 block (float16 scale ``d``, 32 high
    bits, 16 bytes of low nibbles) holds codes 0..31 of values ``d * (code - 16)``; its Q8_0 block
    is the same ``d`` and the int8 codes ``code - 16``: the same values, bit for bit."""
    if ggml_type_name != "Q5_0":
        return raw, ggml_type_name
    blocks = np.ascontiguousarray(raw).reshape(-1, 22)
    high = blocks[:, 2:6].copy().view("<u4")  # [n, 1]: bit j is input j's fifth bit
    low = blocks[:, 6:22]
    nibbles = np.concatenate([low & 0x0F, low >> 4], axis=1).astype(np.int16)  # inputs 0..15, then 16..31
    fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
    out = np.empty((blocks.shape[0], 34), np.uint8)
    out[:, :2] = blocks[:, :2]
    out[:, 2:] = (nibbles + (fifth << 4) - 16).astype(np.int8).view(np.uint8)
    return out.reshape(*raw.shape[:-1], -1) if raw.ndim > 1 else out.reshape(-1), "Q8_0"


def from_gguf_bytes(raw: np.ndarray, ggml_type_name: str, shape: tuple[int, ...]) -> RowBlocks:
    """``RowBlocks`` holding a GGUF tensor's blocks bit for bit (``raw``: its uint8 data)."""
    fmt = GGUF_FORMATS[ggml_type_name]
    # A structured view splits the fields in numpy's fast copies rather than torch's strided byte
    # copies (seconds per model).
    blocks = gguf_block_fields(raw, ggml_type_name, shape)

    def tensor(name: str) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(blocks[name]))

    return RowBlocks(fmt, tensor("q"), tensor("d"), tensor("m") if fmt == "q4_1" else None)


# ---------------------------------------------------------------------------------------------
# Codes <-> values


def unpack_codes(blocks: RowBlocks) -> torch.Tensor:
    """int16 ``[N, K // 32, 32]``: each input's code (signed for 8-bit formats, 0..15 for 4-bit)."""
    codes = blocks.codes
    if blocks.format in EIGHT_BIT:
        return codes.view(torch.int8).to(torch.int16)
    wide = codes.to(torch.int16)
    return torch.cat([wide & 0x0F, wide >> 4], dim=-1)


def _pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    u = u.to(torch.uint8)
    return (u[..., :16] | (u[..., 16:] << 4)).contiguous()


def _per_block(values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``[N, groups]`` scales expanded to one per block of 32: ``[N, K // 32]``."""
    blocks = shape[1] // BLOCK
    return values.repeat_interleave(blocks // values.shape[1], dim=1)


def dequantize(blocks: RowBlocks) -> torch.Tensor:
    """float32 ``[N, K]`` values, computed as ggml does (one float32 rounding at most)."""
    q = unpack_codes(blocks).to(torch.float32)
    d = _per_block(blocks.scales, blocks.shape).to(torch.float32).unsqueeze(-1)
    if blocks.format in WITH_MINIMUM:
        m = _per_block(blocks.mins, blocks.shape).to(torch.float32).unsqueeze(-1)
        w = q * d + m
    elif blocks.format == "q4_0":
        w = (q - 8) * d
    else:
        w = q * d
    return w.reshape(blocks.shape)


def quantize(weight: torch.Tensor, fmt: str) -> RowBlocks:
    """Round-to-nearest quantization of a float ``[N, K]`` matrix (``K`` a multiple of 32, or of
    64 for int4) into ``fmt``, with ggml's reference rounding for the GGUF formats."""
    _check_format(fmt)
    if weight.dim() != 2:
        raise ValueError(f"quantize needs a 2-D weight; got shape {tuple(weight.shape)}")
    n, k = weight.shape
    group = _GROUP[fmt] or k
    if k % BLOCK or k % group:
        raise ValueError(f"{fmt} needs in_features to be a multiple of {max(group, BLOCK)}; got {k}")
    w = weight.detach().to(torch.float32).reshape(n, k // group, group)
    if fmt in ("q8_0", "int8"):
        amax = w.abs().amax(-1)
        d = amax / 127
        if fmt == "int8":  # quantize against the scale that is stored
            d = d.to(torch.float16).to(torch.float32)
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round(w * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        codes = q.reshape(n, k // BLOCK, BLOCK).view(torch.uint8)
        return RowBlocks(fmt, codes.contiguous(), d.to(torch.float16), None)
    if fmt == "q4_0":
        # ggml: the value of largest magnitude maps to -8, codes truncate x / d + 8.5.
        idx = w.abs().argmax(-1, keepdim=True)
        extreme = torch.gather(w, -1, idx).squeeze(-1)
        d = extreme / -8
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        u = torch.clamp(torch.trunc(w * inv.unsqueeze(-1) + 8.5), max=15)
        codes = _pack_nibbles(u.reshape(n, k // BLOCK, BLOCK))
        return RowBlocks(fmt, codes, d.to(torch.float16), None)
    # q4_1 / int4: [min, max] onto 0..15, codes truncate (x - min) / d + 0.5.
    lo, hi = w.amin(-1), w.amax(-1)
    d = (hi - lo) / 15
    if fmt == "int4":
        d, lo = d.to(torch.float16).to(torch.float32), lo.to(torch.float16).to(torch.float32)
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    u = torch.clamp(torch.trunc((w - lo.unsqueeze(-1)) * inv.unsqueeze(-1) + 0.5), 0, 15)
    codes = _pack_nibbles(u.reshape(n, k // BLOCK, BLOCK))
    return RowBlocks(fmt, codes, d.to(torch.float16), lo.to(torch.float16))
