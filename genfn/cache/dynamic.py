"""The dynamic KV cache: buffers exactly as long as the sequence, which grow with every forward.

This is transformers' default (``DynamicCache``) and genfn's default for ``generate``. Its shapes
change every step, so it runs on the eager path; ``static`` is the compilable one.

Layout as the static cache (``[layers, batch, kv_heads, length, head_dim]``, ``valid [batch,
length]``), but the capacity always equals the number of tokens seen: ``advance`` lengthens every
buffer by the new tokens' slots (a new cache; the old one is donated and dropped) and
``write_layer`` fills them in place. The buffers are leading views of storage allocated with room
to spare (``lengthened``), so a step lengthens the views and copies nothing, as the design's
donated buffers promise (O(new tokens) a step, not O(cache)); transformers concatenates every
step. ``max_cache_len`` is the current length. Every row
appends at the end columns; ``rewind`` truncates to the longest row and masks the tails of the
shorter ones (attention skips them like padding; positions are carried separately, so a gap
changes nothing).
"""

from __future__ import annotations

import math

import torch

from genfn.cache.base import CacheBase, as_row_index, end_slots, rows_selected, valid_below
from genfn.state.base import pytree_dataclass

__all__ = ["DynamicCache", "init_dynamic_cache"]


@pytree_dataclass
class DynamicCache(CacheBase):
    keys: torch.Tensor  # [L, B, Hkv, T, D], T = tokens seen so far
    values: torch.Tensor  # [L, B, Hkv, T, D]
    valid: torch.Tensor  # [B, T] bool
    length: torch.Tensor  # [B] int64: each row's next write slot (T for every row)

    @property
    def max_cache_len(self) -> int:
        """The current capacity, which is the current length (it grows with every ``advance``)."""
        return self.keys.shape[3]

    def slots(self, num_new: int) -> torch.Tensor:
        # The capacity is known on the host: no sync.
        return end_slots(self.max_cache_len, self.batch_size, num_new, self.valid.device)

    def advance(self, slots: torch.Tensor, new_valid: torch.Tensor) -> DynamicCache:
        """Grow every buffer by the ``S`` new tokens (concatenation)."""
        keys, values, valid = appended_slots(self.keys, self.values, self.valid, new_valid.to(torch.bool))
        return self.replace(keys=keys, values=values, valid=valid,
                            length=torch.full_like(self.length, self.max_cache_len + slots.shape[1]))

    def rewind(self, lengths: torch.Tensor) -> DynamicCache:
        """Truncate to the longest row (one host read: this cache runs eagerly); mask shorter rows' tails.
        The buffers become shorter views of the same storage (no copy): the next ``advance`` lengthens
        them over the forgotten slots, which its forward's ``write_layer`` overwrites."""
        keep = int(lengths.max()) if lengths.numel() else 0
        return self.replace(keys=self.keys[:, :, :, :keep], values=self.values[:, :, :, :keep],
                            valid=valid_below(self.valid[:, :keep], lengths), length=torch.full_like(self.length, keep))

    def with_rows(self, rows, other) -> DynamicCache:
        """Rows ``rows`` replaced by ``other``'s; the shorter of the two is widened with masked columns."""
        cache, other = widen(self, other.max_cache_len), widen(other, self.max_cache_len)
        index = as_row_index(rows, self.valid.device)
        return cache.replace(keys=cache.keys.index_copy(1, index, other.keys.to(cache.keys.dtype)),
                             values=cache.values.index_copy(1, index, other.values.to(cache.values.dtype)),
                             valid=cache.valid.index_copy(0, index, other.valid),
                             length=torch.full_like(cache.length, cache.max_cache_len))

    def write_layer(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Fill the room ``advance`` made at ``slots`` (the last ``S`` positions) in place."""
        keys, values = self.keys[layer], self.values[layer]
        num_new = k.shape[2]
        keys.narrow(2, keys.shape[2] - num_new, num_new).copy_(k)
        values.narrow(2, values.shape[2] - num_new, num_new).copy_(v)
        return keys, values

    def reorder(self, beam_idx: torch.Tensor) -> DynamicCache:
        """Row ``i`` becomes old row ``beam_idx[i]`` (a new cache; this one is donated)."""
        return self.replace(**rows_selected(self, ("keys", "values"), beam_idx))


def widen(cache, capacity: int):
    """A growing cache with at least ``capacity`` columns: new columns are masked (never attended)."""
    extra = capacity - cache.max_cache_len
    if extra <= 0:
        return cache
    masked = torch.zeros(cache.valid.shape[0], extra, dtype=torch.bool, device=cache.valid.device)
    keys, values, valid = appended_slots(cache.keys, cache.values, cache.valid, masked)
    return cache.replace(keys=keys, values=values, valid=valid, length=torch.full_like(cache.length, capacity))


def appended_slots(keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, new_valid: torch.Tensor):
    """``(keys, values, valid)`` of a growing cache with ``S`` more slots per row: keys and values
    lengthened by ``S`` slots on the slot axis (``lengthened``: zeros, or what a forward from a
    donated cache wrote there, which this forward's ``write_layer`` overwrites) and ``new_valid
    [B, S]`` appended to ``valid``."""
    num_new = new_valid.shape[1]
    grown_valid = lengthened(valid, 1, valid.shape[1] + num_new)
    grown_valid[:, valid.shape[1]:] = new_valid
    return lengthened(keys, 3, keys.shape[3] + num_new), lengthened(values, 3, values.shape[3] + num_new), grown_valid


def lengthened(buffer: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``buffer`` with ``length`` slots along ``dim``: a view of ``buffer``'s own storage where that
    storage was allocated with room for them (``_with_room``; the new slots hold zeros, or what a
    forward from a donated cache wrote there, which this one's ``write_layer`` overwrites), else a
    copy into new zeroed storage with room to spare. Concatenating room for each step's tokens
    copied the whole cache every step (SmolLM2's eager decode: 0.5 of 6.1 ms a token at 80 tokens,
    and growing with the text); with room to spare it is copied as often as it doubles up to 1024
    slots, then once per 1024 tokens.

    ``buffer`` must be a growing cache's own (from ``init_dynamic_cache`` or here): a leading view
    of someone else's contiguous tensor would be lengthened into that tensor. The cache that
    lengthens a view claims the room past it, and the one it lengthened is donated (the cache
    contract: never read an old state), so no two live caches write the same slots."""
    held = buffer.shape[dim]
    if length <= _capacity(buffer, dim):
        return buffer.as_strided(buffer.shape[:dim] + (length,) + buffer.shape[dim + 1:], buffer.stride())
    grown = _with_room(buffer, dim, length)
    grown.narrow(dim, 0, held).copy_(buffer)
    return grown


# Room a growing buffer is allocated with when it must be copied, in slots past what it needs: as
# many as it needs, at least 64 and at most 1024 (so at most twice the memory up to 1024 slots, then
# 1024 slots more).
_MIN_ROOM, _MAX_ROOM = 64, 1024


def _with_room(buffer: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """A zero tensor of ``buffer``'s shape with ``length`` slots along ``dim``, a leading view of a
    contiguous allocation with room for more (``_capacity`` reads that room back from its strides)."""
    capacity = length + min(max(length, _MIN_ROOM), _MAX_ROOM)
    backing = torch.zeros(buffer.shape[:dim] + (capacity,) + buffer.shape[dim + 1:], dtype=buffer.dtype,
                          device=buffer.device)
    return backing.narrow(dim, 0, length)


def _capacity(buffer: torch.Tensor, dim: int) -> int:
    """Slots along ``dim`` that ``buffer``'s storage holds, where ``buffer`` is a leading view (from
    offset 0) of a contiguous tensor that differs from it only in that size; else its own size."""
    held = buffer.shape[dim]
    if dim == 0 or buffer.storage_offset() != 0:
        return held
    inner = buffer.stride(dim)
    if inner == 0 or buffer.stride(dim - 1) % inner:
        return held
    capacity = buffer.stride(dim - 1) // inner
    shape = buffer.shape[:dim] + (capacity,) + buffer.shape[dim + 1:]
    if capacity < held or buffer.untyped_storage().nbytes() < math.prod(shape) * buffer.element_size():
        return held
    return capacity if buffer.as_strided(shape, buffer.stride()).is_contiguous() else held


def init_dynamic_cache(
    num_layers: int,
    batch_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> DynamicCache:
    """An empty dynamic cache (length 0)."""
    shape = (num_layers, batch_size, num_kv_heads, 0, head_dim)
    return DynamicCache(
        keys=torch.zeros(shape, dtype=dtype, device=device),
        values=torch.zeros(shape, dtype=dtype, device=device),
        valid=torch.zeros(batch_size, 0, dtype=torch.bool, device=device),
        length=torch.zeros(batch_size, dtype=torch.int64, device=device),
    )
