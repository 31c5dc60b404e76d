"""The packed forward of a wrapped module (``genfn.from_module``): continuous batching over slots.

A wrapped module's attention reads its own cache layout, not genfn's paged key/value blocks, so a
wrapped model's continuous-batching cache (``SlotCache``) holds two things:

- a paged *token store* (one token id per paged slot): the scheduler's block tables, chunked
  prefill, preemption, prefix sharing and beam forks work on its blocks exactly as on key/value
  blocks, and it always holds every computed token of every running request;
- *slots*: a static key/value cache of the module's own layout (``adapter.init_cache``'s), one row
  per slot, as JetStream's ``insert`` into a decode state. A request's slot holds the keys and
  values of its positions ``0 ..`` at those very slots, so a decode step runs the module on one
  token per row against the rows' slots: O(1) forward tokens per row, not O(length).

Which slot a row uses is host bookkeeping in the cache value (``SlotTable``, a static field: no
state outside the cache): a request keeps the slot it got first (by its id, from
``PackedPlan.request_ids``) until another request needs one and it is the least recently used.
What a slot's keys and values are *worth* is checked by content, never assumed: ``held [S, T]``
records the token each slot position was computed from, and a row trusts its slot only up to the
longest common prefix of ``held`` and the row's own tokens (read from the token store through its
block table). So whatever happened between two steps — a preemption (the slot is kept: a resumed
request recomputes only what its slot lost), a beam fork (the row's history became its parent's),
rejected drafts (positions past the kept tokens mismatch), a request id reused, a slot taken by
another request — a row computes exactly the positions its slot does not hold, from the token
store; when another slot holds more of the row's prefix (the parent of a forked beam, a running
request with the same system prompt), those keys and values are copied from it first.

The module runs once per group of rows with the same number of tokens to compute (a decode step:
one call of ``R`` one-token rows), each row at its own positions through the adapter's per-row
mask, on a view of the rows' slots when they are consecutive (else on a gathered copy); a module whose rows must advance together (``ModuleSpec.rows_independent`` False) runs one
call per group of rows that also start at the same position. Positions past a slot's held tokens
are kept zero, so a masked read never meets a stale NaN.

Slots are allocated by the first forward that runs a row: ``R`` of them (the inputs' rows), as
long as the longest row so far (rounded up to a power of two, grown when a longer one comes) and
at most the block-table width in tokens. Eager only (``COMPILES = False``): the rows' lengths
pick the shapes, on the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any, Mapping

import torch

from genfn.cache.base import CacheBase
from genfn.cache.static import StaticCache
from genfn.kernels.invariant import refuse_without_invariant_forward
from genfn.models import adapter
from genfn.state.base import pytree_dataclass, static_field

__all__ = ["COMPILES", "SlotCache", "SlotTable", "apply_packed", "init_packed_cache", "pack_params"]

COMPILES = False

_NONE = -1  # a slot position holding no keys/values
_PAST_END = -2  # a row's history past its end (never equal to a held token)


@dataclasses.dataclass(frozen=True)
class SlotTable:
    """Who holds each slot (a request id, or None), how many leading positions hold keys/values
    (zeros after them), and the step each slot last ran in (the least recently used goes first)."""

    owners: tuple
    filled: tuple[int, ...]
    used: tuple[int, ...]
    clock: int = 0


@pytree_dataclass
class SlotCache(CacheBase):
    tokens: torch.Tensor  # [num_blocks + 1, block_size] int64: the token at each paged slot (last block: the sink)
    slot_keys: torch.Tensor | None = None  # [L, S, Hkv, T + 1, D]: adapter.init_cache's layout, one row per slot
    slot_values: torch.Tensor | None = None
    held: torch.Tensor | None = None  # [S, T] int64: the token each slot position was computed from (-1: none)
    dtype: Any = static_field(default=torch.float32)  # the module's activations' dtype
    block_size: int = static_field(default=16)
    table: SlotTable | None = static_field(default=None)

    @property
    def num_blocks(self) -> int:
        """Blocks the allocator hands out (the sink block is not one of them)."""
        return self.tokens.shape[0] - 1

    @property
    def num_slots(self) -> int:
        return 0 if self.held is None else self.held.shape[0]

    @property
    def slot_len(self) -> int:
        return 0 if self.held is None else self.held.shape[1]

    def copy_blocks(self, copies) -> "SlotCache":
        """Copy whole paged blocks, ``(source, target)`` pairs (a forked beam's partial block), in place."""
        if copies:
            source = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=self.tokens.device)
            target = torch.tensor([t for _, t in copies], dtype=torch.int64, device=self.tokens.device)
            self.tokens.index_copy_(0, target, self.tokens.index_select(0, source))
        return self

    def clear_blocks(self, blocks) -> "SlotCache":
        """Forget the tokens of ``blocks`` (in place). A slot's stale positions are zeroed when a
        row reuses it, so nothing of a failed request is read masked."""
        if blocks:
            self.tokens.index_fill_(0, torch.tensor(list(blocks), dtype=torch.int64, device=self.tokens.device), 0)
        return self


