"""Block-quantized matrices in the row-major form GGUF stores them: ``RowBlocks``.

A ``RowBlocks`` value is what a loader hands over before the model is assembled: rows can be
permuted (llama.cpp's Q/K order) and concatenated (fused q/k/v, gate/up) without touching a
single code or scale, because every quantization block lies inside one row. Later
``QuantizedWeight.from_rows`` repacks it into the kernel's tiles.

Formats (``w`` a weight, ``u`` its stored code, ``d``/``m`` float16 scale/minimum per group):

    q8_0   groups of 32, w = d * q, q int8 in [-127, 127]     (GGUF Q8_0, 34 bytes / 32 weights)
    q4_0   groups of 32, w = d * (u - 8), u in [0, 15]        (GGUF Q4_0, 18 bytes / 32 weights)
    q4_1   groups of 32, w = d * u + m, u in [0, 15]          (GGUF Q4_1, 20 bytes / 32 weights)
    q5_0   groups of 32, w = d * (u - 16), u in [0, 31]       (GGUF Q5_0, 22 bytes / 32 weights)
    q5_1   groups of 32, w = d * u + m, u in [0, 31]          (GGUF Q5_1, 24 bytes / 32 weights)
    int8   one group per row (channel-wise), w = d * q        (torch-style weight-only int8)
    int4   groups of 64, w = d * u + m, u in [0, 15]          (torch-style group-wise int4)

Codes are always stored per block of 32 inputs as GGUF lays them out: 32 signed bytes for the
8-bit formats; 16 bytes for the 4-bit ones, byte ``j`` holding input ``j`` in its low nibble and
input ``j + 16`` in its high nibble; for the 5-bit ones a little-endian 32-bit word of fifth bits
(bit ``j`` input ``j``'s) and then those 16 nibble bytes, 20 bytes in the order of GGUF's record.
Quantizing from float follows ggml's reference rounding.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch


__all__ = ["RowBlocks", "FORMATS", "GGUF_FORMATS", "GGUF_TYPE_OF_FORMAT", "BLOCK", "code_bytes", "common_format",
           "widen", "quantize", "dequantize", "from_gguf_bytes", "gguf_block_fields"]

BLOCK = 32
# Inputs per scale; None means one scale for the whole row.
_GROUP = {"q8_0": 32, "q4_0": 32, "q4_1": 32, "q5_0": 32, "q5_1": 32, "int8": None, "int4": 64}
FORMATS = tuple(_GROUP)
EIGHT_BIT = frozenset({"q8_0", "int8"})
FIVE_BIT = frozenset({"q5_0", "q5_1"})
WITH_MINIMUM = frozenset({"q4_1", "q5_1", "int4"})
# What a code is offset by (w = d * (u - offset)) in the formats without a minimum.
CODE_OFFSET = {"q4_0": 8, "q5_0": 16, "q8_0": 0, "int8": 0}
# ggml type names -> format; these are the GGUF types kept as blocks (others are dequantized).
# llama.cpp writes Q5_0 (Q5_1) where a Q4_K (Q5_K) mix meets a matrix whose inputs are no multiple
# of 256: every q/k/v/o and gate/up matrix of SmolLM2's 576-wide or Qwen2.5-0.5B's 896-wide layers.
GGUF_FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1"}
GGUF_TYPE_OF_FORMAT = {fmt: name for name, fmt in GGUF_FORMATS.items()}
# The formats each format's blocks widen into value for value (``widen``), narrowest first. The
# kernels' integer sums are unchanged too (codes and their offsets move together, scales and
# minimums stay), so a widened matrix gives the same products bit for bit, at more bytes read.
_WIDER = {"q4_0": ("q5_0", "q8_0"), "q5_0": ("q8_0",), "q4_1": ("q5_1",)}


@dataclasses.dataclass(frozen=True)
class RowBlocks:
    """An ``[out_features, in_features]`` matrix of quantization blocks, rows in storage order.

    codes:  uint8 ``[N, K // 32, 32]`` (8-bit formats; int8 values as their bytes),
            ``[N, K // 32, 16]`` (4-bit formats, two inputs a byte) or ``[N, K // 32, 20]``
            (5-bit formats: the fifth bits' word, then the nibbles).
    scales: float16 ``[N, groups]``; mins: float16 ``[N, groups]`` for q4_1/q5_1/int4, else None.
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


def code_bytes(fmt: str) -> int:
    """The bytes of codes one block of 32 inputs takes in ``fmt`` (a row's; ``RowBlocks.codes``' last dim)."""
    return 32 if fmt in EIGHT_BIT else 20 if fmt in FIVE_BIT else 16


def _gguf_record(fmt: str) -> np.dtype:
    """One GGUF block of ``fmt`` as a numpy structured type (``gguf_block_fields``' fields)."""
    width = code_bytes(fmt)
    head = 4 if fmt in WITH_MINIMUM else 2
    names, formats, offsets = ["d", "q", "words"], ["<f2", ("u1", width), ("<u4", width // 4)], [0, head, head]
    if fmt in WITH_MINIMUM:
        names, formats, offsets = names + ["m"], formats + ["<f2"], offsets + [2]
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": head + width})


def gguf_block_fields(raw: np.ndarray, ggml_type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A GGUF tensor's blocks (``raw``: its uint8 data, e.g. a view of the file mapping) as a numpy
    structured view ``[rows, cols // 32]``, no copy: fields ``d`` (float16 scale), ``m`` (float16
    minimum, Q4_1 and Q5_1 only), ``q`` (the code bytes: a Q5 record's fifth bits, then its nibbles)
    and ``words`` (the same codes as uint32, four bytes a word: the unit the kernel's tiles interleave)."""
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    block = _gguf_record(GGUF_FORMATS[ggml_type_name])
    return np.ascontiguousarray(raw).reshape(-1).view(block).reshape(rows, cols // BLOCK)


def from_gguf_bytes(raw: np.ndarray, ggml_type_name: str, shape: tuple[int, ...]) -> RowBlocks:
    """``RowBlocks`` holding a GGUF tensor's blocks bit for bit (``raw``: its uint8 data)."""
    fmt = GGUF_FORMATS[ggml_type_name]
    # A structured view splits the fields in numpy's fast copies rather than torch's strided byte
    # copies (seconds per model).
    blocks = gguf_block_fields(raw, ggml_type_name, shape)

    def tensor(name: str) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(blocks[name]))

    return RowBlocks(fmt, tensor("q"), tensor("d"), tensor("m") if fmt in WITH_MINIMUM else None)


def common_format(formats) -> str | None:
    """The narrowest GGUF format that holds blocks of each of ``formats`` value for value (one of
    them, or one they all widen into), or None where there is none (a format with minimums beside
    one without, or a format outside ``GGUF_FORMATS``)."""
    held = None
    for fmt in formats:
        mine = {fmt, *_WIDER.get(fmt, ())} if fmt in GGUF_TYPE_OF_FORMAT else set()
        held = mine if held is None else held & mine
    if not held:
        return None
    return max(held, key=lambda f: len(_WIDER.get(f, ())))  # the narrowest widens into the most


def widen(blocks: RowBlocks, fmt: str) -> RowBlocks:
    """``blocks`` in ``fmt``, a format they widen into (``common_format``): every value, scale and
    minimum kept, the codes moved by the formats' offsets (q4_0's ``u`` is q5_0's ``u + 8`` and
    q8_0's ``u - 8``)."""
    if blocks.format == fmt:
        return blocks
    if fmt not in _WIDER.get(blocks.format, ()):
        raise ValueError(f"{blocks.format} blocks do not widen into {fmt!r}; they widen into "
                         f"{', '.join(_WIDER.get(blocks.format, ())) or 'no other format'}")
    signed = unpack_codes(blocks) - CODE_OFFSET.get(blocks.format, 0)  # u - offset: the values over d (no minimum)
    if fmt in EIGHT_BIT:
        codes = signed.to(torch.int8).view(torch.uint8).contiguous()
    else:
        codes = _pack_five_bits(signed + CODE_OFFSET.get(fmt, 0))
    return RowBlocks(fmt, codes, blocks.scales, blocks.mins)


# ---------------------------------------------------------------------------------------------
# Codes <-> values


def unpack_codes(blocks: RowBlocks) -> torch.Tensor:
    """int16 ``[N, K // 32, 32]``: each input's code (signed for 8-bit formats, 0..15 for 4-bit,
    0..31 for 5-bit)."""
    codes = blocks.codes
    if blocks.format in EIGHT_BIT:
        return codes.view(torch.int8).to(torch.int16)
    fifth = None
    if blocks.format in FIVE_BIT:
        bits = codes[..., :4].to(torch.int16)  # byte i holds inputs 8i..8i+7's fifth bits
        fifth = ((bits.unsqueeze(-1) >> torch.arange(8, dtype=torch.int16)) & 1).flatten(-2)
        codes = codes[..., 4:]
    wide = codes.to(torch.int16)
    nibbles = torch.cat([wide & 0x0F, wide >> 4], dim=-1)
    return nibbles if fifth is None else nibbles | (fifth << 4)


def _pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    u = u.to(torch.uint8)
    return (u[..., :16] | (u[..., 16:] << 4)).contiguous()


def _pack_five_bits(u: torch.Tensor) -> torch.Tensor:
    """Codes 0..31 ``[..., 32]`` as a 5-bit block's 20 bytes: the fifth bits' word, then the nibbles."""
    u = u.to(torch.uint8)
    fifth = ((u >> 4) & 1).reshape(*u.shape[:-1], 4, 8)
    words = (fifth << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
    return torch.cat([words, _pack_nibbles(u & 0x0F)], dim=-1).contiguous()


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
    else:
        w = (q - CODE_OFFSET[blocks.format]) * d if CODE_OFFSET[blocks.format] else q * d
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
    top = 31 if fmt in FIVE_BIT else 15
    pack = _pack_five_bits if fmt in FIVE_BIT else _pack_nibbles
    if fmt in ("q4_0", "q5_0"):
        # ggml: the value of largest magnitude maps to -8 (-16), codes truncate x / d + 8.5 (16.5).
        offset = CODE_OFFSET[fmt]
        idx = w.abs().argmax(-1, keepdim=True)
        extreme = torch.gather(w, -1, idx).squeeze(-1)
        d = extreme / -offset
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        u = torch.clamp(torch.trunc(w * inv.unsqueeze(-1) + (offset + 0.5)), max=top)
        codes = pack(u.reshape(n, k // BLOCK, BLOCK))
        return RowBlocks(fmt, codes, d.to(torch.float16), None)
    # q4_1 / q5_1 / int4: [min, max] onto 0..15 (0..31), codes truncate (x - min) / d + 0.5.
    lo, hi = w.amin(-1), w.amax(-1)
    d = (hi - lo) / top
    if fmt == "int4":
        d, lo = d.to(torch.float16).to(torch.float32), lo.to(torch.float16).to(torch.float32)
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    u = torch.clamp(torch.trunc((w - lo.unsqueeze(-1)) * inv.unsqueeze(-1) + 0.5), 0, top)
    codes = pack(u.reshape(n, k // BLOCK, BLOCK))
    return RowBlocks(fmt, codes, d.to(torch.float16), lo.to(torch.float16))
