"""``joined_rows``: one tensor over parts that already lie back to back in memory.

The GGUF loader writes the parts a layer fuses (q/k/v, gate/up) side by side in one allocation
(``genfn.models.loaders.gguf_blocks``), so concatenating them later is a view, not a copy.
"""

from __future__ import annotations

import torch

__all__ = ["joined_rows"]


def joined_rows(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The concatenation of ``tensors`` along dim 0 as a view when each is contiguous, of one dtype
    and trailing shape, and starts in one storage where the one before it ends; else None."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or t.untyped_storage().data_ptr() != storage):
            return None
    for before, after in zip(tensors, tensors[1:]):
        if before.data_ptr() + before.numel() * before.element_size() != after.data_ptr():
            return None
    return first.as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride())
