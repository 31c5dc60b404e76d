"""The dynamic KV cache: buffers that grow by concatenation, exactly as long as the sequence.

This is transformers' default (``DynamicCache``) and genfn's default for ``generate``. Its shapes
change every step, so it runs on the eager path; ``static`` is the compilable one.

Layout as the static cache (``[layers, batch, kv_heads, length, head_dim]``, ``valid [batch,
length]``), but the capacity always equals the number of tokens seen: ``advance`` concatenates
room for the new tokens onto every buffer (a new cache; the old one is donated and dropped) and
``write_layer`` fills that room in place. ``max_cache_len`` is the current length. Every row
appends at the end columns; ``rewind`` truncates to the longest row and masks the tails of the
shorter ones (attention skips them like padding; positions are carried separately, so a gap
changes nothing).
"""

from __future__ import annotations

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
        """Truncate to the longest row (one host read: this cache runs eagerly); mask shorter rows' tails."""
        keep = int(lengths.max()) if lengths.numel() else 0
        return self.replace(keys=self.keys[:, :, :, :keep].clone(), values=self.values[:, :, :, :keep].clone(),
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
    """``(keys, values, valid)`` of a growing cache with ``S`` more slots per row: zero keys and values
    (``[L, B, H, S, D]`` appended on the slot axis) and ``new_valid [B, S]`` appended to ``valid``."""
    L, B, H, held, D = keys.shape
    room = torch.zeros((L, B, H, new_valid.shape[1], D), dtype=keys.dtype, device=keys.device)
    if held == 0 and valid.shape[1] == 0:  # a first forward (a prefill): the room is all there is, no copy
        return room, torch.zeros_like(room), new_valid.clone()
    return torch.cat([keys, room], dim=3), torch.cat([values, room], dim=3), torch.cat([valid, new_valid], dim=1)


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
