"""A GGUF file's quantized matrices, from the file mapping to where the decode steps read them,
each byte written once at most: ``place_blocks``.

Each Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 matrix is written into the kernel's tiles (``QuantizedWeight``) in
memory from ``arena.empty`` (``genfn.models.weight_arena.WeightArena``: huge pages, the weights' final
place), by the native kernels in one pass (``gguf_tiles.cpp``), else by numpy.
A Q4_K/Q5_K/Q6_K/IQ4 matrix (``KQuantWeight``) is the file's own blocks. One that every decode step
reads whole (a layer's, the LM head, a tied embedding: ``_streamed``) goes into the arena where it
has huge pages, a layer's Q4_K repacked 8 rows to a group on the way: on 4 KiB pages of the file
mapping the products read 11 % slower (1B Q4_K_M on a Xeon: 31.3-32.1 against 35.6-36.6 tok/s,
load 0.6 against 1.7 s; ``docs/guides/k-quants-and-scale.md``, *K-quants on huge pages*). Without
huge pages (``GENFN_HUGE_PAGES=0``, or none to ask for), and for an embedding that is only looked
up, a matrix whose rows keep the file's order, a fused run's parts back to back in the file, is
used where it lies in the mapping, not copied at all (no fresh memory: on the shared VMs genfn is
measured on, the first write to 0.63 GB of fresh memory took 5-7 s and a second write 0.1-0.2 s);
else (llama's permuted Q/K) its rows are copied into the arena. The parts a layer fuses (q/k/v, gate/up) are back to back in one
allocation, so the family's ``cat_rows`` joins them as a view. Llama's Q/K row permutation is
undone on the way (a row gather of one matrix). Once a matrix is copied, its pages of the file
mapping are let go (``GGUFFile.release``), so at no time does the process hold the file twice:
the peak is the arena plus one matrix, where building row-major blocks, fusing them, tiling them
and copying them into the arena used to hold four copies of the model (4.3x the file for a 1B
Q4_0 file).

``place_dequantized`` is the float load's counterpart (``genfn.load()`` without ``quantize``): each
Q8_0/Q4_0/Q4_1 matrix dequantized by the native kernels (``gguf_dequantize_rows``), and each
F32/F16/BF16 matrix copied, straight into its rows of the arena, a fused layer's parts back to
back, bit for bit the gguf package's numpy values. A float matrix the load keeps as stored (a BF16
file loaded as bfloat16, an F32 one as float32), in the file's rows, is used where it lies in the
mapping as the K-quants are without huge pages (``_streamed``: with them, the matrices a decode
step reads whole are copied into the arena, 1B BF16 13.5-13.9 -> 15.8 tok/s): only llama's
permuted q/k and converted matrices are copied otherwise. That numpy path, then the fusing and the arena placement, wrote the model's floats three
times into fresh memory, and fresh memory is what a load pays for most on these VMs.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType

from genfn import kernels
from genfn.kernels import kquant
from genfn.quant.blocks import GGUF_FORMATS, gguf_block_fields
from genfn.quant.kquants import FORMAT_ID, GGUF_K_FORMATS, INTERLEAVED_OF, KQuantWeight
from genfn.quant.weight import KERNEL_KIND, TILE, QuantizedWeight

from . import gguf_gpt_oss

__all__ = ["place_blocks", "place_dequantized", "FUSED_PARTS", "mapped", "native_tiles_available"]

# The GGUF parts each family concatenates into one matrix, in its order.
FUSED_PARTS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))
_GROUP_OF = {part: group for group in FUSED_PARTS for part in group}
_LAYER_WEIGHT = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


def _kept_type(gguf, name: str) -> str | None:
    """The ggml type name of a matrix whose blocks are kept (2-D, a format genfn's kernels run), else None."""
    info = gguf.tensors[name]
    type_name = GGMLQuantizationType(info.ggml_type).name
    kept = type_name in GGUF_FORMATS or type_name in GGUF_K_FORMATS
    return type_name if kept and len(info.shape) == 2 else None


def _group(gguf, name: str, kept=_kept_type) -> list[str]:
    """``name`` and the matrices it is fused with that ``kept`` takes, in the fusing order."""
    m = _LAYER_WEIGHT.match(name)
    if m is None or m.group(2) not in _GROUP_OF:
        return [name]
    names = [f"blk.{m.group(1)}.{part}.weight" for part in _GROUP_OF[m.group(2)]]
    return [n for n in names if n in gguf.tensors and kept(gguf, n) is not None]


def _runs(gguf, names: list[str]) -> list[list[str]]:
    """``names`` split where the type or width changes, or where a tiled part ends inside a tile.
    Parts of two tile formats stay two runs (a Q4_K_M file of a 576-wide model has Q5_0 q/k beside a
    Q8_0 v: fused, a ``RowStack`` of the two, which the native stack runs part by part) rather than
    one run widened into the wider format (``genfn.quant.blocks.widen``): the same products, but
    1.55x the bytes of q/k, and at that size a step reads its weights from memory."""
    runs: list[list[str]] = []
    for name in names:
        if runs:
            last = runs[-1][-1]
            same = (_kept_type(gguf, name) == _kept_type(gguf, last)
                    and gguf.tensors[name].shape[1] == gguf.tensors[last].shape[1]
                    and (_kept_type(gguf, last) in GGUF_K_FORMATS or gguf.tensors[last].shape[0] % TILE == 0))
            if same:
                runs[-1].append(name)
                continue
        runs.append([name])
    return runs


def place_blocks(gguf, row_order: Callable[[str], np.ndarray | None], arena) -> dict[str, QuantizedWeight | KQuantWeight]:
    """GGUF tensor name -> its weight, for every kept matrix of ``gguf`` (see the module docstring);
    ``row_order(name)``: the rows to take, in order (Q/K unpermuted), or None for the file's."""
    placed: dict[str, QuantizedWeight | KQuantWeight] = {}
    for name in gguf.tensors:
        if name in placed or _kept_type(gguf, name) is None:
            continue
        for run in _runs(gguf, _group(gguf, name)):
            placed.update(_write_run(gguf, run, row_order, arena))
    return placed


# Float matrices a float load copies from the mapping into the arena, converted to the load's dtype
# in the copy: the gguf package reads BF16 through numpy float32, which wrote a 1B BF16 file's
# values twice more and held 4.2x the file at the load's peak.
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _dequantized_type(gguf, name: str) -> str | None:
    """The ggml type name of a 2-D matrix a float load writes straight into the arena (Q8_0/Q4_0/Q4_1,
    which the native kernels dequantize, or F32/F16/BF16, copied), else None."""
    info = gguf.tensors[name]
    type_name = GGMLQuantizationType(info.ggml_type).name
    placed = type_name in GGUF_FORMATS or type_name in _FLOAT_TYPES
    return type_name if placed and len(info.shape) == 2 else None


def place_dequantized(gguf, row_order: Callable[[str], np.ndarray | None], arena,
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """GGUF tensor name -> its ``dtype`` values in ``arena``, for every F32/F16/BF16 matrix of ``gguf``
    and, with the native kernels (``gguf_tiles.cpp``), every Q8_0/Q4_0/Q4_1 one (see the module
    docstring), rows in ``row_order``; {} with ``GENFN_NATIVE_TILES=0`` or for GPT-OSS (whose loader
    rearranges its matrices after reading them)."""
    if not _native_tiles_allowed() or gguf.metadata["general.architecture"] == gguf_gpt_oss.ARCH:
        return {}
    # The float matrices need no native kernel (placed even where none is built).
    dequantizes = native_tiles_available()

    def placed_type(gguf, name: str) -> str | None:
        type_name = _dequantized_type(gguf, name)
        return type_name if dequantizes or type_name in _FLOAT_TYPES else None

    placed: dict[str, torch.Tensor] = {}
    for name in gguf.tensors:
        if name in placed or placed_type(gguf, name) is None:
            continue
        group = _group(gguf, name, placed_type)
        cols = {gguf.tensors[n].shape[1] for n in group}
        for run in [group] if len(cols) == 1 else [[n] for n in group]:
            placed.update(_dequantize_run(gguf, run, row_order, arena, dtype))
    return placed


def _dequantize_run(gguf, run: list[str], row_order, arena, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    rows = [gguf.tensors[name].shape[0] for name in run]
    orders = [row_order(name) for name in run]
    if all(_FLOAT_TYPES.get(_dequantized_type(gguf, name)) == dtype for name in run):
        in_file = _run_in_file(gguf, run, orders, arena)
        if in_file is not None:  # kept as stored: used where it lies in the mapping (module docstring)
            return dict(zip(run, arena.hold(mapped(in_file).view(dtype)).split(rows)))
    whole = arena.empty((sum(rows), gguf.tensors[run[0]].shape[1]), dtype)
    out: dict[str, torch.Tensor] = {}
    start = 0
    for name, n, order in zip(run, rows, orders):
        part = whole[start:start + n]
        rows_taken = None if order is None else torch.from_numpy(order).long()
        type_name = _dequantized_type(gguf, name)
        if type_name in _FLOAT_TYPES:
            # A float's conversion to dtype rounds it once, as the numpy path's float32 then .to(dtype).
            stored = mapped(gguf.raw(name)).view(_FLOAT_TYPES[type_name])
            part.copy_(stored if rows_taken is None else stored.index_select(0, rows_taken))
        else:
            # Another dtype goes through float32 values, as the numpy path's ``.to(dtype)`` does.
            values = part if dtype == torch.float32 else torch.empty(part.shape, dtype=torch.float32)
            torch.ops.genfn_kernels.gguf_dequantize_rows(mapped(gguf.raw(name)), rows_taken,
                                                          KERNEL_KIND[GGUF_FORMATS[type_name]], values)
            if values is not part:
                part.copy_(values)
        out[name] = part
        gguf.release(name)
        start += n
    return out


def _run_in_file(gguf, run: list[str], orders: list[np.ndarray | None], arena) -> np.ndarray | None:
    """The run's bytes as one view of the file mapping, to be used where they lie: where every part
    keeps the file's row order (``orders`` all None), the parts lie back to back in the file, and the
    run is not one that is streamed on the arena's huge pages (``_streamed``); else None."""
    if arena.enabled and _streamed(gguf, run):
        return None
    return gguf.raw_run(run) if all(order is None for order in orders) else None


def _write_run(gguf, run: list[str], row_order, arena) -> dict[str, QuantizedWeight | KQuantWeight]:
    type_name = _kept_type(gguf, run[0])
    cols = gguf.tensors[run[0]].shape[1]
    rows = [gguf.tensors[name].shape[0] for name in run]
    out: dict[str, QuantizedWeight | KQuantWeight] = {}
    if _interleaved(gguf, run, type_name, rows):
        return _write_r8_run(gguf, run, row_order, arena, rows, cols, INTERLEAVED_OF[GGUF_K_FORMATS[type_name]])
    if type_name in GGUF_K_FORMATS:  # rows as stored, one after another
        orders = [row_order(name) for name in run]
        in_file = _run_in_file(gguf, run, orders, arena)
        if in_file is not None:  # the file's own bytes, used where they lie (module docstring)
            data = arena.hold(mapped(in_file))
        else:
            data = arena.empty((sum(rows), gguf.raw(run[0]).shape[1]), torch.uint8)
        start = 0
        for name, n, order in zip(run, rows, orders):
            if in_file is None:  # copied into the arena, its rows in the family's order
                dst = data.numpy()[start:start + n]
                if order is None:
                    np.copyto(dst, gguf.raw(name))
                else:
                    np.take(gguf.raw(name), order, axis=0, out=dst, mode="clip")  # "clip": no buffered copy of out
                gguf.release(name)
            out[name] = KQuantWeight(data[start:start + n], GGUF_K_FORMATS[type_name], n, cols)
            start += n
        return out
    whole = QuantizedWeight.zeros(GGUF_FORMATS[type_name], sum(rows), cols, arena.empty)
    tile = 0
    for name, n in zip(run, rows):
        tiles = slice(tile, tile + -(-n // TILE))
        part = QuantizedWeight(whole.codes[tiles], whole.scales[tiles], None if whole.mins is None else whole.mins[tiles],
                               whole.format, n, cols)
        _fill_tiles(part, gguf.raw(name), type_name, row_order(name))
        out[name] = part
        gguf.release(name)
        tile = tiles.stop
    return out


def _interleaved(gguf, run: list[str], type_name: str, rows: list[int]) -> bool:
    """Whether a run is Q4_K, Q5_K, Q6_K or IQ4_XS matrices that every decode step reads whole (a
    layer's, the LM head, a tied embedding: ``_streamed``), which the native kernels read interleaved
    8 rows to a group (``q4_k_r8``, ``q5_k_r8``, ``q6_k_r8``, ``iq4_xs_r8``; Q6_K and IQ4_XS only where
    their group kernels run, on AVX-512 VNNI: elsewhere they would run a row at a time through the
    stored rows' kernel). A tied embedding's lookup puts a token's group of rows back
    (``genfn.kernels.embedding``); an embedding beside its own head keeps the file's rows.
    ``GENFN_Q4K_R8=0`` in the environment keeps every matrix as stored."""
    fmt = GGUF_K_FORMATS.get(type_name)
    return (fmt in INTERLEAVED_OF and _streamed(gguf, run)
            and all(n % 8 == 0 for n in rows) and os.environ.get("GENFN_Q4K_R8", "1") != "0"
            and kquant.group_kernel_runs(INTERLEAVED_OF[fmt]))


def _streamed(gguf, run: list[str]) -> bool:
    """Whether every decode step reads the run's matrices whole: a layer's, the LM head's, or the
    embedding where the file has no head (tied: the embedding is the head), not an embedding that a
    lookup reads one row of per token."""
    return all(_LAYER_WEIGHT.match(name) or name == "output.weight"
               or (name == "token_embd.weight" and "output.weight" not in gguf.tensors) for name in run)


def _write_r8_run(gguf, run, row_order, arena, rows, cols, fmt: str) -> dict[str, KQuantWeight]:
    """A run of Q4_K, Q5_K, Q6_K or IQ4_XS matrices repacked (as ``fmt``) from the file mapping into the arena (huge
    pages where it has them; else ordinary pages, ``arena.empty`` either way), each matrix's mapping
    let go once written, so the peak holds one matrix twice at most."""
    data = arena.empty((sum(rows), gguf.raw(run[0]).shape[1]), torch.uint8)
    out: dict[str, KQuantWeight] = {}
    start = 0
    for name, n in zip(run, rows):
        order = row_order(name)
        torch.ops.genfn_kquant.kquant_repack_r8(mapped(gguf.raw(name)), None if order is None else
                                                torch.from_numpy(order).long(), data[start:start + n], FORMAT_ID[fmt])
        gguf.release(name)
        out[name] = KQuantWeight(data[start:start + n], fmt, n, cols)
        start += n
    return out


def _fill_tiles(weight: QuantizedWeight, raw: np.ndarray, type_name: str, order: np.ndarray | None) -> None:
    """Write a matrix's blocks ``raw`` (its rows ``order``, or all in the file's order) into
    ``weight``'s tiles: in one pass by the native kernels (``gguf_tiles.cpp``),
    else in numpy (``QuantizedWeight.fill_from_blocks``), bit for bit the same."""
    if native_tiles_available():
        rows = None if order is None else torch.from_numpy(order).long()
        torch.ops.genfn_kernels.gguf_blocks_to_tiles(mapped(raw), rows, weight.codes, weight.scales, weight.mins,
                                                     weight.kind, weight.out_features)
        return
    fields = gguf_block_fields(raw, type_name, weight.shape)
    weight.fill_from_blocks(fields if order is None else fields[order])


def native_tiles_available() -> bool:
    """Whether the native kernels (built now if need be) write tiles; ``GENFN_NATIVE_TILES=0``
    in the environment keeps numpy's path (benchmarks/load_memory.py's A/B)."""
    return _native_tiles_allowed() and kernels.portable_ops_available()


def _native_tiles_allowed() -> bool:
    return os.environ.get("GENFN_NATIVE_TILES", "1") != "0"


def mapped(raw: np.ndarray) -> torch.Tensor:
    """A tensor over the file mapping's own bytes (no copy). The mapping is read-only, which torch
    cannot mark: nothing in genfn writes a weight in place."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(raw)
