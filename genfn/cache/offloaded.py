"""The offloaded dynamic cache: a dynamic cache whose layers live on an offload device (CPU).

transformers' ``DynamicCache(offloading=True)`` (``cache_implementation="offloaded"``). Every
layer's keys/values are kept on ``offload_device`` (pinned CPU memory when the compute device is
an accelerator); the compute device holds two *staging* buffers, enough for one layer in use and
the next one in flight:

* ``advance`` (start of a forward) grows the offloaded buffers by the new tokens, as the dynamic
  cache does, allocates the staging buffers at the new length, and loads layer 0 into stage 0;
* ``write_layer(i)`` writes the new keys/values into stage ``i % 2``, writes the new tokens back
  to the offloaded layer ``i``, issues the copy of layer ``i + 1`` into stage ``(i + 1) % 2`` (one
  layer ahead of its use), and returns stage ``i % 2``.

So the compute device holds two layers instead of ``num_layers``. Every cross-device copy goes
through ``copy_fn(dst, src, kind=..., layer=...)`` (``genfn.cache.base.default_copy``:
``copy_(non_blocking=True)``), which tests replace to observe the transfers. Before the host
touches the offloaded memory (growth, reorder) it waits for the copies in flight
(``host_sync``). This is a dynamic cache: it runs on the eager path.
"""

from __future__ import annotations

import dataclasses

import torch

from genfn.cache.base import CacheBase, CopyFn, as_device, default_copy, end_slots, host_sync, valid_below
from genfn.state.base import pytree_dataclass, static_field

__all__ = ["OffloadedCache", "init_offloaded_cache"]


@dataclasses.dataclass(frozen=True, eq=False)
class StagedLayers(CacheBase):
    """The fields and helpers both offloaded caches share: every layer on the offload device, two
    staging buffers on the compute device, ``copy_fn`` for every transfer between them. The
    subclasses are the ``pytree_dataclass``es (their leaves are these fields, in this order)."""

    keys: torch.Tensor  # [L, B, Hkv, T, D] on the offload device
    values: torch.Tensor  # [L, B, Hkv, T, D] on the offload device
    stage_keys: torch.Tensor  # [2, B, Hkv, T, D] on the compute device
    stage_values: torch.Tensor  # [2, B, Hkv, T, D] on the compute device
    valid: torch.Tensor  # [B, T] bool, compute device
    length: torch.Tensor  # [B] int64, compute device: each row's next write slot
    copy_fn: CopyFn = static_field(default=default_copy)

    @property
    def max_cache_len(self) -> int:
        return self.keys.shape[3]

    @property
    def offload_device(self) -> torch.device:
        return self.keys.device

    @property
    def compute_device(self) -> torch.device:
        return self.stage_keys.device

    def _prefetch_after(self, layer: int) -> None:
        """Issue the copy of layer ``layer + 1`` into its stage, one layer ahead of its use."""
        nxt = layer + 1
        if nxt < self.keys.shape[0]:
            self.copy_fn(self.stage_keys[nxt % 2], self.keys[nxt], kind="prefetch", layer=nxt)
            self.copy_fn(self.stage_values[nxt % 2], self.values[nxt], kind="prefetch", layer=nxt)


