"""GGUF's K-quant formats (and IQ4_NL/IQ4_XS) kept as the file stores them: ``KQuantWeight``.

Q4_K, Q5_K and Q6_K pack 256 inputs into a super-block (llama.cpp's ``block_q4_K`` etc.):

    q4_k  144 bytes: d, dmin (float16), 12 bytes of 6-bit scales/mins for 8 groups of 32, 128
          bytes of 4-bit codes;               w = d * sc_g * u - dmin * m_g, u in [0, 15]
    q5_k  176 bytes: as q4_k plus 32 bytes holding each input's fifth bit; u in [0, 31]
    q6_k  210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16
          inputs), d (float16);               w = d * sc_16 * (u - 32), u in [0, 63]

IQ4_NL (32 inputs, 18 bytes) and IQ4_XS (256 inputs, 136 bytes) index a fixed non-linear table
of 16 values (``genfn.quant.iq4``); ``KQuantWeight`` holds them too (formats ``iq4_nl``,
``iq4_xs``).

``q4_k_r8`` is Q4_K with its rows interleaved 8 to a group (``repack_r8``; the layout is in
``genfn/kernels/kquant.h``), the same bytes rearranged so that the decode kernel's one activation
load serves 8 rows (``kquant_r8.cpp``); ``q5_k_r8``, ``q6_k_r8`` and ``iq4_xs_r8`` are Q5_K, Q6_K and
IQ4_XS alike (IQ4_XS's index nibbles paired anew). The GGUF loader repacks every matrix a decode step
reads whole so (a layer's, the LM head, a tied embedding), its Q6_K and IQ4_XS ones where the CPU has
AVX-512 VNNI (their group kernels' ISA); a row of such ``data`` is no one
matrix row, and ``dequantize``/``map_rows`` put the rows back first (``genfn.kernels.embedding`` a
token's group of 8).

A ``KQuantWeight`` holds a matrix's blocks row by row, byte for byte as in the file (``data``
uint8 ``[out_features, in_features / block_inputs * block_bytes]``): no repacking, so the loader
can hand over the file's own memory. ``genfn.kernels.linear`` runs it through the native kernels
(``kquant_linear.cpp``, ``iq4_linear.cpp``), which quantize the activation as llama.cpp's Q8_K
does: one scale per 256 inputs (per 32 for iq4_nl, whose rows need not be multiples of 256),
``quantize_activations_k``.

``dequantize_k`` is bit for bit the ``gguf`` package's ``gguf.quants.dequantize``; ``quantize_k``
is a plain round-to-nearest quantizer (not llama.cpp's search for the best scales) that writes
valid blocks, for tests and benchmark models (the gguf package quantizes none of these formats).
"""

from __future__ import annotations

import torch

from genfn.quant.iq4 import IQ4_BLOCK_BYTES, IQ4_BLOCK_INPUTS, dequantize_iq4, quantize_iq4
from genfn.quant.views import joined_rows
from genfn.state.base import pytree_dataclass, static_field

__all__ = ["KQuantWeight", "K_FORMATS", "GGUF_K_FORMATS", "SUPER_BLOCK", "BLOCK_BYTES", "BLOCK_INPUTS",
           "INTERLEAVED", "INTERLEAVED_OF", "dequantize_k", "quantize_k", "quantize_activations_k",
           "reference_linear_k", "repack_r8", "unpack_k", "unpack_r8"]

SUPER_BLOCK = 256
BLOCK_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210, **IQ4_BLOCK_BYTES, "q4_k_r8": 144, "q5_k_r8": 176,
               "q6_k_r8": 210, "iq4_xs_r8": 136}
# Inputs per block; the activations are quantized with one scale per as many inputs.
BLOCK_INPUTS = {"q4_k": SUPER_BLOCK, "q5_k": SUPER_BLOCK, "q6_k": SUPER_BLOCK, **IQ4_BLOCK_INPUTS,
                "q4_k_r8": SUPER_BLOCK, "q5_k_r8": SUPER_BLOCK, "q6_k_r8": SUPER_BLOCK, "iq4_xs_r8": SUPER_BLOCK}