def init_packed_cache(spec: adapter.ModuleSpec, num_blocks: int, block_size: int, dtype=torch.float32,
                      device=None) -> SlotCache:
    """A token store of ``num_blocks`` blocks (plus the sink) for a wrapped module; its slots come
    with the first forward that runs a row (see the module docstring)."""
    return SlotCache(torch.zeros(num_blocks + 1, block_size, dtype=torch.int64, device=device), dtype=dtype,
                     block_size=block_size)


def pack_params(params: Mapping[str, Any]) -> Mapping[str, Any]:
    """A wrapped module's params run as they are."""
    return params


@dataclasses.dataclass
class _Row:
    """One chunk of the batch, in host integers: its row, its request, its positions ``start ..
    end``, whether it samples, its extra logits entries ``(entry, position)`` (drafts), and what
    the step decides: its slot and the first position it computes (``first``)."""

    index: int
    key: Hashable
    start: int
    end: int
    samples: bool
    extras: list
    slot: int = 0
    first: int = 0

    @property
    def needed(self) -> int:
        """The first position whose logits (or, not sampling, keys) the step must compute."""
        if self.extras:
            return min(position for _, position in self.extras)
        return self.end - 1 if self.samples else self.end


def _rows(inputs, plan) -> list[_Row]:
    """The batch's chunks (rows with tokens), read from the inputs in one host sync."""
    num_rows = inputs.samples.shape[0]
    extra = inputs.logits_index[num_rows:]
    host = torch.cat((inputs.query_start, inputs.kv_lens, inputs.samples.to(torch.int64),
                      inputs.request_index.index_select(0, extra), inputs.positions.index_select(0, extra))).tolist()
    starts, ends = host[:num_rows + 1], host[num_rows + 1:2 * num_rows + 1]
    samples = host[2 * num_rows + 1:3 * num_rows + 1]
    num_extra = extra.shape[0]
    extra_rows, extra_positions = host[3 * num_rows + 1:3 * num_rows + 1 + num_extra], host[3 * num_rows + 1 + num_extra:]
    ids = tuple(getattr(plan, "request_ids", ()) or ())
    rows = []
    for r in range(num_rows):
        count = starts[r + 1] - starts[r]
        if count <= 0:
            continue
        # Without the requests' ids (a forward called directly) a row is its index: still exact,
        # as slots are trusted by content only.
        key = ids[r] if r < len(ids) else ("row", r)
        extras = [(entry, position) for entry, (row, position) in enumerate(zip(extra_rows, extra_positions),
                                                                              start=num_rows) if row == r]
        rows.append(_Row(r, key, ends[r] - count, ends[r], bool(samples[r]), extras))
    return rows


def _assign(table: SlotTable, rows: list[_Row]) -> SlotTable:
    """Each row's slot: the one its request holds, else a free one, else the least recently used
    one no row of this batch holds (its request, if it comes back, recomputes what it lost)."""
    owners = list(table.owners)
    holder = {owner: slot for slot, owner in enumerate(owners) if owner is not None}
    taken = set()
    for row in rows:
        if row.key in holder:
            row.slot = holder[row.key]
            taken.add(row.slot)
    for row in rows:
        if row.key in holder:
            continue
        row.slot = min((s for s in range(len(owners)) if s not in taken),
                       key=lambda s: (owners[s] is not None, table.used[s], s))
        owners[row.slot] = row.key
        taken.add(row.slot)
    used = list(table.used)
    for row in rows:
        used[row.slot] = table.clock
    return SlotTable(tuple(owners), table.filled, tuple(used), table.clock + 1)