@pytree_dataclass
class OffloadedCache(StagedLayers):
    def slots(self, num_new: int) -> torch.Tensor:
        return end_slots(self.max_cache_len, self.batch_size, num_new, self.valid.device)

    def advance(self, slots: torch.Tensor, new_valid: torch.Tensor) -> OffloadedCache:
        num_new = slots.shape[1]
        _, B, H, T, D = self.keys.shape
        host_sync(self.compute_device)  # write-backs of the last forward land before the host copies
        keys, values = self._grow(self.keys, num_new), self._grow(self.values, num_new)
        stage = (2, B, H, T + num_new, D)
        stage_keys = torch.empty(stage, dtype=self.stage_keys.dtype, device=self.compute_device)
        stage_values = torch.empty(stage, dtype=self.stage_values.dtype, device=self.compute_device)
        self.copy_fn(stage_keys[0], keys[0], kind="load", layer=0)
        self.copy_fn(stage_values[0], values[0], kind="load", layer=0)
        return self.replace(
            keys=keys, values=values, stage_keys=stage_keys, stage_values=stage_values,
            valid=torch.cat([self.valid, new_valid.to(torch.bool)], dim=1),
            length=torch.full_like(self.length, T + num_new),
        )

    def rewind(self, lengths: torch.Tensor) -> OffloadedCache:
        """Truncate to the longest row, as the dynamic cache (the staging buffers follow at the next forward)."""
        keep = int(lengths.max()) if lengths.numel() else 0
        host_sync(self.compute_device)
        keys, values = self._alloc_like(self.keys, keep), self._alloc_like(self.values, keep)
        keys.copy_(self.keys.narrow(3, 0, keep))
        values.copy_(self.values.narrow(3, 0, keep))
        return self.replace(keys=keys, values=values, valid=valid_below(self.valid[:, :keep], lengths),
                            length=torch.full_like(self.length, keep))

    def with_rows(self, rows, other) -> OffloadedCache:
        raise ValueError("inserting rows into a running batch needs cache_implementation 'static', "
                         "'offloaded_static' or 'dynamic'; the offloaded dynamic cache does not support it")

    def write_layer(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        num_new = k.shape[2]
        start = self.keys.shape[3] - num_new
        keys, values = self.stage_keys[layer % 2], self.stage_values[layer % 2]
        keys.narrow(2, start, num_new).copy_(k)
        values.narrow(2, start, num_new).copy_(v)
        # Only the new tokens go back: the offloaded layer already holds the rest.
        self.copy_fn(self.keys[layer].narrow(2, start, num_new), k, kind="writeback", layer=layer)
        self.copy_fn(self.values[layer].narrow(2, start, num_new), v, kind="writeback", layer=layer)
        self._prefetch_after(layer)
        return keys, values

    def reorder(self, beam_idx: torch.Tensor) -> OffloadedCache:
        """Row ``i`` becomes old row ``beam_idx[i]`` (the staging buffers are reloaded next forward)."""
        host_sync(self.compute_device)
        idx = beam_idx.to(self.offload_device)
        keys, values = self._alloc_like(self.keys), self._alloc_like(self.values)
        torch.index_select(self.keys, 1, idx, out=keys)
        torch.index_select(self.values, 1, idx, out=values)
        return self.replace(keys=keys, values=values,
                            valid=self.valid.index_select(0, beam_idx.to(self.valid.device)))

    def _alloc_like(self, buf: torch.Tensor, length: int | None = None) -> torch.Tensor:
        shape = list(buf.shape)
        shape[3] = shape[3] if length is None else length
        return _alloc(tuple(shape), buf.dtype, self.offload_device, self.compute_device)

    def _grow(self, buf: torch.Tensor, num_new: int) -> torch.Tensor:
        """``cat([buf, zeros(num_new tokens)])`` along the token axis, into (pinned) offload memory."""
        old = buf.shape[3]
        grown = self._alloc_like(buf, old + num_new)
        grown.narrow(3, 0, old).copy_(buf)
        grown.narrow(3, old, num_new).zero_()
        return grown


def _pin(offload: torch.device, compute: torch.device) -> bool:
    """Pinned host memory makes host<->accelerator copies asynchronous."""
    return offload.type == "cpu" and compute.type not in ("cpu", "meta") and torch.cuda.is_available()


def _alloc(shape, dtype, offload: torch.device, compute: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=offload, pin_memory=_pin(offload, compute))


def init_offloaded_cache(
    num_layers: int,
    batch_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    offload_device: torch.device | str = "cpu",
    copy_fn: CopyFn = default_copy,
) -> OffloadedCache:
    """An empty offloaded cache; ``device`` is the compute device."""
    compute, offload = as_device(device), as_device(offload_device)
    shape = (num_layers, batch_size, num_kv_heads, 0, head_dim)
    stage = (2, batch_size, num_kv_heads, 0, head_dim)
    return OffloadedCache(
        keys=_alloc(shape, dtype, offload, compute),
        values=_alloc(shape, dtype, offload, compute),
        stage_keys=torch.empty(stage, dtype=dtype, device=compute),
        stage_values=torch.empty(stage, dtype=dtype, device=compute),
        valid=torch.zeros(batch_size, 0, dtype=torch.bool, device=compute),
        length=torch.zeros(batch_size, dtype=torch.int64, device=compute),
        copy_fn=copy_fn,
    )
