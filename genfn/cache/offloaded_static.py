"""The offloaded static cache: static buffers on an offload device, one layer staged ahead.

transformers' ``StaticCache(offloading=True)`` (``cache_implementation="offloaded_static"``). The
``[L, B, Hkv, max_cache_len, D]`` buffers live on ``offload_device`` (pinned CPU memory when the
compute device is an accelerator); the compute device holds two staging buffers ``[2, B, Hkv,
max_cache_len, D]``. Every shape is fixed, and positions are tensors, so the step compiles like the
static cache's:

* ``advance`` (start of a forward) records validity and loads layer 0 into stage 0;
* ``write_layer(i)`` writes the new keys/values into stage ``i % 2`` at ``slots`` (in place),
  copies that stage back to the offloaded layer ``i`` (as transformers' static-layer offload does:
  the slots are a tensor, so the host cannot address the new tokens alone without a sync), issues
  the copy of layer ``i + 1`` into stage ``(i + 1) % 2``, and returns stage ``i % 2``.

Copies go through ``copy_fn`` (see ``genfn.cache.base``). ``reorder`` permutes the offloaded
buffers in place (the staging buffers are reloaded by the next forward).
"""

from __future__ import annotations

import torch

from genfn.cache.base import CopyFn, as_device, as_row_index, default_copy, host_sync, reorder_in_place, row_slots, valid_below
from genfn.cache.offloaded import StagedLayers, _alloc
from genfn.cache.static import check_same_capacity, write_rows
from genfn.state.base import pytree_dataclass

__all__ = ["OffloadedStaticCache", "init_offloaded_static_cache"]


@pytree_dataclass
class OffloadedStaticCache(StagedLayers):
    rows_have_holes = False  # a pointer-move rewind, as the static cache's

    def slots(self, num_new: int) -> torch.Tensor:
        return row_slots(self.length, num_new, self.max_cache_len)

    def advance(self, slots: torch.Tensor, new_valid: torch.Tensor) -> OffloadedStaticCache:
        self.valid.scatter_(1, slots, new_valid.to(torch.bool))
        self.copy_fn(self.stage_keys[0], self.keys[0], kind="load", layer=0)
        self.copy_fn(self.stage_values[0], self.values[0], kind="load", layer=0)
        return self.replace(length=(self.length + slots.shape[1]).clamp(max=self.max_cache_len))

    def rewind(self, lengths: torch.Tensor) -> OffloadedStaticCache:
        """A pointer move, as the static cache's."""
        self.valid.copy_(valid_below(self.valid, lengths))
        return self.replace(length=lengths.to(self.length.dtype))

    def with_rows(self, rows, other) -> OffloadedStaticCache:
        """Rows ``rows`` replaced by ``other``'s (a static or offloaded static cache of the same capacity)."""
        check_same_capacity(self, other)
        if not torch.compiler.is_compiling():
            host_sync(self.compute_device)
        index = as_row_index(rows, self.length.device)
        offload_index = index.to(self.offload_device)
        self.keys.index_copy_(1, offload_index, other.keys.to(self.offload_device, self.keys.dtype))
        self.values.index_copy_(1, offload_index, other.values.to(self.offload_device, self.values.dtype))
        self.valid.index_copy_(0, index, other.valid.to(self.valid.device))
        return self.replace(length=self.length.index_copy(0, index, other.length.to(self.length.device)))

    def write_layer(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        write_rows(self.stage_keys, self.stage_values, layer % 2, slots, k, v)
        keys, values = self.stage_keys[layer % 2], self.stage_values[layer % 2]
        self.copy_fn(self.keys[layer], keys, kind="writeback", layer=layer)
        self.copy_fn(self.values[layer], values, kind="writeback", layer=layer)
        self._prefetch_after(layer)
        return keys, values

    def reorder(self, beam_idx: torch.Tensor) -> OffloadedStaticCache:
        """Row ``i`` becomes old row ``beam_idx[i]``, in the donated buffers (addresses kept)."""
        if not torch.compiler.is_compiling():  # compiled code orders its own copies
            host_sync(self.compute_device)
        reorder_in_place((self.keys, self.values), beam_idx)
        self.valid.copy_(self.valid.index_select(0, beam_idx.to(self.valid.device)))
        return self.replace()


def init_offloaded_static_cache(
    num_layers: int,
    batch_size: int,
    num_kv_heads: int,
    max_cache_len: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    offload_device: torch.device | str = "cpu",
    copy_fn: CopyFn = default_copy,
) -> OffloadedStaticCache:
    compute, offload = as_device(device), as_device(offload_device)
    shape = (num_layers, batch_size, num_kv_heads, max_cache_len, head_dim)
    stage = (2, batch_size, num_kv_heads, max_cache_len, head_dim)
    keys, values = _alloc(shape, dtype, offload, compute), _alloc(shape, dtype, offload, compute)
    keys.zero_()
    values.zero_()
    return OffloadedStaticCache(
        keys=keys,
        values=values,
        stage_keys=torch.zeros(stage, dtype=dtype, device=compute),
        stage_values=torch.zeros(stage, dtype=dtype, device=compute),
        valid=torch.zeros(batch_size, max_cache_len, dtype=torch.bool, device=compute),
        length=torch.zeros(batch_size, dtype=torch.int64, device=compute),
        copy_fn=copy_fn,
    )
