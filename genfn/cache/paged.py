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

``paged_attention`` gathers every query's whole padded table: one graph of static shapes, the
compiled path. Eagerly, a ``PackedPlan`` (the batch's structure as host integers: which tokens
are one-token decode chunks, where each prefill chunk sits, how many blocks each row's keys
span) lets ``planned_attention`` gather each row's keys once per layer, only over the blocks
they occupy (decode rows together, each prefill chunk alone), and run
``scaled_dot_product_attention`` on them, as the dense model does. Where genfn's native kernels
are built (``genfn/kernels/decode_attention.cpp``), the decode rows skip the gather: one op reads
each row's keys and values where they lie in the blocks, and ``write`` stores by slot without
``index_put``'s index tensors. At 32 decode rows of SmolLM2 the gather, its copies and SDPA's
set-up took ~24 % of an eager step (torch profiler, float32, one thread); the op takes ~5 %.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from genfn.cache.base import CacheBase
from genfn.state.base import pytree_dataclass, static_field

__all__ = ["PackedPlan", "PlannedAttention", "PagedKVCache", "init_paged_cache", "paged_attention",
           "plan_attention", "planned_attention", "sink_softmax", "write"]


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

    def copy_blocks(self, copies) -> "PagedKVCache":
        """Copy whole blocks' keys and values, ``(source, target)`` pairs (a forked beam's partial
        last block), in place between steps; returns the cache (donated)."""
        if copies:
            source = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=self.keys.device)
            target = torch.tensor([t for _, t in copies], dtype=torch.int64, device=self.keys.device)
            self.keys.index_copy_(1, target, self.keys.index_select(1, source))
            self.values.index_copy_(1, target, self.values.index_select(1, source))
        return self

    def clear_blocks(self, blocks) -> "PagedKVCache":
        """Zero the keys and values of ``blocks`` in place (a failed request's, which may hold NaN:
        a later request reads stale slots masked out, and ``0 * NaN`` is NaN); returns the cache."""
        if blocks:
            index = torch.tensor(list(blocks), dtype=torch.int64, device=self.keys.device)
            self.keys.index_fill_(1, index, 0)
            self.values.index_fill_(1, index, 0)
        return self


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


def _native_ops():
    return torch.ops.genfn_kernels


def _kernels_built() -> bool:
    from genfn.kernels import portable_ops_available

    return portable_ops_available()


