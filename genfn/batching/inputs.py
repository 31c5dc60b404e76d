"""The index tensors one packed forward needs, built on the host from a ``ScheduledBatch``.

Shapes are static (``num_tokens``, ``num_rows``, ``table_width`` are the padded sizes the
forward is compiled for), so one compiled step serves every batch up to those sizes:

``input_ids, positions, request_index, slot_mapping [T]``: the chunks' tokens one after the
other; each token's position in its request, its row, and the cache slot its keys/values go to
(``-1`` for padding: the cache's sink block). ``block_tables [R, W]``: each row's blocks (the sink
block past its end). ``query_start [R + 1]``: where each row's tokens start (``cu_seqlens_q``);
``kv_lens [R]``: the positions each row attends after this step (``seqused_k``); ``logits_index
[R + E]``: the token whose logits are each row's, then ``E`` more tokens whose logits a step
needs (a speculative row's last token and drafts before its last one, in order; ``E`` is 0 unless
a chunk carries drafts, so a plain step is unchanged); ``samples [R]``: whether that row samples;
``prompt_lens [R]``: each row's request's prompt length (zeros when not given).
Padding tokens sit in row 0 at position 0 (finite, ignored attention); padding rows are empty.
"""

from __future__ import annotations

import torch

from collections.abc import Hashable, Mapping

from genfn.batching import blocks as B
from genfn.batching.requests import RequestState
from genfn.batching.scheduling import ScheduledBatch
from genfn.state.base import pytree_dataclass

__all__ = ["BatchInputs", "RowHistory", "build_batch_inputs", "build_row_history", "bucket", "num_draft_logits"]


@pytree_dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    request_index: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, -1 = padding
    block_tables: torch.Tensor  # [R, W] int64
    query_start: torch.Tensor  # [R + 1] int64
    kv_lens: torch.Tensor  # [R] int64
    logits_index: torch.Tensor  # [R + E] int64: one per row, then the drafted rows' earlier positions
    samples: torch.Tensor  # [R] bool
    prompt_lens: torch.Tensor | None = None  # [R] int64

    def __post_init__(self) -> None:
        # Zeros where a caller builds inputs without prompts (the engine's warmup batch of padding):
        # the leaves keep one structure, so a forward compiled at warmup serves the real batches.
        if self.prompt_lens is None:
            object.__setattr__(self, "prompt_lens", torch.zeros_like(self.kv_lens))


def bucket(size: int, minimum: int = 1) -> int:
    """The power of two at or above ``size`` (at least ``minimum``): a padded size, so that a
    few compiled shapes serve every batch."""
    padded = max(minimum, 1)
    while padded < size:
        padded *= 2
    return padded


def num_draft_logits(batch: ScheduledBatch) -> int:
    """``E``: the logits positions the batch's drafted chunks need besides one per row."""
    return sum(chunk.num_drafts for chunk in batch.chunks)


