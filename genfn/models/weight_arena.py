"""A model's weights in one buffer backed by transparent huge pages.

Decoding reads every weight once per token, so a CPU decode step runs at the memory read
bandwidth, and on 4 KiB pages part of that bandwidth goes to page-table walks: a 270 MB stream
misses the TLB some 66,000 times. On 2 MiB pages the same stream read 17 % faster on these
machines (``tensor.sum`` over 212 MB, 25.9 vs 30.3 GB/s), and SmolLM2's decode token took 4-8 %
less time in every weight format (``benchmarks/huge_pages.py``). Linux backs anonymous memory with
huge pages only where a program asks (``transparent_hugepage`` set to ``madvise``, the common
default), and only over 2 MiB-aligned ranges, which separate allocations of a few MB rarely span.

``WeightArena`` hands out zero-filled tensors from fresh anonymous mappings advised for huge
pages before the first write (``madvise(MADV_HUGEPAGE)``), each tensor with its own storage
(inputs that share a storage are aliases to torch.compile, which its higher-order ops such as
``while_loop`` refuse). The mappings are the arena's own, not the allocator's: a large
``torch.empty`` may be served from heap memory already written (after a compile, say), which huge
pages no longer back. The GGUF loader writes a file's blocks straight into an arena
(``genfn.models.loaders.gguf_blocks``); ``place_in_arena(params, arena)`` then copies in what is
not there yet (norms, float weights), and ``place_in_arena(params)`` copies every dense CPU tensor
of a params pytree into one new mapping, side by side. Identical leaves (tied embeddings) stay one
tensor; dtypes, shapes and strides are kept. Where the kernel never gives huge pages, on other
systems, or with ``GENFN_HUGE_PAGES=0`` in the environment, the params come back unchanged (and
``WeightArena.empty`` gives a large tensor a mapping of ordinary pages of its own, zeroed by the
kernel as it is first written, and a small one ``torch.zeros``).
"""

from __future__ import annotations

import math
import mmap
import os
import sys

import optree
import torch

from genfn.state.base import NAMESPACE

__all__ = ["WeightArena", "place_in_arena", "huge_pages_available", "huge_page_bytes", "release_file_pages",
           "whole_pages"]

HUGE_PAGE = 2 << 20
# Each tensor starts on a cache line, where the kernels' vector loads want it.
_ALIGN = 64
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
# Without huge pages, tensors from this size up get a mapping of their own (``_lazily_zeroed``).
_OWN_MAPPING_BYTES = 1 << 20


