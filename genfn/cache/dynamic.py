"""The dynamic KV cache: buffers that grow by concatenation, exactly as long as the sequence.

This is transformers' default (``DynamicCache``) and genfn's default for ``generate``. Its shapes
change every step, so it runs on the eager path; ``static`` is the compilable one.

Layout as the static cache (``[layers, batch, kv_heads, length, head_dim]``, ``valid [batch,
length]``), but the capacity always equals the number of tokens seen: ``advance`` concatenates
room for the new tokens onto every buffer (a new cache; the old one is donated and dropped) and
``write_layer`` fills that room in place. ``max_cache_len`` is the current length.
"""

from __future__ import annotations

import torch

from genfn.cache.base import CacheBase, rows_selected
from genfn.state.base import pytree_dataclass

__all__ = ["DynamicCache", "init_dynamic_cache"]


@pytree_dataclass
class DynamicCache(CacheBase):
    keys: torch.Tensor  # [L, B, Hkv, T, D], T = tokens seen so far
    values: torch.Tensor  # [L, B, Hkv, T, D]
    valid: torch.Tensor  # [B, T] bool
    length: torch.Tensor  # [] int64, equal to T

    @property
    def max_cache_len(self) -> int:
        """The current capacity, which is the current length (it grows with every ``advance``)."""
        return self.keys.shape[3]

    def slots(self, num_new: int) -> torch.Tensor:
        start = self.keys.shape[3]  # known on the host: no sync
        return torch.arange(start, start + num_new, device=self.valid.device)

    def advance(self, slots: torch.Tensor, new_valid: torch.Tensor) -> DynamicCache:
        """Grow every buffer by the ``S = len(slots)`` new tokens (concatenation)."""
        num_new = slots.shape[0]
        L, B, H, _, D = self.keys.shape
        room = torch.zeros((L, B, H, num_new, D), dtype=self.keys.dtype, device=self.keys.device)
        return self.replace(
            keys=torch.cat([self.keys, room], dim=3),
            values=torch.cat([self.values, room], dim=3),
            valid=torch.cat([self.valid, new_valid.to(torch.bool)], dim=1),
            length=self.length + num_new,
        )

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
        length=torch.zeros((), dtype=torch.int64, device=device),
    )
