"""``QuantizedWeight``: a block-quantized linear weight as a pytree, in the kernel's tile layout.

Codes, scales and minimums are tensor leaves; the format and the matrix shape are static, so a
compiled step keys on them and closes over the tensors like any other weight.

Layout ("tiles16"): output rows are grouped in tiles of 16 and, inside a tile, stored block by
block (32 inputs), with the 16 rows of a block interleaved four code bytes at a time:

    codes  uint8   [tiles, K // 32, chunks * 64]   chunk c = bytes 4c..4c+3 of each of the 16 rows
    scales float16 [tiles, K // 32, 16]
    mins   float16 [tiles, K // 32, 16]            q4_1 / q5_1 / int4 only

One AVX-512 register then holds one chunk of 16 rows, and ``vpdpbusd`` against four activation
bytes broadcast to every lane leaves each row's partial dot product in its own lane: no
horizontal sums, and one float16 -> float32 conversion turns 16 scales into the lanes' factors.
4-bit blocks keep GGUF's nibble order (byte j: input j low, input j + 16 high), so a chunk's low
nibbles meet inputs 4c..4c+3 and its high nibbles 16+4c..16+4c+3. 5-bit blocks (q5_0, q5_1) are
one chunk of the rows' fifth-bit words and then those 4 nibble chunks: GGUF's record after its
scales, word for word (``genfn/kernels/tile_kinds.h`` reads them). 8-bit codes are stored offset
by 128 (``vpdpbusd`` multiplies unsigned by signed bytes); the kernel subtracts 128 times the
activation block's sum, which it has anyway. Every code and scale is the source's, moved, not
recomputed.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from genfn.quant.blocks import (BLOCK, EIGHT_BIT, GGUF_TYPE_OF_FORMAT, WITH_MINIMUM, RowBlocks, _per_block, code_bytes,
                                dequantize)
from genfn.quant.views import joined_rows
from genfn.state.base import pytree_dataclass, static_field

__all__ = ["QuantizedWeight", "TILE", "KERNEL_KIND", "cat_tiles"]

TILE = 16
# The kernel's dot products (genfn/kernels/tile_kinds.h): 4-bit with a fixed offset of 8, 4-bit with
# a minimum, 8-bit, 5-bit with an offset of 16, 5-bit with a minimum.
KERNEL_KIND = {"q4_0": 0, "q4_1": 1, "int4": 1, "q8_0": 2, "int8": 2, "q5_0": 3, "q5_1": 4}
# What each format becomes once its scales are spread per block of 32 (the tile layout's unit).
_PER_BLOCK_FORMAT = {"q4_0": "q4_0", "q4_1": "q4_1", "int4": "q4_1", "q8_0": "q8_0", "int8": "q8_0", "q5_0": "q5_0",
                     "q5_1": "q5_1"}


@pytree_dataclass
class QuantizedWeight:
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    format: str = static_field()
    out_features: int = static_field()
    in_features: int = static_field()
    layout: str = static_field(default="tiles16")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def kind(self) -> int:
        return KERNEL_KIND[self.format]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        parts = [self.codes, self.scales] + ([] if self.mins is None else [self.mins])
        return sum(p.numel() * p.element_size() for p in parts)

    @classmethod
    def from_rows(cls, rows: RowBlocks) -> "QuantizedWeight":
        n, k = rows.shape
        blocks = k // BLOCK
        tiles = -(-n // TILE)
        pad = tiles * TILE - n
        codes = rows.codes
        if rows.format in EIGHT_BIT:
            codes = codes ^ 0x80  # signed q -> unsigned q + 128
        chunks = codes.shape[-1] // 4

        def tiled(t: torch.Tensor, tail: tuple[int, ...], order: tuple[int, ...]) -> torch.Tensor:
            if pad:
                t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
            return t.reshape(tiles, TILE, blocks, *tail).permute(*order).contiguous()

        # A chunk's four code bytes move together: permute them as one int32.
        words = codes.contiguous().view(torch.int32)  # [N, blocks, chunks]
        tiled_codes = tiled(words, (chunks,), (0, 2, 3, 1)).view(torch.uint8).reshape(tiles, blocks, chunks * 64)
        scales = tiled(_per_block(rows.scales, rows.shape), (), (0, 2, 1))
        mins = None if rows.mins is None else tiled(_per_block(rows.mins, rows.shape), (), (0, 2, 1))
        return cls(tiled_codes, scales, mins, rows.format, n, k)

    @classmethod
    def zeros(cls, fmt: str, out_features: int, in_features: int, empty=None) -> "QuantizedWeight":
        """An all-zero weight of this shape in the tile layout, its tensors from ``empty(shape,
        dtype)`` (which must give zero-filled memory; default ``torch.zeros``), to be filled by
        ``fill_from_blocks``; ``fmt`` one of the GGUF formats (scales per block of 32)."""
        if fmt not in GGUF_TYPE_OF_FORMAT:
            raise ValueError(f"fmt must be one of {', '.join(GGUF_TYPE_OF_FORMAT)}; got {fmt!r}")
        empty = empty or (lambda shape, dtype: torch.zeros(shape, dtype=dtype))
        tiles, blocks = -(-out_features // TILE), in_features // BLOCK
        codes = empty((tiles, blocks, code_bytes(fmt) * TILE), torch.uint8)
        mins = empty((tiles, blocks, TILE), torch.float16) if fmt in WITH_MINIMUM else None
        return cls(codes, empty((tiles, blocks, TILE), torch.float16), mins, fmt, out_features, in_features)

    def fill_from_blocks(self, fields: np.ndarray) -> None:
        """Write a GGUF matrix's blocks (``genfn.quant.blocks.gguf_block_fields``, ``[out_features,
        K // 32]``, rows in this weight's order) into these tiles: what ``from_rows`` computes, a
        slab of rows at a time (each field copied out of the records, then gathered into the tile
        order), without a row-major copy of the whole matrix. Padding rows are left as they are (zero)."""
        if fields.shape != (self.out_features, self.in_features // BLOCK):
            raise ValueError(f"fields must be [{self.out_features}, {self.in_features // BLOCK}] blocks; "
                             f"got {list(fields.shape)}")
        tiles = self.codes.shape[0]
        targets = [("words", self.codes.numpy().view(np.uint32)), ("d", self.scales.numpy())]
        if self.mins is not None:
            targets.append(("m", self.mins.numpy()))
        for start in range(0, self.out_features, _SLAB_ROWS):
            slab, first = fields[start:start + _SLAB_ROWS], start // TILE
            for name, dst in targets:
                src = np.ascontiguousarray(slab[name])
                if name == "words" and self.format in EIGHT_BIT:
                    np.bitwise_xor(src, np.uint32(0x80808080), out=src)  # stored offset by 128 (module docstring)
                _interleave(src.reshape(src.shape[0], -1), dst.reshape(tiles, -1)[first:first + -(-src.shape[0] // TILE)])

    def to_rows(self) -> RowBlocks:
        """The row-major blocks (scales per block of 32; int8/int4 read as q8_0/q4_1)."""
        tiles, blocks, width = self.codes.shape
        chunks = width // 64
        words = self.codes.view(torch.int32).reshape(tiles, blocks, chunks, TILE).permute(0, 3, 1, 2)
        codes = words.contiguous().view(torch.uint8).reshape(tiles * TILE, blocks, chunks * 4)[: self.out_features]
        if self.format in EIGHT_BIT:
            codes = codes ^ 0x80

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.permute(0, 2, 1).reshape(tiles * TILE, blocks)[: self.out_features].contiguous()

        mins = rows(self.mins) if self.format in WITH_MINIMUM else None
        return RowBlocks(_PER_BLOCK_FORMAT[self.format], codes.contiguous(), rows(self.scales), mins)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[out_features, in_features]``: the values the kernel multiplies by."""
        return dequantize(self.to_rows())

    def lookup(self, index: torch.Tensor) -> torch.Tensor:
        """float32 ``[*index.shape, in_features]``: rows ``index`` of ``dequantize()``, reading only
        the tiles that hold them (an embedding lookup in a quantized table: a tied LM head's own
        blocks serve as the embedding, so no float copy of the table is kept)."""
        flat = index.reshape(-1)
        tile, row = flat // TILE, flat % TILE
        tiles, blocks, width = self.codes.shape
        chunks = width // 64
        # A block's chunk c holds 4 code bytes of each of the tile's 16 rows, row after row.
        codes = self.codes.index_select(0, tile).reshape(-1, blocks, chunks, TILE, 4)
        pick = row.view(-1, 1, 1, 1, 1).expand(-1, blocks, chunks, 1, 4)
        codes = codes.gather(3, pick).reshape(-1, blocks, chunks * 4)
        if self.format in EIGHT_BIT:
            codes = codes ^ 0x80

        def per_row(t: torch.Tensor) -> torch.Tensor:  # [tiles, blocks, 16] -> [n, blocks]
            return t.index_select(0, tile).gather(2, row.view(-1, 1, 1).expand(-1, blocks, 1)).squeeze(2)

        mins = per_row(self.mins) if self.format in WITH_MINIMUM else None
        rows = RowBlocks(_PER_BLOCK_FORMAT[self.format], codes, per_row(self.scales), mins)
        return dequantize(rows).reshape(*index.shape, self.in_features)

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.format}, {self.out_features}x{self.in_features}, {self.layout})"