def huge_pages_available() -> bool:
    """Whether asking for huge pages can help here: Linux with transparent huge pages not
    ``never``, and not switched off by ``GENFN_HUGE_PAGES=0``."""
    if (os.environ.get("GENFN_HUGE_PAGES", "1") == "0" or not sys.platform.startswith("linux")
            or not hasattr(mmap, "MADV_HUGEPAGE")):
        return False
    try:
        with open(_THP_MODE) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _span_elements(t: torch.Tensor) -> int:
    """Elements from a non-empty tensor's first to one past its last (strides are non-negative)."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _movable(leaf) -> bool:
    """A dense CPU tensor with bytes to move (an opaque layout, oneDNN's packed weights or a sparse
    tensor, has none), nothing to differentiate, and non-negative strides."""
    return (isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided and leaf.device.type == "cpu"
            and not leaf.requires_grad and leaf.numel() > 0 and all(s >= 0 for s in leaf.stride()))


def _view_key(t: torch.Tensor):
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


class WeightArena:
    """Bump allocation of zero-filled tensors, each with its own storage, in anonymous mappings
    advised for huge pages: a loader writes a weight's final bytes here once, where the steps will
    read them (``genfn.models.loaders.gguf_blocks``), instead of building it elsewhere and copying.

    The arena grows a mapping of at least ``chunk_bytes`` at a time; the unused end of a mapping is
    address space only (pages are backed when first written). Where huge pages are unavailable
    (``huge_pages_available()``), ``enabled`` is False and ``empty`` hands out ordinary memory.
    """

    def __init__(self, chunk_bytes: int = 256 << 20, *, huge_pages: bool = True):
        """``huge_pages=False``: ordinary memory, and a loader leaves what it can in the file's mapping
        (a source that is read once, as the floats a coded model is encoded from)."""
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive; got {chunk_bytes}")
        self.enabled = huge_pages and huge_pages_available()
        self.chunk_bytes = chunk_bytes
        self._mapping: mmap.mmap | None = None
        self._next = self._end = 0  # offsets into the current mapping
        self._storages: set[int] = set()

    def _grow(self, nbytes: int) -> None:
        size = max(nbytes, self.chunk_bytes)
        mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:  # before the first write faults the pages in
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # refused (an old kernel, a sandbox): ordinary pages, slower, never wrong
            pass
        head = -torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE  # from a 2 MiB boundary
        self._mapping, self._next, self._end = mapping, head, head + size

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled contiguous CPU tensor of ``shape`` and ``dtype`` in the arena."""
        count = _element_count(shape)
        nbytes = -(-max(count, 1) * dtype.itemsize // _ALIGN) * _ALIGN
        if not self.enabled:
            return _lazily_zeroed(shape, dtype, count, nbytes)
        if self._mapping is None or self._next + nbytes > self._end:
            self._grow(nbytes)
        # Each tensor keeps the mapping alive.
        flat = torch.frombuffer(self._mapping, dtype=dtype, count=max(count, 1), offset=self._next)
        self._next += nbytes
        self._storages.add(flat.untyped_storage().data_ptr())
        return flat[:count].view(shape)

    def hold(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, counted as placed though it lies elsewhere (a file mapping's blocks, used
        where they are): ``holds`` it, so ``place_in_arena`` leaves it where it is."""
        self._storages.add(tensor.untyped_storage().data_ptr())
        return tensor

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (or a view of it) was allocated here."""
        return tensor.untyped_storage().data_ptr() in self._storages


def _element_count(shape) -> int:
    return math.prod(int(size) for size in shape)


def _lazily_zeroed(shape, dtype: torch.dtype, count: int, nbytes: int) -> torch.Tensor:
    """A large tensor on its own anonymous mapping of ordinary pages, which the kernel zeroes as they
    are first written: the loader's write is then the only one (``torch.zeros`` writes every byte
    first, and on the VMs genfn is measured on a first write to fresh memory costs 0.6 s/GB on 4 KiB
    pages, ``benchmarks/fresh_memory.py``). Small ones, or without anonymous mappings: ``torch.zeros``."""
    if nbytes < _OWN_MAPPING_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)


def place_in_arena(params, arena: WeightArena | None = None):
    """``params`` with its CPU tensors moved into one huge-page-backed buffer (see module doc), or
    into ``arena``, where the tensors already in it stay as they are."""
    if not huge_pages_available() or (arena is not None and not arena.enabled):
        return params
    leaves, treedef = optree.tree_flatten(params, none_is_leaf=True, namespace=NAMESPACE)
    unique: dict = {}
    for leaf in leaves:
        if _movable(leaf) and (arena is None or not arena.holds(leaf)):
            unique.setdefault(_view_key(leaf), leaf)
    if not unique:
        return params
    spans = {key: _span_elements(leaf) for key, leaf in unique.items()}
    if arena is None:  # one mapping, the tensors side by side
        arena = WeightArena(chunk_bytes=sum(-(-spans[k] * leaf.element_size() // _ALIGN) * _ALIGN
                                            for k, leaf in unique.items()))
    placed = {}
    for key, leaf in unique.items():
        view = arena.empty((spans[key],), leaf.dtype).as_strided(leaf.shape, leaf.stride())
        view.copy_(leaf)
        placed[key] = view
    out = [placed.get(_view_key(leaf), leaf) if _movable(leaf) else leaf for leaf in leaves]
    return optree.tree_unflatten(treedef, out)


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """Bytes of huge pages (``AnonHugePages``) in the mapping that holds ``tensor``'s first byte,
    read from ``/proc/self/smaps``; 0 where that cannot be read."""
    address = tensor.data_ptr()
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                first = line.split(maxsplit=1)[0]
                if "-" in first and not first.endswith(":"):
                    low, high = (int(part, 16) for part in first.split("-"))
                    inside = low <= address < high
                elif inside and first == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return 0


def whole_pages(start: int, stop: int) -> tuple[int, int]:
    """``(first, last)``: the whole pages inside the bytes ``[start, stop)`` (``last <= first`` when
    none). Releasing a page that also holds a neighbour's bytes would drop those too."""
    page = mmap.PAGESIZE
    return -(-start // page) * page, stop // page * page


def release_file_pages(tensor: torch.Tensor) -> bool:
    """Let ``tensor``'s pages leave this process's resident memory where it is a view of a file
    mapped read-only (a GGUF file's floats used where they lie): the page cache keeps them, and a later
    read maps them again, so its values never change. Anonymous or writable memory is left alone
    (dropped, it would read back as zeros). Returns whether pages were released; Linux only."""
    if sys.platform != "linux" or tensor.numel() == 0:
        return False
    start = tensor.data_ptr()
    stop = start + tensor.numel() * tensor.element_size()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                low, high = (int(part, 16) for part in fields[0].split("-"))
                if low <= start and stop <= high:
                    # read-only ("r--s", "r--p"; no "w"), and the sixth field names the file
                    if fields[1][1] != "-" or len(fields) < 6 or not fields[5].strip().startswith("/"):
                        return False
                    break
            else:
                return False
    except (OSError, ValueError):
        return False
    first, last = whole_pages(start, stop)
    if last <= first:
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED) == 0