def _native_ok(buffer: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether the native paged ops (``genfn/kernels/decode_attention.cpp``) serve this eager call:
    built, a CPU float32/bfloat16 buffer, and nothing that autograd would have to differentiate."""
    return (buffer.device.type == "cpu" and buffer.dtype in (torch.float32, torch.bfloat16)
            and buffer.is_contiguous()
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and _kernels_built())


def _block_and_offset(cache: PagedKVCache, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sink = cache.sink_block * cache.block_size
    slots = torch.where(slot_mapping < 0, torch.full_like(slot_mapping, sink), slot_mapping)
    return slots // cache.block_size, slots % cache.block_size


def write(cache: PagedKVCache, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor,
          v: torch.Tensor) -> PagedKVCache:
    """Store ``k, v [T, Hkv, D]`` of ``layer`` at ``slot_mapping [T]`` (``block * block_size + offset``;
    negative slots are padding and land in the sink block). In place; returns the cache."""
    if not torch.compiler.is_compiling() and _native_ok(cache.keys, k, v):
        dtype = cache.keys.dtype
        _native_ops().paged_write(cache.keys, cache.values, layer, slot_mapping, k.to(dtype), v.to(dtype))
        return cache.replace()
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
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
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
    ``softcap``: the scores become ``tanh(scores / softcap) * softcap`` before the mask (Gemma 2).
    ``sinks [H]``: each head's sink logit joins every softmax (``sink_softmax``: GPT-OSS).
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
                      positions[start:start + step], scale, sliding_window, softcap, sinks)
        for start in range(0, num_tokens, max(step, 1))
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend_chunk(q, keys, values, tables, positions, scale, sliding_window, softcap=None, sinks=None):
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
    scores = soft_capped(torch.einsum("thgd,thsd->thgs", qg, k.to(compute)) * scale, softcap)
    key_pos = torch.arange(span, device=q.device)
    visible = key_pos.view(1, span) <= positions.view(num_tokens, 1)
    if sliding_window is not None:
        visible = visible & (key_pos.view(1, span) > positions.view(num_tokens, 1) - sliding_window)
    scores = scores.masked_fill(~visible.view(num_tokens, 1, 1, span), float("-inf"))
    weights = sink_softmax(scores, None if sinks is None else sinks.view(1, kv_heads, groups, 1))
    out = torch.einsum("thgs,thsd->thgd", weights, v.to(compute))
    return out.reshape(num_tokens, num_heads, head_dim).to(q.dtype)


def soft_capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``tanh(scores / softcap) * softcap`` (Gemma 2's attention scores), or ``scores`` for None."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """``softmax(scores)`` over the last dimension, or, with ``sinks`` (broadcastable to
    ``scores[..., :1]``: one logit per head), the softmax of each row with its head's sink logit
    appended, the sink's share dropped: GPT-OSS's attention sinks take probability mass and give no
    value. A row whose keys are all masked (``-inf``) then weighs nothing, finitely."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.to(scores.dtype).expand_as(scores[..., :1])
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


@dataclasses.dataclass(frozen=True)
class PackedPlan:
    """The structure of a packed batch, in host integers (no tensor values are read to make it).

    ``decode``: ``(token, row, blocks)`` of every one-token chunk past its prompt; ``prefill``:
    ``(first_token, num_tokens, row, blocks)`` of every other chunk (a prompt's, or a request's
    last token with its drafts); ``blocks``: how many entries of the row's block table its keys
    span after this step. ``sample_rows``: the rows whose logits are used. ``request_ids``: the
    request of each row, in row order (a wrapped module's slots are kept by request:
    ``genfn.models.module_packed``); empty when not known. ``prompt_lens``: each row's request's
    prompt length where its chunk lies within that prompt, else 0; empty when not known.
    """

    num_tokens: int
    decode: tuple[tuple[int, int, int], ...] = ()
    prefill: tuple[tuple[int, int, int, int], ...] = ()
    sample_rows: tuple[int, ...] = ()
    request_ids: tuple = ()
    prompt_lens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        covered = len(self.decode) + sum(n for _, n, _, _ in self.prefill)
        if covered > self.num_tokens:
            raise ValueError(f"the plan's chunks hold {covered} tokens, more than `num_tokens` ({self.num_tokens})")

    def rows_of_prompts_from(self, tokens: int) -> frozenset[int]:
        """The rows that hold a chunk (of one token or more) of a prompt of at least ``tokens`` tokens."""
        if not self.prompt_lens:
            return frozenset()
        return frozenset(row for _, count, row, _ in self.prefill if count and self.prompt_lens[row] >= tokens)


@dataclasses.dataclass(frozen=True)
class PlannedAttention:
    """The per-forward index tensors of a ``PackedPlan``, built once and used by every layer.

    ``decode``: ``(token_index [Rd], tables [Rd * w], mask [Rd, 1, 1, w * block_size])`` or
    ``None``; ``prefill``: ``(first_token, num_tokens, table [w], mask [n, w * block_size])`` per chunk.
    ``native_decode``: instead of ``decode``, where the native op reads the blocks in place:
    ``(token_index [Rd], tables [Rd, W], lengths [Rd])``, one row per token (the decode tokens
    and the tokens of short prefill chunks).
    """

    num_tokens: int
    decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    prefill: tuple[tuple[int, int, torch.Tensor, torch.Tensor], ...]
    native_decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    sliding_window: int | None = None


def _visible(key_positions: torch.Tensor, query_positions: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """``[Q, S]`` bool: key position ``s`` is seen by a query at ``query_positions[q]``."""
    keys, queries = key_positions.view(1, -1), query_positions.view(-1, 1)
    visible = keys <= queries
    if sliding_window is not None:
        visible = visible & (keys > queries - sliding_window)
    return visible


# Prefill chunks up to this many tokens go to the native op with the decode rows (see plan_attention).
NATIVE_PREFILL_TOKENS = 64


def plan_attention(plan: PackedPlan, block_tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                   sliding_window: int | None = None, native: bool | None = None,
                   native_chunk_tokens: int = NATIVE_PREFILL_TOKENS,
                   whole_prompt_tokens: int | None = None) -> PlannedAttention:
    """The index tensors and masks of ``plan`` (``block_tables [R, W]``, ``positions [T]`` of the batch).

    ``native``: the decode rows and prefill chunks of up to ``native_chunk_tokens`` go to the
    native paged op (``native_decode``: no mask, no gather); ``None``: where the native kernels
    are built and the tables are on the CPU. Longer chunks, and every chunk of a prompt of at
    least ``whole_prompt_tokens`` tokens (one the model's whole-prompt forward would run through
    the prefill kernel), gather their blocks for the native prefill kernel (where it takes them)
    or SDPA.
    """
    if native is None:
        native = block_tables.device.type == "cpu" and _kernels_built()
    device = block_tables.device
    decode = native_decode = None
    # Short prefill chunks join the native op's rows, one row per token (its own length): a chunk
    # of a few dozen tokens costs the op a few dozen short rows, while gathering its blocks and
    # building a mask for SDPA costs more than that chunk's attention itself.
    gathered_rows = frozenset() if whole_prompt_tokens is None else plan.rows_of_prompts_from(whole_prompt_tokens)
    short = [chunk for chunk in plan.prefill
             if native and chunk[1] <= native_chunk_tokens and chunk[2] not in gathered_rows]
    if native and (plan.decode or short):
        pairs = [(t, r) for t, r, _ in plan.decode]
        for first, count, row, _ in short:
            pairs += [(t, row) for t in range(first, first + count)]
        pairs.sort()  # token order: a plan covering every token reads q and fills the output as is
        tokens = torch.tensor([t for t, _ in pairs], dtype=torch.int64, device=device)
        rows = torch.tensor([r for _, r in pairs], dtype=torch.int64, device=device)
        native_decode = (tokens, block_tables.index_select(0, rows), positions.index_select(0, tokens) + 1)
    elif plan.decode:
        tokens = torch.tensor([t for t, _, _ in plan.decode], dtype=torch.int64, device=device)
        rows = torch.tensor([r for _, r, _ in plan.decode], dtype=torch.int64, device=device)
        width = max(b for _, _, b in plan.decode)
        tables = block_tables.index_select(0, rows)[:, :width].reshape(-1)
        span = torch.arange(width * block_size, device=device)
        mask = _visible(span, positions.index_select(0, tokens), sliding_window)
        decode = (tokens, tables, mask.view(len(plan.decode), 1, 1, -1))
    prefill = []
    for first, count, row, width in plan.prefill:
        if native and count <= native_chunk_tokens and row not in gathered_rows:
            continue
        span = torch.arange(width * block_size, device=device)
        mask = _visible(span, positions[first:first + count], sliding_window)
        prefill.append((first, count, block_tables[row, :width], mask))
    return PlannedAttention(plan.num_tokens, decode, tuple(prefill), native_decode, sliding_window)


def _gather_keys(blocks: torch.Tensor, table: torch.Tensor, rows: int) -> torch.Tensor:
    """``blocks [NB + 1, Hkv, bs, D]`` at ``table [rows * w]`` -> ``[rows, Hkv, w * bs, D]``."""
    picked = blocks.index_select(0, table)
    _, heads, size, dim = picked.shape
    return picked.view(rows, -1, heads, size, dim).transpose(1, 2).reshape(rows, heads, -1, dim)


def planned_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, planned: PlannedAttention,
                      scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """``paged_attention``'s result for the tokens of ``planned`` (``q [T, H, D]``; tokens outside the
    plan, the padding, get zeros), reading only the blocks each row's keys occupy. ``scale``: of the
    scores, ``head_dim ** -0.5`` when None; ``softcap`` as ``paged_attention``'s (the native op caps
    in place; the gathered rows and chunks then run ``_masked_attention``'s float32 path, not SDPA)."""
    num_tokens, num_heads, head_dim = q.shape
    scale = head_dim ** -0.5 if scale is None else scale
    keys, values = cache.keys[layer], cache.values[layer]
    kv_heads = keys.shape[1]
    if num_heads % kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of the cache's kv heads ({kv_heads})")
    groups = num_heads // kv_heads
    out = None
    if planned.native_decode is not None:
        tokens, tables, lengths = planned.native_decode
        rows = tokens.shape[0]
        qd = q if rows == num_tokens else q.index_select(0, tokens)
        if _native_ok(keys, qd) and head_dim % 16 == 0 and head_dim <= 128:  # the op's limits
            attn = _native_ops().paged_query_attention(qd.to(keys.dtype), keys, values, tables, lengths, scale,
                                                        planned.sliding_window or 0, softcap or 0.0).to(q.dtype)
        else:  # a cache the op does not take (dtype): the reference over the same tables
            attn = paged_attention(qd, cache, layer, tables, torch.arange(rows, device=q.device), lengths - 1,
                                   scale=scale, sliding_window=planned.sliding_window, softcap=softcap)
        if rows == num_tokens and not planned.prefill:
            return attn  # the plan lists chunks in token order: these are tokens 0 .. T - 1
        out = q.new_zeros(num_tokens, num_heads, head_dim).index_copy_(0, tokens, attn)
    elif planned.decode is not None:
        tokens, table, mask = planned.decode
        rows = tokens.shape[0]
        # One query per row: its ``groups`` heads that share a kv head are that head's queries.
        qd = q.index_select(0, tokens).view(rows, kv_heads, groups, head_dim)
        attn = _masked_attention(qd, _gather_keys(keys, table, rows).to(q.dtype),
                                 _gather_keys(values, table, rows).to(q.dtype), mask, scale, softcap)
        attn = attn.reshape(rows, num_heads, head_dim)
        if rows == num_tokens and not planned.prefill:
            return attn  # the plan lists chunks in token order: these are tokens 0 .. T - 1
        out = q.new_zeros(num_tokens, num_heads, head_dim).index_copy_(0, tokens, attn)
    if out is None:
        out = q.new_zeros(num_tokens, num_heads, head_dim)
    for first, count, table, mask in planned.prefill:
        qc = q[first:first + count].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        k = _gather_keys(keys, table, 1).to(q.dtype)
        v = _gather_keys(values, table, 1).to(q.dtype)
        attn = None
        if softcap is None and scale == head_dim ** -0.5:
            attn = _prefill_kernel(qc, k, v, mask)
        if attn is None:
            attn = _masked_attention(qc, k, v, mask, scale, softcap)
        out[first:first + count] = attn.squeeze(0).transpose(0, 1)
    return out


def _prefill_kernel(q, k, v, mask):
    from genfn.kernels import prefill_attention

    # At any number of queries: a chunk of a few tokens comes here as a piece of a long prompt.
    return prefill_attention(q, k, v, mask.view(1, 1, *mask.shape[-2:]), min_queries=1)


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                      softcap: float | None) -> torch.Tensor:
    """SDPA of ``q [..., H, n, D]`` over ``k``/``v [..., Hkv, s, D]`` (``H`` a multiple of ``Hkv``) under the
    boolean ``mask``; with ``softcap``, the same in float32 (float64 for float64) with capped scores."""
    groups = q.shape[-3] // k.shape[-3]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1, scale=scale)
    compute = torch.promote_types(q.dtype, torch.float32)
    k, v = k.repeat_interleave(groups, dim=-3).to(compute), v.repeat_interleave(groups, dim=-3).to(compute)
    scores = soft_capped((q.to(compute) @ k.transpose(-1, -2)) * scale, softcap)
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (weights @ v).to(q.dtype)
