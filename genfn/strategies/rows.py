"""Requests joining a running batch: ``prefill`` a request on its own, then ``insert`` its rows.

As in JetStream, the two halves of a request's start are separate pure steps:

* ``prefill(model, request) -> prefix``: the request's prompt run through the model, its first
  token chosen, in a decode state of the request's rows only (for greedy/sampling this is the
  strategy's ``init``);
* ``insert(prefix, state, rows) -> state``: the running batch with rows ``rows`` replaced by the
  prefix's rows: tokens, lengths, positions, limits, keys, KV cache rows and the processors'
  per-row values. The other rows are untouched, so a row's tokens never depend on when it joined
  or who it runs beside.

Rows of a running batch are at different lengths; that is what the per-row ``cur_len``,
``positions`` and cache fill pointers are for.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as torch_pytree

from genfn.state.decode import DecodeState

__all__ = ["insert", "insert_rows"]

# Leaves of a DecodeState that hold one entry per row along dim 0.
_ROW_FIELDS = ("tokens", "cur_len", "prompt_len", "max_length", "positions", "done", "keys", "nonfinite",
               "scores", "logits")


def insert_rows(batch_tree, rows: torch.Tensor, row_tree, batch_size: int, what: str):
    """``batch_tree`` with rows ``rows`` of every per-row leaf replaced by ``row_tree``'s.

    The two trees must have the same structure and static values. A tensor leaf whose first
    dimension is the batch is per-row; any other leaf is shared by all rows (a constant table)
    and must be equal in both.
    """
    batch_leaves, batch_def = torch_pytree.tree_flatten(batch_tree)
    row_leaves, row_def = torch_pytree.tree_flatten(row_tree)
    if batch_def != row_def:
        raise ValueError(f"cannot insert: the request's {what} differ in kind from the running batch's "
                         f"({row_def} vs {batch_def}); requests that share a batch need the same kinds of settings")
    merged = []
    for big, small in zip(batch_leaves, row_leaves):
        if isinstance(big, torch.Tensor) and big.dim() and big.shape[0] == batch_size and (
                small.shape[0] == rows.shape[0] and big.shape[1:] == small.shape[1:]):
            merged.append(big.index_copy(0, rows.to(big.device), small.to(big.device, big.dtype)))
        elif isinstance(big, torch.Tensor):
            if big.shape != small.shape or not torch.equal(big, small.to(big.device)):
                raise ValueError(f"cannot insert: a shared table of the {what} differs between the request and the "
                                 f"running batch")
            merged.append(big)
        else:
            if big != small:
                raise ValueError(f"cannot insert: the request's {what} have a different setting ({small!r} vs {big!r})")
            merged.append(big)
    return torch_pytree.tree_unflatten(merged, batch_def)


def insert(prefix: DecodeState, state: DecodeState, rows) -> DecodeState:
    """``state`` with rows ``rows`` (an int or a list) replaced by ``prefix``'s rows.

    ``prefix`` comes from ``prefill`` (``genfn.strategies.sample.init``) with the same static
    settings and ``max_cache_len`` as ``state``; eager (it runs between steps, not inside one).
    """
    index = torch.as_tensor(rows, dtype=torch.int64, device=state.tokens.device).reshape(-1)
    if index.shape[0] != prefix.batch_size:
        raise ValueError(f"insert got {index.shape[0]} target rows for a prefix of {prefix.batch_size} rows")
    if bool(((index < 0) | (index >= state.batch_size)).any()) or index.unique().shape[0] != index.shape[0]:
        raise ValueError(f"insert rows must be distinct rows of the batch [0, {state.batch_size}); got {index.tolist()}")
    if prefix.options != state.options:
        raise ValueError(f"cannot insert: the request's decoding options {prefix.options} differ from the running "
                         f"batch's {state.options}")
    if prefix.max_cache_len != state.max_cache_len:
        raise ValueError(f"cannot insert: the prefix has max_cache_len {prefix.max_cache_len}, the batch "
                         f"{state.max_cache_len}; prefill with the batch's max_cache_len")
    if state.attentions is not None or state.hidden_states is not None:
        raise ValueError("insert does not support output_attentions / output_hidden_states")
    if (prefix.keys is None) != (state.keys is None):
        raise ValueError("cannot insert: one of the request and the running batch samples and the other does not")
    changes = {}
    for name in _ROW_FIELDS:
        big, small = getattr(state, name), getattr(prefix, name)
        if big is not None:
            changes[name] = big.index_copy(0, index, small.to(big.device, big.dtype))
    changes["cache"] = state.cache.with_rows(index, prefix.cache)
    batch = state.batch_size
    if state.processors is not None and index.shape[0] == 1 and hasattr(state.processors, "with_row"):
        # The chain knows which of its leaves are per-row and which are tables shared by the batch.
        if len(prefix.processors) != len(state.processors):
            raise ValueError("cannot insert: the request's logits processors differ in kind from the running batch's")
        changes["processors"] = state.processors.with_row(index[0], prefix.processors)
    else:
        changes["processors"] = insert_rows(state.processors, index, prefix.processors, batch, "logits processors")
    changes["processor_state"] = insert_rows(state.processor_state, index, prefix.processor_state, batch,
                                             "processor states")
    changes["stop_strings"] = insert_rows(state.stop_strings, index, prefix.stop_strings, batch, "stop strings")
    if state.guidance is not None:
        guidance = state.guidance
        changes["guidance"] = guidance.replace(
            cache=guidance.cache.with_rows(index, prefix.guidance.cache),
            positions=guidance.positions.index_copy(0, index, prefix.guidance.positions))
    return state.replace(**changes)
