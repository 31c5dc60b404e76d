"""What every KV cache shares: the interface the model uses, memory accounting, device transfers.

Rows move independently: every row has its own fill pointer. A cache is a ``pytree_dataclass``
with these members, which is all ``genfn.models`` and the strategies rely on:

``slots(num_new) -> LongTensor[B, num_new]``
    the slots row ``b``'s next ``num_new`` tokens go to: ``length[b] + arange(num_new)`` for the
    fixed-size caches (clamped to the last slot, so a finished row at capacity never writes out of
    bounds); the shared end columns for the growing caches (dynamic, offloaded, quantized), whose
    rows all append at the current capacity;
``advance(slots, new_valid[B, S]) -> cache``
    called once per forward, *before* the layers: claims ``slots`` (a growing cache grows its
    buffers here) and records which of the new tokens are real, so the attention mask covers them;
``write_layer(layer, slots, k, v) -> (K, V)``
    stores the new keys/values ``[B, Hkv, S, D]`` of one layer in the buffers ``advance`` made
    room for (in place: the cache is donated) and returns the layer's keys/values
    ``[B, Hkv, max_cache_len, D]`` on the compute device;
``rewind(lengths[B]) -> cache``
    forget every slot at or after ``lengths[b]`` in row ``b`` (a rejected draft): a pointer move
    for the fixed-size caches; the growing caches truncate to the longest row (one host read: they
    run eagerly) and mask the shorter rows' tails, which attention then skips like padding;
``with_rows(rows[R], other) -> cache``
    rows ``rows`` replaced by the ``R`` rows of ``other`` (a prefilled request joining a running
    batch);
``valid [B, max_cache_len]`` (bool), ``length [B]`` (int64: each row's next write slot),
``max_cache_len`` (int: the capacity, which for a growing cache is the current length);
``rows_have_holes`` (class attribute, bool): whether a row may hold masked slots *between* real
    tokens (a growing cache's rewound tails and widened rows), so that a sliding window must count
    real tokens (``real_tokens_back``) rather than slots; only the fixed-size caches, whose rewind
    moves the fill pointer back over the forgotten slots, leave none (left padding precedes every
    real token, so it is no hole);
``reorder(beam_idx: LongTensor[B]) -> cache``
    row ``i`` becomes old row ``beam_idx[i]`` (beam search);
``nbytes(device=None) -> int``
    bytes held by the cache's tensors (only those on ``device`` when given).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from genfn.state.base import leaf_fields

__all__ = ["CacheBase", "CopyFn", "as_device", "default_copy", "host_sync", "reorder_in_place", "rows_selected",
           "tensor_nbytes", "begin_forward", "row_slots", "end_slots", "valid_below", "as_row_index",
           "real_tokens_back"]

# ``copy_fn(dst, src, *, kind, layer)``: copy ``src`` into ``dst`` (devices may differ). ``kind`` is
# "load" (a layer staged at the start of a forward), "prefetch" (the next layer, staged one layer
# ahead of use) or "writeback" (new keys/values returned to the offload device); ``layer`` is the
# layer index. Offloaded caches issue every cross-device copy through it, so tests (or a
# stream-aware implementation) can observe or replace the transfers.
CopyFn = Callable[..., None]


def default_copy(dst: torch.Tensor, src: torch.Tensor, *, kind: str, layer: int) -> None:
    """Asynchronous where the devices allow it; ordered on the current stream."""
    dst.copy_(src, non_blocking=True)


def host_sync(device: torch.device) -> None:
    """Wait for the copies queued on ``device`` before the host reads offloaded memory."""
    if device.type in ("cpu", "meta"):
        return
    module = getattr(torch, device.type, None)
    if module is not None and hasattr(module, "synchronize"):
        module.synchronize(device)


def as_device(device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device if device is not None else "cpu")


def tensor_nbytes(cache, device: torch.device | str | None = None) -> int:
    """Bytes of the tensor leaves of ``cache`` (only those on ``device`` when given)."""
    if device is not None:
        device = as_device(device)
    total = 0
    for name in leaf_fields(type(cache)):
        value = getattr(cache, name)
        tensors = value if isinstance(value, (tuple, list)) else (value,)
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            if device is not None and (t.device.type != device.type or
                                       (device.index is not None and t.device.index != device.index)):
                continue
            total += t.numel() * t.element_size()
    return total


class CacheBase:
    """Methods every cache shares; the caches are ``pytree_dataclass``es deriving from it."""

    # The exact default: a cache that does not declare its rows gapless gets windows counted in tokens.
    rows_have_holes = True

    def nbytes(self, device=None) -> int:
        """Bytes held by the cache's tensors (only those on ``device`` when given)."""
        return tensor_nbytes(self, device)

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]


