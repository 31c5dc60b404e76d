"""The packed forward of a wrapped module (``genfn.from_module``): continuous batching for any
decoder-only model ``generate`` runs.

A wrapped module's attention reads its own cache layout, not genfn's paged key/value blocks, so
the paged cache of a wrapped model holds *token ids* (``PagedTokenStore``, one id per slot): the
scheduler's block tables, chunked prefill, preemption and prefix sharing work on its blocks
exactly as on key/value blocks. A forward writes the batch's tokens to their slots, then, for
each row that samples, gathers the row's tokens through its block table and runs the module over
them (a fresh static cache, as ``generate``'s prefill): each step recomputes each sampling row's
whole prefix, so a step costs O(length) forward tokens per row instead of one. It is the
correct path for every wrapped model; long requests want a family with a native packed forward
(``genfn.models.packed``), or a slot-per-row key/value cache the batch inserts into (not built).

Eager only (``COMPILES = False``): the rows' lengths pick the shapes, on the host.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from genfn.cache.base import CacheBase
from genfn.models import adapter
from genfn.state.base import pytree_dataclass, static_field
from genfn.kernels.invariant import refuse_outside_plain_llama

__all__ = ["COMPILES", "PagedTokenStore", "apply_packed", "init_packed_cache", "pack_params"]

COMPILES = False


@pytree_dataclass
class PagedTokenStore(CacheBase):
    tokens: torch.Tensor  # [num_blocks + 1, block_size] int64: the token id at each slot (the last block: the sink)
    dtype: Any = static_field()  # the module's activations' dtype, for the per-row static cache
    block_size: int = static_field()

    @property
    def num_blocks(self) -> int:
        """Blocks the allocator hands out (the sink block is not one of them)."""
        return self.tokens.shape[0] - 1


def init_packed_cache(spec: adapter.ModuleSpec, num_blocks: int, block_size: int, dtype=torch.float32,
                      device=None) -> PagedTokenStore:
    """A token store of ``num_blocks`` blocks (plus the sink) for a wrapped module."""
    return PagedTokenStore(torch.zeros(num_blocks + 1, block_size, dtype=torch.int64, device=device), dtype,
                           block_size)


def pack_params(params: Mapping[str, Any]) -> Mapping[str, Any]:
    """A wrapped module's params run as they are."""
    return params


def apply_packed(spec: adapter.ModuleSpec, params, inputs, cache: PagedTokenStore, plan=None
                 ) -> tuple[torch.Tensor, PagedTokenStore]:
    """``(logits [R + E, V] float32, cache)``: row ``r``'s logits are the module's at its chunk's
    last token, for the rows that sample (the others get zeros), then the logits at the ``E``
    extra tokens ``inputs.logits_index[R:]`` (a speculative row's earlier positions); the batch's
    tokens are written to their slots of ``cache`` (donated, written in place)."""
    refuse_outside_plain_llama("a wrapped module (genfn.from_module)")
    block_size = cache.block_size
    flat = cache.tokens.view(-1)
    sink_slot = cache.num_blocks * block_size
    slots = torch.where(inputs.slot_mapping < 0, torch.full_like(inputs.slot_mapping, sink_slot), inputs.slot_mapping)
    flat.index_copy_(0, slots, inputs.input_ids)
    num_rows = inputs.samples.shape[0]
    logits = torch.zeros(inputs.logits_index.shape[0], spec.vocab_size, dtype=torch.float32, device=flat.device)
    lengths = inputs.kv_lens.tolist()
    offsets = torch.arange(block_size, device=flat.device)
    earlier: dict[int, list[tuple[int, int]]] = {}  # row -> (logits entry, position) of its extra tokens
    extra = inputs.logits_index[num_rows:]
    if extra.numel():
        rows = inputs.request_index.index_select(0, extra).tolist()
        positions = inputs.positions.index_select(0, extra).tolist()
        for entry, (row, position) in enumerate(zip(rows, positions), start=num_rows):
            earlier.setdefault(row, []).append((entry, position))
    for row in inputs.samples.nonzero().flatten().tolist():
        length = lengths[row]
        table = inputs.block_tables[row, :-(-length // block_size)]
        tokens = flat[(table.unsqueeze(1) * block_size + offsets).reshape(-1)[:length]].unsqueeze(0)
        positions = torch.arange(length, device=flat.device).unsqueeze(0)
        row_cache = adapter.init_cache(spec, 1, length, dtype=cache.dtype, device=flat.device)
        keep = length - min((position for _, position in earlier.get(row, ())), default=length - 1)
        out, _ = adapter.apply(spec, params, tokens, positions, row_cache, torch.ones_like(tokens),
                               logits_to_keep=keep)
        logits[row] = out[0, -1]
        for entry, position in earlier.get(row, ()):
            logits[entry] = out[0, position - (length - out.shape[1])]
    return logits, cache
