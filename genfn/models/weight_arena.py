"""A model's weights in one buffer backed by transparent huge pages.

Decoding reads every weight once per token, so a CPU decode step runs at the memory read
bandwidth, and on 4 KiB pages part of that bandwidth goes to page-table walks: a 270 MB stream
misses the TLB some 66,000 times. On 2 MiB pages the same stream read 17 % faster on these
machines (``tensor.sum`` over 212 MB, 25.9 vs 30.3 GB/s), and SmolLM2's decode token took 4-8 %
less time in every weight format (``benchmarks/huge_pages.py``). Linux backs anonymous memory with
huge pages only where a program asks (``transparent_hugepage`` set to ``madvise``, the common
default), and only over 2 MiB-aligned ranges, which separate allocations of a few MB rarely span.

``place_in_arena(params)`` copies every dense CPU tensor of a params pytree into one fresh
anonymous mapping, asks for huge pages over it before the first write (``madvise(MADV_HUGEPAGE)``)
and returns the same pytree over tensors placed in it, each with its own storage (inputs that share
a storage are aliases to torch.compile, which its higher-order ops such as ``while_loop`` refuse).
The mapping is its own, not the allocator's: a large ``torch.empty`` may be served from heap memory
already written (after a compile, say), which huge pages no longer back. Identical leaves (tied embeddings) stay one tensor; dtypes, shapes and
strides are kept. Where the kernel never gives huge pages, on other systems, or with
``GENFN_HUGE_PAGES=0`` in the environment, the params come back unchanged.
"""

from __future__ import annotations

import mmap
import os
import sys

import optree
import torch

from genfn.state.base import NAMESPACE

__all__ = ["place_in_arena", "huge_pages_available", "huge_page_bytes"]

HUGE_PAGE = 2 << 20
# Each tensor starts on a cache line, where the kernels' vector loads want it.
_ALIGN = 64
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


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


def place_in_arena(params):
    """``params`` with its CPU tensors moved into one huge-page-backed buffer (see module doc)."""
    if not huge_pages_available():
        return params
    leaves, treedef = optree.tree_flatten(params, none_is_leaf=True, namespace=NAMESPACE)
    unique: dict = {}
    for leaf in leaves:
        if _movable(leaf):
            unique.setdefault(_view_key(leaf), leaf)
    if not unique:
        return params
    offsets, total = {}, 0
    for key, leaf in unique.items():
        offsets[key] = total
        total += -(-_span_elements(leaf) * leaf.element_size() // _ALIGN) * _ALIGN
    mapping = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:  # before the copies fault the pages in
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # refused (an old kernel, a sandbox): ordinary pages, slower, never wrong
        pass
    head = -torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE  # from a 2 MiB boundary
    placed = {}
    for key, leaf in unique.items():
        # Each tensor keeps the mapping alive.
        flat = torch.frombuffer(mapping, dtype=leaf.dtype, count=_span_elements(leaf), offset=head + offsets[key])
        view = flat.as_strided(leaf.shape, leaf.stride())
        view.copy_(leaf)
        placed[key] = view
    out = [placed[_view_key(leaf)] if _movable(leaf) else leaf for leaf in leaves]
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