def _with_room(spec, cache: SlotCache, num_slots: int, length: int, most: int) -> SlotCache:
    """``cache`` with at least ``num_slots`` slots of at least ``length`` positions (a power of two,
    at most ``most``); what the slots held is kept."""
    have_slots, have_len = cache.num_slots, cache.slot_len
    if cache.held is not None and have_slots >= num_slots and have_len >= length:
        return cache
    size = 16
    while size < max(length, have_len):
        size *= 2
    size = max(min(size, most), length, have_len)
    num_slots = max(num_slots, have_slots)
    device = cache.tokens.device
    fresh = adapter.init_cache(spec, num_slots, size, dtype=cache.dtype, device=device)
    held = torch.full((num_slots, size), _NONE, dtype=torch.int64, device=device)
    table = cache.table or SlotTable((), (), ())
    if cache.held is not None:
        fresh.keys[:, :have_slots, :, :have_len + 1].copy_(cache.slot_keys)
        fresh.values[:, :have_slots, :, :have_len + 1].copy_(cache.slot_values)
        held[:have_slots, :have_len].copy_(cache.held)
    more = num_slots - len(table.owners)
    table = dataclasses.replace(table, owners=table.owners + (None,) * more, filled=table.filled + (0,) * more,
                                used=table.used + (0,) * more)
    return cache.replace(slot_keys=fresh.keys, slot_values=fresh.values, held=held, table=table)