# Rows per group of the interleaved formats.
R8_ROWS = 8
# The interleaved formats and the file's format each rearranges.
INTERLEAVED = {"q4_k_r8": "q4_k", "q5_k_r8": "q5_k", "q6_k_r8": "q6_k", "iq4_xs_r8": "iq4_xs"}
# The other way: the interleaved format of a stored one that has one.
INTERLEAVED_OF = {stored: fmt for fmt, stored in INTERLEAVED.items()}
# ggml type names -> format: the GGUF types kept as ``KQuantWeight`` blocks.
GGUF_K_FORMATS = {"Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k", "IQ4_NL": "iq4_nl", "IQ4_XS": "iq4_xs"}
# The formats of GGUF files (the INTERLEAVED ones are genfn's rearrangements of q4_k, q5_k and q6_k).
K_FORMATS = tuple(GGUF_K_FORMATS.values())
# The native op's format argument, by format and back.
FORMAT_ID = {fmt: i for i, fmt in enumerate(BLOCK_BYTES)}
FORMAT_NAME = tuple(BLOCK_BYTES)


def _check_format(fmt: str) -> None:
    if fmt not in BLOCK_BYTES:
        raise ValueError(f"K-quant format must be one of {', '.join(BLOCK_BYTES)}; got {fmt!r}")


