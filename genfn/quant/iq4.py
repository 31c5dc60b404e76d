"""GGUF's IQ4_NL and IQ4_XS blocks: their values, bit for bit, and a round-to-nearest quantizer.

Both formats store 4-bit indices into one fixed non-linear table of 16 int8 values (llama.cpp's
``kvalues_iq4nl``, ``KVALUES``), denser near zero, where most weights are:

    iq4_nl   18 bytes per 32 inputs: d (float16), 16 bytes of indices (byte j: input j in the low
             nibble, input j + 16 in the high one);             w = d * KVALUES[u]
    iq4_xs  136 bytes per 256 inputs: d (float16), scales_h (uint16, the high 2 bits of sub-block
             i's scale at bits 2i), scales_l (4 bytes, the low 4 bits of sub-block i's scale at bits
             4i), 128 bytes of indices, 16 per sub-block of 32 as in iq4_nl;
                                                                 w = d * (ls_i - 32) * KVALUES[u]

llama.cpp writes IQ4_XS where a row is a multiple of 256 and IQ4_NL where it is not (576-wide
models). Both are held by ``genfn.quant.KQuantWeight`` (formats ``"iq4_nl"``, ``"iq4_xs"``) and run
by the K-quant library's kernels (``genfn/kernels/iq4_linear.cpp``).

``dequantize_iq4`` computes the ``gguf`` package's float32 operations in its order (bit for bit
``gguf.quants.dequantize``); ``quantize_iq4`` is plain round-to-nearest (not llama.cpp's search for
the best scales), for tests and benchmark models: valid blocks, the same bytes per weight.
"""

from __future__ import annotations

import torch

__all__ = ["KVALUES", "IQ4_BLOCK_BYTES", "IQ4_BLOCK_INPUTS", "dequantize_iq4", "quantize_iq4"]

KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
IQ4_BLOCK_BYTES = {"iq4_nl": 18, "iq4_xs": 136}
IQ4_BLOCK_INPUTS = {"iq4_nl": 32, "iq4_xs": 256}
_SUB = 32  # inputs per sub-block (iq4_xs) and per block (iq4_nl)


def _table(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(KVALUES, dtype=torch.float32, device=device)


def _indices(qs: torch.Tensor) -> torch.Tensor:
    """``[n, groups, 16]`` index bytes -> ``[n, groups, 32]`` indices (low nibbles first)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).long()


def dequantize_iq4(data: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 values of IQ4_NL / IQ4_XS bytes (``[..., blocks * block_bytes]`` -> ``[..., inputs]``)."""
    size = IQ4_BLOCK_BYTES[fmt]
    lead = data.shape[:-1]
    blocks = data.reshape(-1, size)
    n = blocks.shape[0]
    d = blocks[:, :2].contiguous().view(torch.float16).to(torch.float32)  # [n, 1]
    if fmt == "iq4_nl":
        values = _table(data.device)[_indices(blocks[:, 2:].reshape(n, 1, 16))].reshape(n, _SUB)
        return (d * values).reshape(*lead, -1)
    high = blocks[:, 2:4].contiguous().view(torch.int16).to(torch.int32)  # [n, 1]; bits 0-15 as stored
    low = blocks[:, 4:8].contiguous().view(torch.int32)
    shifts = torch.arange(8, dtype=torch.int32, device=data.device)
    scales = ((low >> (4 * shifts)) & 0x0F) | (((high >> (2 * shifts)) & 0x03) << 4)  # [n, 8] in 0..63
    dl = (d * (scales - 32).to(torch.float32)).unsqueeze(-1)  # [n, 8, 1]
    values = _table(data.device)[_indices(blocks[:, 8:].reshape(n, 8, 16))]
    return (dl * values).reshape(*lead, -1)


def _nearest(ratio: torch.Tensor) -> torch.Tensor:
    """Index of the table value nearest to each of ``ratio`` (values in units of the scale)."""
    table = _table()
    return torch.bucketize(ratio, (table[1:] + table[:-1]) / 2).to(torch.uint8)


def _pack(u: torch.Tensor) -> torch.Tensor:
    """``[n, groups, 32]`` indices -> ``[n, groups * 16]`` bytes (input j low nibble, j + 16 high)."""
    return (u[..., :16] | (u[..., 16:] << 4)).reshape(u.shape[0], -1)


def _f16_bytes(d: torch.Tensor) -> torch.Tensor:
    return d.reshape(-1, 1).view(torch.uint8).reshape(-1, 2)


def quantize_iq4(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round-to-nearest IQ4_NL / IQ4_XS bytes ``[N, row bytes]`` of a float ``[N, K]`` matrix: per
    block of 32 the value of largest magnitude maps onto the table's -127, every value to the
    nearest table entry (iq4_xs: the 32-input scales rounded to 6 bits of a float16 ``d``)."""
    rows = weight.shape[0]
    w = weight.detach().to(torch.float32).reshape(-1, _SUB)
    index = w.abs().argmax(-1, keepdim=True)
    scale = torch.gather(w, -1, index).squeeze(-1) / KVALUES[0]  # [blocks of 32], either sign
    if fmt == "iq4_nl":
        d = scale.to(torch.float16)
        unit = d.to(torch.float32)[:, None]
        u = _nearest(torch.where(unit != 0, w / unit, torch.zeros_like(w))).reshape(-1, 1, _SUB)
        return torch.cat([_f16_bytes(d), _pack(u)], dim=1).reshape(rows, -1).contiguous()
    scale = scale.reshape(-1, 8)
    n = scale.shape[0]
    largest = torch.gather(scale, -1, scale.abs().argmax(-1, keepdim=True))
    d = (-largest / 32).to(torch.float16)  # the largest scale is -32 units: ls - 32 in [-32, 31]
    df = d.to(torch.float32)
    ls = torch.where(df != 0, torch.round(scale / df), torch.zeros_like(scale)).clamp(-32, 31)
    unit = (df * ls).unsqueeze(-1)
    groups = w.reshape(n, 8, _SUB)
    u = _nearest(torch.where(unit != 0, groups / unit, torch.zeros_like(groups)))
    code = (ls + 32).to(torch.int32)  # 0..63
    shifts = torch.arange(8, dtype=torch.int32)
    code = code.to(torch.int64)
    # Disjoint bits, so the sums are ORs; their little-endian bytes are the fields.
    low = ((code & 0x0F) << (4 * shifts)).sum(-1).reshape(n, 1).view(torch.uint8)[:, :4]
    high = (((code >> 4) & 0x03) << (2 * shifts)).sum(-1).reshape(n, 1).view(torch.uint8)[:, :2]
    parts = [_f16_bytes(d), high, low, _pack(u)]
    return torch.cat(parts, dim=1).reshape(rows, -1).contiguous()