# Rows of a matrix moved into tiles per step of ``fill_from_blocks`` (a slab's fields stay in cache).
_SLAB_ROWS = 512


@functools.lru_cache(maxsize=64)
def _tile_order(width: int) -> np.ndarray:
    """For a tile's 16 rows of ``width`` items, row-major: the item at each place of the tile
    layout, which interleaves the 16 rows item by item."""
    return np.arange(TILE * width).reshape(TILE, width).T.reshape(-1)


def _interleave(src: np.ndarray, dst: np.ndarray) -> None:
    """``src`` ``[rows, width]`` into ``dst`` ``[ceil(rows / 16), width * 16]``, each tile's rows
    interleaved (item ``j`` of row ``i`` of a tile at ``16 * j + i``); a last, partial tile's
    missing rows are left as they are."""
    rows, width = src.shape
    full = rows // TILE
    # mode="clip": indices known in range, and numpy then writes into `out` directly (no buffer).
    np.take(src[:full * TILE].reshape(full, TILE * width), _tile_order(width), axis=1, out=dst[:full], mode="clip")
    if rows % TILE:
        dst[full].reshape(width, TILE)[:, :rows % TILE] = src[full * TILE:].T


def cat_tiles(parts: list) -> QuantizedWeight:
    """Row-concatenation of ``QuantizedWeight``s of one format and width: their tiles joined, as a
    view where the parts lie back to back in one allocation (as the GGUF loader writes a layer's
    q/k/v), else copied; a part that ends inside a tile goes through the row-major blocks."""
    first = parts[0]
    if any(p.format != first.format or p.in_features != first.in_features or p.layout != first.layout for p in parts):
        raise ValueError("cat_tiles needs parts of one format, width and layout")
    rows = sum(p.out_features for p in parts)
    if any(p.out_features % TILE for p in parts[:-1]):
        blocks = [p.to_rows() for p in parts]
        mins = None if blocks[0].mins is None else torch.cat([b.mins for b in blocks])
        fused = RowBlocks(blocks[0].format, torch.cat([b.codes for b in blocks]), torch.cat([b.scales for b in blocks]),
                          mins)
        return QuantizedWeight.from_rows(fused).replace(format=first.format)

    def join(tensors: list[torch.Tensor]) -> torch.Tensor:
        view = joined_rows(tensors)
        return torch.cat(tensors) if view is None else view

    mins = None if first.mins is None else join([p.mins for p in parts])
    return QuantizedWeight(join([p.codes for p in parts]), join([p.scales for p in parts]), mins, first.format, rows,
                           first.in_features, first.layout)