@pytree_dataclass
class KQuantWeight:
    """An ``[out_features, in_features]`` matrix of K-quant (or IQ4) blocks, rows as stored in GGUF."""

    data: torch.Tensor
    format: str = static_field()
    out_features: int = static_field()
    in_features: int = static_field()

    def __post_init__(self):
        _check_format(self.format)
        block = BLOCK_INPUTS[self.format]
        if self.in_features % block:
            raise ValueError(f"{self.format} needs in_features to be a multiple of {block}; got {self.in_features}")
        row_bytes = self.in_features // block * BLOCK_BYTES[self.format]
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != (self.out_features, row_bytes):
            raise ValueError(f"{self.format} data must be uint8 [{self.out_features}, {row_bytes}]; "
                             f"got {self.data.dtype} {list(self.data.shape)}")
        if self.format in INTERLEAVED and self.out_features % R8_ROWS:
            raise ValueError(f"{self.format} needs out_features to be a multiple of {R8_ROWS}; got {self.out_features}")

    @classmethod
    def from_bytes(cls, data: torch.Tensor, fmt: str, shape: tuple[int, int]) -> "KQuantWeight":
        return cls(data.reshape(shape[0], -1), fmt, int(shape[0]), int(shape[1]))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def map_rows(self, fn) -> "KQuantWeight":
        """The same super-blocks with ``fn`` (a function of a tensor whose dim 0 is rows) applied to the rows."""
        if self.format in INTERLEAVED:
            return repack_r8(unpack_r8(self).map_rows(fn))
        return KQuantWeight(fn(self.data).contiguous(), self.format, self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return dequantize_k(self.data, self.format).reshape(self.shape)

    def __repr__(self) -> str:
        return f"KQuantWeight({self.format}, {self.out_features}x{self.in_features})"


def cat_k(parts: list) -> KQuantWeight:
    """Row-concatenation of ``KQuantWeight``s of one format and width (blocks untouched)."""
    first = parts[0]
    if any(p.format != first.format or p.in_features != first.in_features for p in parts):
        raise ValueError("cat_k needs parts of one format and width")
    data = joined_rows([p.data for p in parts])  # parts the GGUF loader wrote back to back: a view
    return KQuantWeight(torch.cat([p.data for p in parts]) if data is None else data, first.format,
                        sum(p.out_features for p in parts), first.in_features)


# ---------------------------------------------------------------------------------------------
# Bytes <-> values


def _pair_nibbles(pairs: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8 ``pairs`` (size 2 along ``dim``: bytes a, b) as (low(a) | low(b) << 4, high(a) | high(b) << 4):
    an IQ4_XS sub-block's bytes j and 8 + j into iq4_xs_r8's runs 0 and 1, and, being its own inverse,
    back (kquant.h's pair_nibbles)."""
    first, second = pairs.unbind(dim)
    return torch.stack([(first & 0x0F) | (second << 4), (first >> 4) | (second & 0xF0)], dim=dim)


def _r8_fields(groups: torch.Tensor) -> list[torch.Tensor]:
    """The fields of an interleaved super-block (d, dmin, scales, codes; Q5_K's fifth bits after;
    Q6_K's d, scales, low and high runs; IQ4_XS's d, low and high scale bits, index runs), each with
    the 8 rows of a group as the interleaved layout has them (kquant.h), from ``groups [G,
    super-blocks, 8, block bytes]``."""
    g, nb, _, size = groups.shape
    if size == BLOCK_BYTES["iq4_xs"]:
        # Sub-block s's bytes j and 8 + j (j < 8) of each row: run 0 pairs their low nibbles, run 1 their high.
        runs = _pair_nibbles(groups[..., 8:].reshape(g, nb, 8, 8, 2, 8), dim=4)
        return [groups[..., 0:2].reshape(g, nb, 16), groups[..., 4:8].reshape(g, nb, 32),
                groups[..., 2:4].reshape(g, nb, 16), runs.permute(0, 1, 3, 4, 2, 5).reshape(g, nb, 1024)]
    if size == BLOCK_BYTES["q6_k"]:
        return [groups[..., 208:210].reshape(g, nb, 16), groups[..., 192:208].transpose(2, 3).reshape(g, nb, 128),
                groups[..., :128].reshape(g, nb, 8, 16, 8).transpose(2, 3).reshape(g, nb, 1024),
                groups[..., 128:192].reshape(g, nb, 8, 8, 8).transpose(2, 3).reshape(g, nb, 512)]
    codes = 48 if size == BLOCK_BYTES["q5_k"] else 16
    fields = [groups[..., 0:2].reshape(g, nb, 16), groups[..., 2:4].reshape(g, nb, 16),
              groups[..., 4:16].reshape(g, nb, 8, 3, 4).transpose(2, 3).reshape(g, nb, 96),
              groups[..., codes:].reshape(g, nb, 8, 4, 4, 8).permute(0, 1, 3, 4, 2, 5).reshape(g, nb, 1024)]
    if codes == 48:
        fields.append(groups[..., 16:48].reshape(g, nb, 8, 4, 8).transpose(2, 3).reshape(g, nb, 256))
    return fields


def repack_r8(weight: KQuantWeight) -> KQuantWeight:
    """A Q4_K, Q5_K, Q6_K or IQ4_XS matrix with its rows interleaved 8 to a group (``q4_k_r8``,
    ``q5_k_r8``, ``q6_k_r8``, ``iq4_xs_r8``; rows a multiple of 8)."""
    if weight.format not in INTERLEAVED_OF or weight.out_features % R8_ROWS:
        raise ValueError(f"repack_r8 needs a q4_k, q5_k, q6_k or iq4_xs weight whose rows are a multiple of "
                         f"{R8_ROWS}; got {weight!r}")
    n, row_bytes = weight.data.shape
    size = BLOCK_BYTES[weight.format]
    groups = weight.data.reshape(n // R8_ROWS, R8_ROWS, -1, size).transpose(1, 2)
    data = torch.cat(_r8_fields(groups), dim=-1).reshape(n, row_bytes)
    return KQuantWeight(data, INTERLEAVED_OF[weight.format], weight.out_features, weight.in_features)


def unpack_r8(weight: KQuantWeight) -> KQuantWeight:
    """``repack_r8``'s inverse: the rows as GGUF stores them, byte for byte."""
    if weight.format not in INTERLEAVED:
        raise ValueError(f"unpack_r8 needs a q4_k_r8, q5_k_r8, q6_k_r8 or iq4_xs_r8 weight; got {weight!r}")
    stored = INTERLEAVED[weight.format]
    size = BLOCK_BYTES[stored]
    n, row_bytes = weight.data.shape
    g, nb = n // R8_ROWS, row_bytes // size
    blocks = weight.data.reshape(g, nb, R8_ROWS * size)
    if stored == "iq4_xs":  # as stored: d, scales_h, scales_l, then 16 index bytes a sub-block
        runs = blocks[..., 64:].reshape(g, nb, 8, 2, 8, 8).permute(0, 1, 4, 2, 3, 5)  # [g, nb, row, s, run, j]
        q = _pair_nibbles(runs, dim=4)
        fields = [blocks[..., 0:16].reshape(g, nb, 8, 2), blocks[..., 48:64].reshape(g, nb, 8, 2),
                  blocks[..., 16:48].reshape(g, nb, 8, 4), q.reshape(g, nb, 8, 128)]
        rows = torch.cat(fields, dim=-1).transpose(1, 2).reshape(n, row_bytes)
        return KQuantWeight(rows, stored, weight.out_features, weight.in_features)
    if stored == "q6_k":  # as stored: ql, qh, scales, d
        fields = [blocks[..., 144:1168].reshape(g, nb, 16, 8, 8).transpose(2, 3).reshape(g, nb, 8, 128),
                  blocks[..., 1168:].reshape(g, nb, 8, 8, 8).transpose(2, 3).reshape(g, nb, 8, 64),
                  blocks[..., 16:144].reshape(g, nb, 16, 8).transpose(2, 3), blocks[..., 0:16].reshape(g, nb, 8, 2)]
        rows = torch.cat(fields, dim=-1).transpose(1, 2).reshape(n, row_bytes)
        return KQuantWeight(rows, stored, weight.out_features, weight.in_features)
    d, dmin = blocks[..., 0:16].reshape(g, nb, 8, 2), blocks[..., 16:32].reshape(g, nb, 8, 2)
    scales = blocks[..., 32:128].reshape(g, nb, 3, 8, 4).transpose(2, 3).reshape(g, nb, 8, 12)
    codes = blocks[..., 128:1152].reshape(g, nb, 4, 4, 8, 8).permute(0, 1, 4, 2, 3, 5).reshape(g, nb, 8, 128)
    fields = [d, dmin, scales, codes]
    if stored == "q5_k":
        fields.insert(3, blocks[..., 1152:].reshape(g, nb, 4, 8, 8).transpose(2, 3).reshape(g, nb, 8, 32))
    rows = torch.cat(fields, dim=-1).transpose(1, 2).reshape(n, row_bytes)
    return KQuantWeight(rows, stored, weight.out_features, weight.in_features)


def _scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of Q4_K/Q5_K from their 12 bytes ``[n, 12]``: bytes 0-3 hold
    scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for mins; bytes
    8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return scales, mins


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``codes [..., 1, C]`` (uint8) as ``[..., 2, C]``: the low nibbles, then the high ones. One
    broadcast shift rather than a stack of the two halves, which inductor ran as a separate ``cat``
    (a compiled 1B step's Q6_K embedding row took ~57 us in four kernels)."""
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=codes.device).reshape(2, 1)
    return (codes >> shifts) & 0x0F


def unpack_k(data: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """The integer fields of Q4_K/Q5_K/Q6_K bytes (``[..., blocks * block_bytes]``), one row per
    super-block: ``codes`` (uint8, one per input: 0..15, 0..31 or 0..63), ``scales`` (a group's
    6-bit scale, uint8 ``[n, 8]``; Q6_K's signed 8-bit one per 16 inputs, int8 ``[n, 16]``),
    ``mins`` (Q4_K/Q5_K, uint8 ``[n, 8]``), and the float16 ``d`` and ``dmin`` (``[n, 1]``). What
    ``dequantize_k`` multiplies, and what a measure of the format's information counts
    (``benchmarks/code_entropy.py``)."""
    _check_format(fmt)
    if fmt not in ("q4_k", "q5_k", "q6_k"):
        raise ValueError(f"unpack_k: fmt must be one of 'q4_k', 'q5_k', 'q6_k', got {fmt!r}")
    blocks = data.reshape(-1, BLOCK_BYTES[fmt])
    n = blocks.shape[0]

    def f16(start: int) -> torch.Tensor:
        return blocks[:, start:start + 2].contiguous().view(torch.float16)

    if fmt in ("q4_k", "q5_k"):
        scales, mins = _scales_and_mins(blocks[:, 4:16])
        qs = blocks[:, 16 + (32 if fmt == "q5_k" else 0):]
        codes = _nibbles(qs.reshape(n, 4, 1, 32)).reshape(n, 8, 32)
        if fmt == "q5_k":
            qh = blocks[:, 16:48].reshape(n, 1, 32)
            shifts = torch.arange(8, dtype=torch.uint8, device=data.device).reshape(1, 8, 1)
            codes = codes | (((qh >> shifts) & 1) << 4)
        return {"codes": codes.reshape(n, SUPER_BLOCK), "scales": scales, "mins": mins, "d": f16(0), "dmin": f16(2)}
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    low = _nibbles(ql.reshape(n, 2, 1, 64)).reshape(n, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=data.device).reshape(1, 1, 4, 1)
    high = (qh.reshape(n, 2, 1, 32) >> shifts) & 3
    codes = (low | (high << 4)).reshape(n, SUPER_BLOCK)
    return {"codes": codes, "scales": blocks[:, 192:208].view(torch.int8), "d": f16(208)}


def dequantize_k(data: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 values of K-quant bytes (``[..., blocks * block_bytes]`` -> ``[..., blocks * block_inputs]``),
    computed in the gguf package's order of float32 operations (bit for bit its result)."""
    _check_format(fmt)
    if fmt in IQ4_BLOCK_BYTES:
        return dequantize_iq4(data, fmt)
    if fmt in INTERLEAVED:  # [rows, row bytes], whole groups
        rows = unpack_r8(KQuantWeight(data, fmt, data.shape[0], data.shape[1] // BLOCK_BYTES[fmt] * SUPER_BLOCK))
        return dequantize_k(rows.data, rows.format)
    lead = data.shape[:-1]
    fields = unpack_k(data, fmt)
    d = fields["d"].to(torch.float32)
    n = d.shape[0]
    if fmt in ("q4_k", "q5_k"):
        scale = (d * fields["scales"].to(torch.float32)).unsqueeze(-1)
        minimum = (fields["dmin"].to(torch.float32) * fields["mins"].to(torch.float32)).unsqueeze(-1)
        values = scale * fields["codes"].reshape(n, 8, 32).to(torch.float32) - minimum
    else:
        scale = (d * fields["scales"].to(torch.float32)).reshape(n, 16, 1)
        q = fields["codes"].to(torch.int16) - 32
        values = scale * q.reshape(n, 16, 16).to(torch.float32)
    return values.reshape(*lead, -1)


def _round(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)


def quantize_k(weight: torch.Tensor, fmt: str) -> KQuantWeight:
    """Round-to-nearest blocks of a float ``[N, K]`` matrix (``K`` a multiple of 256; of 32 for iq4_nl)."""
    _check_format(fmt)
    block = BLOCK_INPUTS[fmt]
    if weight.dim() != 2 or weight.shape[1] % block:
        raise ValueError(f"quantize_k needs a 2-D weight with in_features a multiple of {block} for {fmt}; "
                         f"got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    if fmt in INTERLEAVED:
        return repack_r8(quantize_k(weight, INTERLEAVED[fmt]))
    if fmt in IQ4_BLOCK_BYTES:
        return KQuantWeight(quantize_iq4(weight, fmt), fmt, rows, cols)
    w = weight.detach().to(torch.float32).reshape(-1, SUPER_BLOCK)
    n = w.shape[0]
    if fmt == "q6_k":
        groups = w.reshape(n, 16, 16)
        step = groups.abs().amax(-1) / 31  # per 16 inputs: codes u - 32 within [-31, 31]
        d = (step.amax(-1) / 127).to(torch.float16)
        df = d.to(torch.float32)
        sc = torch.where(df[:, None] > 0, _round(step / df[:, None].clamp_min(1e-30)), torch.zeros_like(step))
        sc = sc.clamp(0, 127)
        unit = (df[:, None] * sc).unsqueeze(-1)
        u = torch.where(unit > 0, _round(groups / unit.clamp_min(1e-30)), torch.zeros_like(groups))
        u = (u.clamp(-32, 31) + 32).to(torch.uint8).reshape(n, 2, 4, 32)  # [half, group of 32, l]
        ql = torch.cat([(u[:, :, 0] & 0x0F) | (u[:, :, 2] << 4), (u[:, :, 1] & 0x0F) | (u[:, :, 3] << 4)], dim=2).reshape(n, 128)
        qh = ((u[:, :, 0] >> 4) | ((u[:, :, 1] >> 4) << 2) | ((u[:, :, 2] >> 4) << 4)
              | ((u[:, :, 3] >> 4) << 6)).reshape(n, 64)
        parts = [ql, qh, sc.to(torch.int8).view(torch.uint8), d.reshape(n, 1).view(torch.uint8).reshape(n, 2)]
    else:
        levels = 15 if fmt == "q4_k" else 31
        groups = w.reshape(n, 8, 32)
        low = groups.amin(-1).clamp(max=0)
        step = (groups.amax(-1) - low) / levels
        d = (step.amax(-1) / 63).to(torch.float16)
        dmin = ((-low).amax(-1) / 63).to(torch.float16)
        df, dminf = d.to(torch.float32)[:, None], dmin.to(torch.float32)[:, None]
        sc = torch.where(df > 0, _round(step / df.clamp_min(1e-30)), torch.zeros_like(step)).clamp(0, 63)
        m = torch.where(dminf > 0, _round(-low / dminf.clamp_min(1e-30)), torch.zeros_like(low)).clamp(0, 63)
        unit, offset = (df * sc).unsqueeze(-1), (dminf * m).unsqueeze(-1)
        u = torch.where(unit > 0, _round((groups + offset) / unit.clamp_min(1e-30)), torch.zeros_like(groups))
        u = u.clamp(0, levels).to(torch.uint8)  # [n, 8, 32]
        sc, m = sc.to(torch.uint8), m.to(torch.uint8)
        packed = torch.cat([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                            (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], dim=1)
        pairs = u.reshape(n, 4, 2, 32)
        qs = ((pairs[:, :, 0] & 0x0F) | ((pairs[:, :, 1] & 0x0F) << 4)).reshape(n, 128)
        head = [d.reshape(n, 1).view(torch.uint8).reshape(n, 2), dmin.reshape(n, 1).view(torch.uint8).reshape(n, 2),
                packed]
        if fmt == "q5_k":
            bits = (u >> 4) << torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
            head.append(bits.sum(1, dtype=torch.int32).to(torch.uint8))  # disjoint bits: sum == or
        parts = [*head, qs]
    data = torch.cat(parts, dim=1).reshape(rows, -1).contiguous()
    return KQuantWeight(data, fmt, rows, cols)


# ---------------------------------------------------------------------------------------------
# Activations and the reference product


def quantize_activations_k(x: torch.Tensor, block: int = SUPER_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``x [..., K]`` as llama.cpp's Q8_K: per ``block`` inputs (256; 32 for
    iq4_nl), the value of largest magnitude (the first, on ties) maps to -127, codes round half to
    even and are capped at 127; codes are int8-valued float32 ``[..., K // block, block]``, scales
    float32 ``[..., K // block]``."""
    x = x.to(torch.float32)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    index = blocks.abs().argmax(-1, keepdim=True)  # the first maximum, as ggml's strict '>'
    extreme = torch.gather(blocks, -1, index)
    # A tensor divided by a tensor: torch computes `-127.0 / extreme` as -127 * (1 / extreme), which
    # rounds differently from C's -127.f / max now and then, and moves a code where the product
    # lands on a half.
    inverse = torch.where(extreme != 0, torch.full_like(extreme, -127.0) / extreme, torch.zeros_like(extreme))
    codes = torch.round(blocks * inverse).clamp(max=127)
    scale = torch.where(extreme != 0, 1.0 / inverse, torch.zeros_like(inverse)).squeeze(-1)
    return codes, scale


def reference_linear_k(x: torch.Tensor, weight: KQuantWeight, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """What ``genfn.kernels.linear(x, weight)`` computes for a ``KQuantWeight``, in ``dtype``."""
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"x has {x.shape[-1]} features; the weight expects {weight.in_features}")
    codes, scale = quantize_activations_k(x, BLOCK_INPUTS[weight.format])
    values = (codes.to(dtype) * scale.to(dtype).unsqueeze(-1)).reshape(x.shape)
    return torch.nn.functional.linear(values, weight.dequantize().to(dtype)).to(x.dtype)