def begin_forward(cache, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  attend_len: int | None = None):
    """What every forward does with the cache before its layers: claim each row's next slots,
    record which new tokens are real (``attention_mask [B, S]``, default all), and resolve how many
    slots attention reads — the cache's span, or ``attend_len``, capped by the capacity (a growing
    cache's capacity covers the new tokens only after ``advance``).

    Returns ``(cache, slots [B, S], attend_len)``.
    """
    batch, seq = tokens.shape
    slots = cache.slots(seq)
    if attention_mask is None:
        new_valid = torch.ones(batch, seq, dtype=torch.bool, device=tokens.device)
    else:
        new_valid = attention_mask.to(torch.bool)
    cache = cache.advance(slots, new_valid)
    if attend_len is None:
        attend_len = cache.attend_len() if hasattr(cache, "attend_len") else cache.max_cache_len
    else:
        attend_len = min(attend_len, cache.max_cache_len)
    return cache, slots, attend_len


def row_slots(length: torch.Tensor, num_new: int, capacity: int) -> torch.Tensor:
    """``[B, num_new]`` each row's next slots after its fill pointer ``length [B]``, clamped to the
    last slot: a finished row that sits at capacity keeps writing (to a slot it never reads again)
    without indexing out of bounds."""
    slots = length.unsqueeze(1) + torch.arange(num_new, device=length.device)
    return slots.clamp(max=capacity - 1)


def end_slots(capacity: int, batch_size: int, num_new: int, device) -> torch.Tensor:
    """``[B, num_new]`` the columns a growing cache appends at (the same for every row)."""
    return torch.arange(capacity, capacity + num_new, device=device).expand(batch_size, num_new)


def valid_below(valid: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``valid`` with every slot at or after ``lengths[b]`` of row ``b`` cleared."""
    columns = torch.arange(valid.shape[1], device=valid.device)
    return valid & (columns.unsqueeze(0) < lengths.to(valid.device).unsqueeze(1))


def real_tokens_back(valid: torch.Tensor, slots: torch.Tensor, attend_len: int) -> torch.Tensor:
    """``[B, S, attend_len]`` int32: how many real tokens of row ``b`` lie after slot ``j`` up to and
    including its query ``i`` (at slot ``slots[b, i]``), i.e. how far back slot ``j`` is in tokens.

    A key at or before the query is inside a sliding window of ``w`` tokens when this is ``< w``
    (the query itself is 0 back). Slot distance would also count the masked holes a growing cache
    leaves inside a row; this does not. Pure: a running count and one gather, no host sync.
    """
    # Counted over every slot, not just the first ``attend_len``, so the gather at the query slots
    # stays in bounds whatever ``attend_len`` a caller passes.
    counts = valid.cumsum(dim=1, dtype=torch.int32)  # [B, T]: real tokens in slots 0..j
    at_query = counts.gather(1, slots)  # [B, S]
    return at_query.unsqueeze(2) - counts[:, :attend_len].unsqueeze(1)


def as_row_index(rows, device) -> torch.Tensor:
    """Row indices as a 1-D int64 tensor (an int, a list, or a tensor)."""
    index = torch.as_tensor(rows, dtype=torch.int64, device=device)
    return index.reshape(-1)


def reorder_in_place(buffers, beam_idx: torch.Tensor) -> None:
    """Row ``i`` of each ``[L, B, ...]`` buffer becomes old row ``beam_idx[i]``, in place.

    Each layer is gathered into a temporary and copied back, so the buffers keep their addresses
    (static for compiled steps) and the extra memory is one layer, not the cache.
    """
    for buffer in buffers:
        idx = beam_idx.to(buffer.device)
        for layer in range(buffer.shape[0]):
            buffer[layer].copy_(buffer[layer].index_select(0, idx))


def rows_selected(cache, names, beam_idx: torch.Tensor) -> dict:
    """``replace`` arguments giving row ``i`` of ``cache.valid`` and of each ``[L, B, ...]`` buffer
    in ``names`` the old row ``beam_idx[i]`` (new tensors: for caches that are not donated)."""
    changes = {name: getattr(cache, name).index_select(1, beam_idx.to(getattr(cache, name).device))
               for name in names}
    changes["valid"] = cache.valid.index_select(0, beam_idx.to(cache.valid.device))
    return changes
