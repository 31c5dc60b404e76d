"""The paged KV cache: key/value blocks as a pytree, written by slot, read through block tables.

Keys and values are ``[layers, num_blocks + 1, kv_heads, block_size, head_dim]``. Blocks
``0 .. num_blocks - 1`` belong to the allocator (``genfn.batching.blocks``), which hands them to
requests; the extra last block is a *sink*: padding tokens of a batch padded to a static size
write there (slot ``-1``), so one compiled step serves every batch without a branch on the host.

A forward over a packed batch (prefill chunks and decode tokens of different requests, one
after the other on a single token axis) calls, for each layer, ``write(cache, layer,
slot_mapping, k, v)`` then ``paged_attention(q, cache, layer, block_tables, request_index,
positions)``: token ``t`` (of request ``request_index[t]``, at ``positions[t]`` in it) attends
the keys at positions ``0 .. positions[t]`` of its own request, found through the request's row
of ``block_tables``. Its own key was written first, so attention is causal within each request
and blind across requests.

The write is in place (DESIGN principle 4: the cache is donated); the returned cache shares
the buffers.
"""

from __future__ import annotations

import torch

from genfn.cache.base import CacheBase
from genfn.state.base import pytree_dataclass, static_field

__all__ = ["PagedKVCache", "init_paged_cache", "paged_attention", "write"]


@pytree_dataclass
class PagedKVCache(CacheBase):
    keys: torch.Tensor  # [L, num_blocks + 1, Hkv, block_size, D]
    values: torch.Tensor  # [L, num_blocks + 1, Hkv, block_size, D]
    block_size: int = static_field()

    @property
    def num_blocks(self) -> int:
        """Blocks the allocator hands out (the sink block is not one of them)."""
        return self.keys.shape[1] - 1

    @property
    def sink_block(self) -> int:
        return self.keys.shape[1] - 1

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]


def init_paged_cache(
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> PagedKVCache:
    for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks), ("num_kv_heads", num_kv_heads),
                        ("block_size", block_size), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"`{name}` must be >= 1, got {value}")
    shape = (num_layers, num_blocks + 1, num_kv_heads, block_size, head_dim)
    return PagedKVCache(
        keys=torch.zeros(shape, dtype=dtype, device=device),
        values=torch.zeros(shape, dtype=dtype, device=device),
        block_size=block_size,
    )


def _block_and_offset(cache: PagedKVCache, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sink = cache.sink_block * cache.block_size
    slots = torch.where(slot_mapping < 0, torch.full_like(slot_mapping, sink), slot_mapping)
    return slots // cache.block_size, slots % cache.block_size


def write(cache: PagedKVCache, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor,
          v: torch.Tensor) -> PagedKVCache:
    """Store ``k, v [T, Hkv, D]`` of ``layer`` at ``slot_mapping [T]`` (``block * block_size + offset``;
    negative slots are padding and land in the sink block). In place; returns the cache."""
    blocks, offsets = _block_and_offset(cache, slot_mapping)
    heads = k.shape[1]
    device = slot_mapping.device
    # Index the stacked buffers (not a per-layer view) so inductor can reinplace the write.
    index = (
        torch.tensor(layer, device=device),
        blocks.view(-1, 1),
        torch.arange(heads, device=device).view(1, heads),
        offsets.view(-1, 1),
    )
    cache.keys.index_put_(index, k.to(cache.keys.dtype))
    cache.values.index_put_(index, v.to(cache.values.dtype))
    return cache.replace()


def paged_attention(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    block_tables: torch.Tensor,
    request_index: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    query_chunk: int | None = 128,
) -> torch.Tensor:
    """Attention of the packed queries ``q [T, H, D]`` over their own requests' cached keys/values.

    ``block_tables [R, W]``: row ``r`` lists request ``r``'s blocks (entries past its length may
    be anything in range, e.g. the sink block); ``request_index [T]``: the row of each query;
    ``positions [T]``: the query's position within its request. Query ``t`` attends positions
    ``0 .. positions[t]`` (and only the last ``sliding_window`` of them when given). Grouped-query
    attention: ``H`` is a multiple of the cache's kv heads. Returns ``[T, H, D]`` in ``q``'s dtype,
    computed in float32 (float64 for float64 inputs).

    The keys of each query are gathered through its block-table row, ``query_chunk`` queries at a
    time (``None``: all at once), so the memory is ``query_chunk x W x block_size`` keys and values,
    whatever ``T``. This is the reference path (any device, compiles to one graph); a fused varlen
    kernel computes the same. The scores of a padding query (position 0) are finite and ignored.
    """
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = cache.keys.shape[2]
    if num_heads % kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of the cache's kv heads ({kv_heads})")
    if query_chunk is not None and (isinstance(query_chunk, bool) or not isinstance(query_chunk, int)
                                    or query_chunk < 1):
        raise ValueError(f"`query_chunk` must be an int >= 1 or None, got {query_chunk!r}")
    scale = head_dim ** -0.5 if scale is None else scale
    step = num_tokens if query_chunk is None else query_chunk
    # A Python loop over a static count: unrolled by the compiler, no host sync.
    outs = [
        _attend_chunk(q[start:start + step], cache.keys[layer], cache.values[layer],
                      block_tables.index_select(0, request_index[start:start + step]),
                      positions[start:start + step], scale, sliding_window)
        for start in range(0, num_tokens, max(step, 1))
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend_chunk(q, keys, values, tables, positions, scale, sliding_window):
    """``q [t, H, D]`` against the keys at positions ``0 .. positions`` of the rows ``tables [t, W]``."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads, block_size = keys.shape[1], keys.shape[2]
    groups = num_heads // kv_heads
    span = tables.shape[1] * block_size
    # [t, W, Hkv, bs, D] -> [t, Hkv, W * bs, D]: key ``s`` of a query is at position ``s`` of its request.
    k = keys[tables].permute(0, 2, 1, 3, 4).reshape(num_tokens, kv_heads, span, head_dim)
    v = values[tables].permute(0, 2, 1, 3, 4).reshape(num_tokens, kv_heads, span, head_dim)
    # Half precisions accumulate in float32; float64 stays float64.
    compute = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(num_tokens, kv_heads, groups, head_dim).to(compute)
    scores = torch.einsum("thgd,thsd->thgs", qg, k.to(compute)) * scale
    key_pos = torch.arange(span, device=q.device)
    visible = key_pos.view(1, span) <= positions.view(num_tokens, 1)
    if sliding_window is not None:
        visible = visible & (key_pos.view(1, span) > positions.view(num_tokens, 1) - sliding_window)
    scores = scores.masked_fill(~visible.view(num_tokens, 1, 1, span), float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out = torch.einsum("thgs,thsd->thgd", weights, v.to(compute))
    return out.reshape(num_tokens, num_heads, head_dim).to(q.dtype)
