"""The static KV cache: preallocated buffers, written in place at a tensor offset.

Layout ``[layers, batch, kv_heads, max_cache_len, head_dim]`` for keys and values, a ``[batch,
max_cache_len]`` validity mask (left padding marks its slots invalid), and ``length [batch]``, each
row's fill pointer: rows advance, rewind and are replaced independently.

The update follows DESIGN principle 4: the cache passed in is *donated*. ``write`` copies the new
keys/values into the existing buffers (``index_copy_``) and returns a cache that shares them, so a
step costs O(new tokens), not O(cache). Never read a cache after passing it to a step.
"""

from __future__ import annotations

import torch

from genfn.cache.base import CacheBase, as_row_index, reorder_in_place, row_slots, valid_below
from genfn.state.base import pytree_dataclass

__all__ = ["StaticCache", "init_static_cache"]

_SPARE_SLOTS = 1


@pytree_dataclass
class StaticCache(CacheBase):
    keys: torch.Tensor  # [L, B, Hkv, T, D]
    values: torch.Tensor  # [L, B, Hkv, T, D]
    valid: torch.Tensor  # [B, T] bool: slot holds a real (non-padding) token
    length: torch.Tensor  # [B] int64: each row's next write slot
    # Optional: a tensor whose *size* is the number of slots worth attending (its values are
    # unused). The driver sets it between steps from the length it knows on the host and marks
    # that size dynamic, so one compiled step attends over the real context, not all T slots.
    span: torch.Tensor | None = None

    # ``rewind`` moves the fill pointer back, so the next tokens overwrite the forgotten slots:
    # a row's real tokens stay contiguous and a sliding window may be measured in slots.
    rows_have_holes = False

    def attend_len(self) -> int:
        """How many leading slots attention reads (a SymInt under a dynamic-span compile)."""
        return self.max_cache_len if self.span is None else self.span.shape[0]

    def with_span(self, num_slots: int, *, dynamic: bool = True) -> "StaticCache":
        """This cache with attention limited to the first ``num_slots`` slots (rounded up to 16).
        ``dynamic``: the span's size marked dynamic for a compiled step; an eager run passes False,
        and the span's first change then costs no import of dynamo (~0.9 s)."""
        num_slots = min(-(-num_slots // 16) * 16, self.max_cache_len)
        if self.span is not None and self.span.shape[0] == num_slots:
            return self  # the span moves every 16 slots: most steps keep it
        span = torch.empty(num_slots, dtype=torch.int8, device=self.keys.device)
        if dynamic:
            # One compiled step serves every span length; maybe_ (not mark_) lets dynamo specialize
            # the rare edge (span == T) with a guard instead of failing the compile.
            torch._dynamo.maybe_mark_dynamic(span, 0)
        return self.replace(span=span)

    @property
    def max_cache_len(self) -> int:
        # One slot past the capacity is never written nor attended (see init_static_cache).
        return self.keys.shape[3] - _SPARE_SLOTS

    def slots(self, num_new: int) -> torch.Tensor:
        """``[B, num_new]`` the slots each row's next ``num_new`` tokens go to."""
        return row_slots(self.length, num_new, self.max_cache_len)

    def write_layer(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write ``k, v [B, Hkv, S, D]`` of ``layer`` at ``slots [B, S]`` in place; return the layer's full K, V."""
        write_rows(self.keys, self.values, layer, slots, k, v)
        return self.keys[layer], self.values[layer]

    def advance(self, slots: torch.Tensor, new_valid: torch.Tensor) -> "StaticCache":
        """Mark ``slots`` filled with validity ``new_valid [B, S]``; the buffers were written in place."""
        self.valid.scatter_(1, slots, new_valid.to(torch.bool))
        return self.replace(length=(self.length + slots.shape[1]).clamp(max=self.max_cache_len))

    def rewind(self, lengths: torch.Tensor) -> "StaticCache":
        """Forget row ``b``'s slots from ``lengths[b]`` on: a pointer move (the buffers stay)."""
        self.valid.copy_(valid_below(self.valid, lengths))
        return self.replace(length=lengths.to(self.length.dtype))

    def with_rows(self, rows, other: "StaticCache") -> "StaticCache":
        """Rows ``rows`` replaced by ``other``'s rows (same capacity), in the donated buffers."""
        index = as_row_index(rows, self.length.device)
        check_same_capacity(self, other)
        self.keys.index_copy_(1, index, other.keys.to(self.keys.dtype))
        self.values.index_copy_(1, index, other.values.to(self.values.dtype))
        self.valid.index_copy_(0, index, other.valid)
        return self.replace(length=self.length.index_copy(0, index, other.length))

    def reorder(self, beam_idx: torch.Tensor) -> "StaticCache":
        """Row ``i`` becomes old row ``beam_idx[i]`` (beam search's reorder), in the donated buffers."""
        reorder_in_place((self.keys, self.values), beam_idx)
        self.valid.copy_(self.valid.index_select(0, beam_idx))
        return self.replace()


def write_rows(keys: torch.Tensor, values: torch.Tensor, layer: int, slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
    """``keys[layer, b, :, slots[b]] = k[b]`` (and values) for every row, in place."""
    # Index the stacked base tensors, never a per-layer view of them: inductor reinplaces an
    # index_put_ on a graph input, but functionalizes a write through a view into a copy of
    # the whole buffer per step (measured: 12x slower per token at max_cache_len 4096).
    batch, heads, seq = k.shape[0], k.shape[1], k.shape[2]
    device = slots.device
    index = (
        torch.tensor(layer, device=device),
        torch.arange(batch, device=device).view(batch, 1, 1),
        torch.arange(heads, device=device).view(1, heads, 1),
        slots.view(batch, 1, seq),
    )
    keys.index_put_(index, k.to(keys.dtype))
    values.index_put_(index, v.to(values.dtype))


def check_same_capacity(cache, other) -> None:
    if other.max_cache_len != cache.max_cache_len:
        raise ValueError(f"cannot insert rows of a cache with max_cache_len {other.max_cache_len} into one with "
                         f"max_cache_len {cache.max_cache_len}: prefill with the running batch's max_cache_len")


def init_static_cache(
    num_layers: int,
    batch_size: int,
    num_kv_heads: int,
    max_cache_len: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> StaticCache:
    # The buffers hold one slot past ``max_cache_len``. Attention reads a leading slice of a
    # dynamic size (the span); were the slice ever the whole buffer it would be contiguous, and
    # inductor guards on that: the last steps of every run that fills its cache recompiled the
    # whole step (~1 min on SmolLM2). With the spare slot the slice is never the whole buffer.
    slots = max_cache_len + _SPARE_SLOTS
    shape = (num_layers, batch_size, num_kv_heads, slots, head_dim)
    return StaticCache(
        keys=torch.zeros(shape, dtype=dtype, device=device),
        values=torch.zeros(shape, dtype=dtype, device=device),
        valid=torch.zeros(batch_size, slots, dtype=torch.bool, device=device),
        length=torch.zeros(batch_size, dtype=torch.int64, device=device),
    )