def _histories(cache: SlotCache, inputs, rows: list[_Row], length: int) -> torch.Tensor:
    """``[rows, length]`` each row's tokens at positions ``0 .. end`` from the token store
    (``-2`` past its end)."""
    size = cache.block_size
    index = torch.tensor([row.index for row in rows], dtype=torch.int64, device=cache.tokens.device)
    positions = torch.arange(length, device=cache.tokens.device)
    tables = inputs.block_tables.index_select(0, index)[:, :-(-length // size)]
    slots = tables.gather(1, (positions // size).expand(len(rows), -1)) * size + positions % size
    history = cache.tokens.view(-1)[slots]
    ends = torch.tensor([row.end for row in rows], dtype=torch.int64, device=history.device)
    return torch.where(positions < ends.unsqueeze(1), history, _PAST_END)


def _common_prefix(history: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """Leading positions where ``history [..., N]`` equals ``held [..., N]``."""
    return (history == held).to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def _reuse(cache: SlotCache, rows: list[_Row], history: torch.Tensor) -> list[tuple[_Row, int, int, int]]:
    """Set each row's ``first`` position to compute: what its slot holds of its tokens, or more
    when another slot holds more (returned as copies ``(row, source slot, from, to)``)."""
    length = history.shape[1]
    slots = torch.tensor([row.slot for row in rows], dtype=torch.int64, device=history.device)
    own = _common_prefix(history, cache.held.index_select(0, slots)[:, :length]).tolist()
    short = [i for i, row in enumerate(rows) if own[i] < row.needed]
    copies = []
    if short:
        index = torch.tensor(short, dtype=torch.int64, device=history.device)
        every = _common_prefix(history.index_select(0, index).unsqueeze(1), cache.held[:, :length].unsqueeze(0))
        every[torch.arange(len(short), device=every.device), slots.index_select(0, index)] = -1  # not its own
        best, source = every.max(dim=1)
        for i, best, source in zip(short, best.tolist(), source.tolist()):
            row = rows[i]
            reach = min(best, row.needed)
            if reach > own[i]:
                copies.append((row, source, own[i], reach))
                own[i] = reach
    for i, row in enumerate(rows):
        row.first = min(own[i], row.needed)
    return copies


def _clear_from(cache: SlotCache, filled: list[int], slot: int, position: int) -> None:
    """Zero ``slot``'s positions ``position ..`` (held: none), in place; ``filled`` follows."""
    if filled[slot] > position:
        cache.slot_keys[:, slot, :, position:filled[slot]] = 0
        cache.slot_values[:, slot, :, position:filled[slot]] = 0
        cache.held[slot, position:filled[slot]] = _NONE
    filled[slot] = position


def _copy_and_clear(cache: SlotCache, rows: list[_Row], copies) -> list[int]:
    """Copy the prefixes ``copies`` names into their rows' slots (every source read before any
    write), then zero each computing row's slot from its first computed position on; returns the
    slots' filled lengths after that (``SlotTable.filled``).

    A slot's positions past a copied prefix are zeroed too, even when its row computes nothing
    (a chunk that does not sample, all of it copied): their keys and values were computed after
    the slot's old prefix, and a later row whose tokens happen to agree with what ``held`` says
    there would trust them."""
    filled = list(cache.table.filled)
    read = [(row, begin, end, cache.slot_keys[:, source, :, begin:end].clone(),
             cache.slot_values[:, source, :, begin:end].clone(), cache.held[source, begin:end].clone())
            for row, source, begin, end in copies]
    for row, begin, end, keys, values, held in read:
        cache.slot_keys[:, row.slot, :, begin:end] = keys
        cache.slot_values[:, row.slot, :, begin:end] = values
        cache.held[row.slot, begin:end] = held
        _clear_from(cache, filled, row.slot, end)
    for row in rows:
        if row.first < row.end and filled[row.slot] > row.first:
            _clear_from(cache, filled, row.slot, row.first)
    return filled


def _groups(spec, rows: list[_Row]) -> dict:
    """Rows that run in one module call: the same number of positions to compute (and, for a
    module whose rows advance together, the same first position)."""
    groups: dict = {}
    for row in rows:
        if row.first >= row.end:
            continue  # its slot already holds every position of its chunk, and it samples nothing
        key = (row.end - row.first,) if spec.rows_independent else (row.end - row.first, row.first)
        groups.setdefault(key, []).append(row)
    return groups


def _run_group(spec, params, cache: SlotCache, group: list[_Row], history: torch.Tensor, order: dict,
               logits: torch.Tensor) -> None:
    """One module call over ``group``'s rows against their slots; their new keys and values land in
    the slots, their logits in ``logits``. Rows whose slots are consecutive (a decode step of every
    running request, a chunk alone) run on a view of the slots, written in place; others on a
    gathered copy, whose new positions are written back."""
    device = history.device
    group = sorted(group, key=lambda row: row.slot)
    count = group[0].end - group[0].first
    width = max(row.end for row in group)
    low = group[0].slot
    consecutive = all(row.slot == low + b for b, row in enumerate(group))
    slots = torch.tensor([row.slot for row in group], dtype=torch.int64, device=device)
    first = torch.tensor([row.first for row in group], dtype=torch.int64, device=device)
    positions = first.unsqueeze(1) + torch.arange(count, device=device)  # [B, count]
    lines = torch.tensor([order[row.index] for row in group], dtype=torch.int64, device=device)
    tokens = history.index_select(0, lines).gather(1, positions)
    valid = torch.arange(width + 1, device=device) < first.unsqueeze(1)
    rows = slice(low, low + len(group)) if consecutive else slots
    view = StaticCache(keys=cache.slot_keys[:, rows, :, :width + 1], values=cache.slot_values[:, rows, :, :width + 1],
                       valid=valid, length=first.clone())
    keep = max(row.end - min((p for _, p in row.extras), default=row.end - 1) for row in group)
    out, view = adapter.apply(spec, params, tokens, positions, view, logits_to_keep=keep)
    if not consecutive:
        rows_of = torch.arange(len(group), device=device).unsqueeze(1)
        cache.slot_keys[:, slots.unsqueeze(1), :, positions] = view.keys[:, rows_of, :, positions]
        cache.slot_values[:, slots.unsqueeze(1), :, positions] = view.values[:, rows_of, :, positions]
    cache.held[slots.unsqueeze(1), positions] = tokens
    for b, row in enumerate(group):
        if row.samples:
            logits[row.index] = out[b, -1]
        for entry, position in row.extras:
            logits[entry] = out[b, position - (row.end - out.shape[1])]


def apply_packed(spec: adapter.ModuleSpec, params, inputs, cache: SlotCache, plan=None
                 ) -> tuple[torch.Tensor, SlotCache]:
    """``(logits [R + E, V] float32, cache)``: row ``r``'s logits are the module's at its chunk's
    last token, for the rows that sample (the others get zeros), then the logits at the ``E``
    extra tokens ``inputs.logits_index[R:]`` (a speculative row's earlier positions). The batch's
    tokens go to the token store, their keys and values to their rows' slots (``cache`` is donated,
    written in place). ``plan.request_ids`` keys the slots (see the module docstring)."""
    refuse_without_invariant_forward("a wrapped module (genfn.from_module)")
    flat = cache.tokens.view(-1)
    sink_slot = cache.num_blocks * cache.block_size
    slots = torch.where(inputs.slot_mapping < 0, torch.full_like(inputs.slot_mapping, sink_slot), inputs.slot_mapping)
    flat.index_copy_(0, slots, inputs.input_ids)
    logits = torch.zeros(inputs.logits_index.shape[0], spec.vocab_size, dtype=torch.float32, device=flat.device)
    rows = _rows(inputs, plan)
    if not rows:
        return logits, cache
    num_rows, width = inputs.block_tables.shape
    length = max(row.end for row in rows)
    cache = _with_room(spec, cache, num_rows, length, width * cache.block_size)
    table = _assign(cache.table, rows)
    cache = cache.replace(table=table)
    history = _histories(cache, inputs, rows, length)
    filled = _copy_and_clear(cache, rows, _reuse(cache, rows, history))
    order = {row.index: i for i, row in enumerate(rows)}
    for group in _groups(spec, rows).values():
        _run_group(spec, params, cache, group, history, order, logits)
        for row in group:
            filled[row.slot] = row.end
    return logits, cache.replace(table=dataclasses.replace(table, filled=tuple(filled)))
