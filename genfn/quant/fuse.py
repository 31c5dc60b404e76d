"""``cat_rows``: the row-concatenation of the parts a layer fuses (q/k/v, gate/up), whatever form
each part comes in: float tensors, ``RowBlocks``, ``QuantizedWeight`` tiles, K-quant blocks.

Parts a loader wrote back to back in one allocation (``genfn.models.loaders.gguf_blocks`` does
for a GGUF file's blocks) are joined as a view; others are copied once. No code or scale is ever
recomputed: tiles and K-quant blocks in different formats stay a ``RowStack`` of runs, each in its
own format (the native stack runs them part by part), rather than being dequantized or widened to
be fused; ``RowBlocks``, which no native stack runs, are widened into the narrowest format that
holds them all value for value where there is one (``genfn.quant.blocks.widen``: Q5_0 beside Q8_0
as Q8_0, the products unchanged).
"""

from __future__ import annotations

import torch

from genfn.quant.blocks import RowBlocks, common_format, dequantize, widen
from genfn.quant.kquants import KQuantWeight, cat_k
from genfn.quant.stack import RowStack
from genfn.quant.views import joined_rows
from genfn.quant.weight import QuantizedWeight, cat_tiles

__all__ = ["cat_rows"]


def cat_rows(parts: list) -> "RowBlocks | QuantizedWeight | KQuantWeight | RowStack | torch.Tensor":
    """Row-concatenation of float tensors, of ``RowBlocks`` of one format (blocks untouched), or of
    tiles / K-quant blocks (runs of one format and width joined, a mix kept as a ``RowStack``).

    ``RowBlocks`` of formats that widen into one (``common_format``) are fused in it. Float mixed
    with ``RowBlocks`` (or ``RowBlocks`` of two formats that do not) are dequantized to float32
    first: exact, and the only way left to fuse them into one matrix.
    """
    if len(parts) == 1:
        return parts[0].contiguous() if isinstance(parts[0], torch.Tensor) else parts[0]
    if any(isinstance(p, (KQuantWeight, QuantizedWeight)) for p in parts):
        return _stack_runs(parts)
    if all(isinstance(p, torch.Tensor) for p in parts):
        view = joined_rows(parts)
        return torch.cat(parts, dim=0).contiguous() if view is None else view
    formats = {p.format if isinstance(p, RowBlocks) else None for p in parts}
    groups = {p.group_size for p in parts if isinstance(p, RowBlocks)}
    common = _common(formats)
    if common is not None and len(groups) == 1:
        parts = [widen(p, common) for p in parts]
    else:
        return torch.cat([dequantize(p) if isinstance(p, RowBlocks) else p.float() for p in parts], 0).contiguous()
    mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
    return RowBlocks(parts[0].format, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), mins)


def _common(formats: set) -> str | None:
    """The one format of a set of parts' formats, or the one they widen into; None where neither."""
    return next(iter(formats)) if len(formats) == 1 else common_format(formats)


def _stack_runs(parts: list):
    """Parts among which some are tiles or K-quant blocks: runs of one type, width and format are
    concatenated; a mix stays a ``RowStack`` of its runs, each kept in its own format (dequantizing
    a K-quant run to fuse it would cost 7x its memory and its native kernel; widening Q5_0 tiles
    beside a Q8_0 part into Q8_0, 1.55x their bytes, which a one-row step reads from memory)."""
    runs: list[list] = []
    for part in parts:
        last = runs[-1][-1] if runs else None
        same = (isinstance(part, (KQuantWeight, QuantizedWeight)) and type(part) is type(last)
                and part.format == last.format and part.in_features == last.in_features)
        if same:
            runs[-1].append(part)
        else:
            runs.append([part])
    merged = [cat_k(run) if isinstance(run[0], KQuantWeight) else cat_tiles(run) if isinstance(run[0], QuantizedWeight)
              else cat_rows(run) for run in runs]
    return merged[0] if len(merged) == 1 else RowStack(tuple(merged))