def build_batch_inputs(alloc: B.BlockAllocator, batch: ScheduledBatch, *, num_tokens: int | None = None,
                       num_rows: int | None = None, table_width: int | None = None,
                       device: torch.device | str | None = None, num_extra_logits: int | None = None) -> BatchInputs:
    """The forward's index tensors for ``batch``, whose blocks ``alloc`` (after ``schedule``) holds.

    Sizes left ``None`` are the batch's own (no padding); sizes smaller than the batch needs
    raise ``ValueError``. ``num_extra_logits``: ``E``, padded (the extra entries past the batch's
    drafts point at token 0).
    """
    chunks = batch.chunks
    size = alloc.block_size
    sink = alloc.num_blocks  # the paged cache's extra last block
    used_tokens = batch.num_tokens
    tables = [B.block_table(alloc, c.request_id) for c in chunks]
    used_width = max((len(t) for t in tables), default=1)
    num_tokens = used_tokens if num_tokens is None else num_tokens
    num_rows = max(len(chunks), 1) if num_rows is None else num_rows
    table_width = used_width if table_width is None else table_width
    used_extra = num_draft_logits(batch)
    num_extra_logits = used_extra if num_extra_logits is None else num_extra_logits
    for name, have, need in (("num_tokens", num_tokens, used_tokens), ("num_rows", num_rows, len(chunks)),
                             ("table_width", table_width, used_width), ("num_extra_logits", num_extra_logits,
                                                                        used_extra)):
        if have < need:
            raise ValueError(f"`{name}` ({have}) is smaller than the batch needs ({need})")
    if num_rows < 1:
        raise ValueError("`num_rows` must be >= 1")

    input_ids, positions, rows, slots = [], [], [], []
    starts, kv_lens, logits_index, samples, extra, prompt_lens = [0], [], [], [], [], []
    for row, (chunk, table) in enumerate(zip(chunks, tables)):
        for offset, token in enumerate(chunk.token_ids):
            position = chunk.start + offset
            input_ids.append(token)
            positions.append(position)
            rows.append(row)
            slots.append(table[position // size] * size + position % size)
        starts.append(len(input_ids))
        kv_lens.append(chunk.end)
        logits_index.append(len(input_ids) - 1)
        extra.extend(range(len(input_ids) - 1 - chunk.num_drafts, len(input_ids) - 1))
        samples.append(chunk.samples)
        prompt_lens.append(chunk.prompt_len)
    pad_tokens = num_tokens - len(input_ids)
    input_ids += [0] * pad_tokens
    positions += [0] * pad_tokens
    rows += [0] * pad_tokens
    slots += [-1] * pad_tokens
    pad_rows = num_rows - len(chunks)
    starts += [starts[-1]] * pad_rows
    kv_lens += [0] * pad_rows
    logits_index += [0] * pad_rows
    samples += [False] * pad_rows
    prompt_lens += [0] * pad_rows
    logits_index += extra + [0] * (num_extra_logits - len(extra))
    table_rows = [list(t) + [sink] * (table_width - len(t)) for t in tables]
    table_rows += [[sink] * table_width] * pad_rows

    def tensor(values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype, device=device)

    return BatchInputs(
        input_ids=tensor(input_ids),
        positions=tensor(positions),
        request_index=tensor(rows),
        slot_mapping=tensor(slots),
        block_tables=tensor(table_rows).view(num_rows, table_width),
        query_start=tensor(starts),
        kv_lens=tensor(kv_lens),
        logits_index=tensor(logits_index),
        samples=tensor(samples, torch.bool),
        prompt_lens=tensor(prompt_lens),
    )


@pytree_dataclass
class RowHistory:
    """Each row's ``input_ids`` for the logits processors (the per-row ``LogitsContext`` fields).

    ``tokens [R, N]``: row ``r``'s prompt then generated tokens in ``tokens[r, :cur_len[r]]`` (the
    rest is padding); ``cur_len [R]``; ``prompt_len [R]``: the length of the request's own prompt,
    which a recompute after preemption does not change, so ``cur_len - prompt_len`` counts the
    tokens generated (min_new_tokens, per-request noise steps) however the request was scheduled.
    """

    tokens: torch.Tensor  # [R, N] int64
    cur_len: torch.Tensor  # [R] int64
    prompt_len: torch.Tensor  # [R] int64


def build_row_history(requests: Mapping[Hashable, RequestState], batch: ScheduledBatch, *, max_len: int,
                      num_rows: int | None = None, pad_token_id: int = 0,
                      device: torch.device | str | None = None) -> RowHistory:
    """``RowHistory`` of the batch's rows (in chunk order) from the scheduler's ``requests`` after
    ``schedule``. A row's history is its tokens up to its chunk's end (its drafts left out);
    padding rows are empty."""
    num_rows = max(len(batch.chunks), 1) if num_rows is None else num_rows
    if num_rows < len(batch.chunks):
        raise ValueError(f"`num_rows` ({num_rows}) is smaller than the batch needs ({len(batch.chunks)})")
    tokens = torch.full((num_rows, max_len), pad_token_id, dtype=torch.int64)
    cur_len = torch.zeros(num_rows, dtype=torch.int64)
    prompt_len = torch.zeros(num_rows, dtype=torch.int64)
    for row, chunk in enumerate(batch.chunks):
        request = requests[chunk.request_id]
        end = chunk.end - chunk.num_drafts
        if end > max_len:
            raise ValueError(f"request {chunk.request_id!r} has {end} tokens, more than `max_len` ({max_len})")
        tokens[row, :end] = torch.tensor(request.token_ids[:end], dtype=torch.int64)
        cur_len[row] = end
        prompt_len[row] = len(request.prompt_ids)
    return RowHistory(tokens=tokens.to(device), cur_len=cur_len.to(device), prompt_len=prompt_len.to(device))
