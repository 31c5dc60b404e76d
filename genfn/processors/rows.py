"""One batch chain from per-row chains: merge processors kind by kind, masking rows where needed.

Each row of a batch may come with its own chain (its own request settings). The batch chain holds
every kind any row uses, in the order the rows' chains agree on (transformers' order for chains
built from configs); each kind's numbers are per-row values, and a row that lacks a kind gets
that kind's "off" values. A kind that has no "off" value (inf/nan removal, renormalization, a
user's callable) is wrapped in :class:`RowSelect`, whose ``active [B]`` mask keeps the incoming
logits of the rows that do not use it.
"""

from __future__ import annotations

from typing import Any

import torch

from genfn.processors.base import ProcessorBase
from genfn.processors.rowvalues import evolve, set_row, to_row
from genfn.state.base import pytree_dataclass

__all__ = ["RowSelect", "merge_processor_rows", "processor_kind"]


@pytree_dataclass
class RowSelect(ProcessorBase):
    """``processor`` on the rows where ``active``, the incoming logits elsewhere."""

    processor: Any
    active: torch.Tensor  # [B] bool

    @property
    def compile_safe(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.processor, "compile_safe", True))

    def __call__(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        out = self.processor(logits, ctx)
        return torch.where(self.active.to(logits.device).reshape(-1, 1), out, logits)

    def per_row(self, batch_size: int, device: Any = None) -> RowSelect:
        inner = self.processor.per_row(batch_size, device) if hasattr(self.processor, "per_row") else self.processor
        return RowSelect(inner, to_row(self.active, batch_size, torch.bool, device, "active"))

    def off_row(self) -> RowSelect:
        return evolve(self, active=False)

    def with_row(self, slot, row) -> RowSelect:
        inner_row, active = (row.processor, row.active) if isinstance(row, RowSelect) else (row, True)
        if not isinstance(active, torch.Tensor):
            active = to_row(active, 1, torch.bool, None, "active")
        inner = self.processor.with_row(slot, inner_row) if hasattr(self.processor, "with_row") else self.processor
        return RowSelect(inner, set_row(self.active, active.reshape(-1)[:1], slot))


def processor_kind(p: Any) -> Any:
    """What identifies a processor's kind across rows: its class (an external callable: itself)."""
    if isinstance(p, RowSelect):
        return processor_kind(p.processor)
    wrapped = getattr(p, "wrapped", None)
    if wrapped is not None:
        return ("external", id(wrapped))
    return type(p)


def _keyed(processors) -> list[tuple[Any, Any]]:
    """``((kind, occurrence), processor)`` so a chain may hold two processors of one kind."""
    seen: dict[Any, int] = {}
    out = []
    for p in processors:
        kind = processor_kind(p)
        out.append(((kind, seen.get(kind, 0)), p))
        seen[kind] = seen.get(kind, 0) + 1
    return out


def _merged_order(rows: list[list[Any]]) -> list[Any]:
    """Every key of every row, keeping each row's order (``ValueError`` when rows disagree).

    A topological order of the rows' "comes before" relations: rows holding different subsets
    of the kinds (one a penalty and a warper, another an n-gram ban) merge whatever order they
    come in; ties keep the order of first appearance.
    """
    first_seen: dict[Any, int] = {}
    after: dict[Any, set] = {}
    for keys in rows:
        for key in keys:
            first_seen.setdefault(key, len(first_seen))
            after.setdefault(key, set())
        for earlier, later in zip(keys, keys[1:]):
            after[earlier].add(later)
    waiting_on = {key: 0 for key in first_seen}
    for successors in after.values():
        for key in successors:
            waiting_on[key] += 1
    order: list[Any] = []
    ready = sorted((k for k, n in waiting_on.items() if n == 0), key=first_seen.__getitem__)
    while ready:
        key = ready.pop(0)
        order.append(key)
        for successor in after[key]:
            waiting_on[successor] -= 1
            if waiting_on[successor] == 0:
                ready.append(successor)
        ready.sort(key=first_seen.__getitem__)
    if len(order) < len(first_seen):
        stuck = next(k for k, n in waiting_on.items() if n > 0)
        raise ValueError("the rows' processor chains order their processors differently; "
                         f"cannot merge {stuck[0]!r} into one batch chain")
    return order


def _name(kind: Any) -> str:
    return kind.__name__ if isinstance(kind, type) else repr(kind)


def merge_processor_rows(rows: list[Any], device: Any = None, like: Any = None) -> tuple:
    """The processors of one batch chain whose row ``b`` runs ``rows[b]`` (a sequence of processors).

    ``like``: a batch chain (sequence of processors) the result must match kind for kind, so that
    its rows can be swapped in with ``with_row``; ``None`` builds the union of the rows' kinds.
    """
    keyed = [dict(_keyed(r)) for r in rows]
    if like is not None:
        like_keyed = dict(_keyed(like))
        order = list(like_keyed)
        for row in keyed:
            extra = [k for k in row if k not in like_keyed]
            if extra:
                raise ValueError(f"a row uses {[_name(k[0]) for k in extra]}, which the batch chain does not hold")
    else:
        like_keyed = {}
        order = _merged_order([list(r) for r in keyed])
    merged = []
    for key in order:
        entries = [row.get(key) for row in keyed]
        like_p = like_keyed.get(key)
        merged.append(_merge_kind(key[0], entries, device, like_p))
    return tuple(merged)


def _merge_kind(kind: Any, entries: list[Any], device: Any, like_p: Any) -> Any:
    present = [e for e in entries if e is not None]
    like_inner = like_p.processor if isinstance(like_p, RowSelect) else like_p
    if not present:  # only with like: no row uses this kind, every row is off
        present = [like_inner]
        entries = [None] * len(entries)
    inner = [e.processor if isinstance(e, RowSelect) else e for e in entries]
    if any(e is not None for e in inner):
        template = next(e for e in inner if e is not None)
    else:
        template = like_inner.first_row() if hasattr(like_inner, "first_row") else like_inner
    if getattr(template, "stateful", False) and (None in inner):
        raise ValueError(f"{_name(kind)} keeps state across steps: every row of the batch must use it (or none)")
    has_off = bool(getattr(template, "has_row_off", False))
    needs_mask = isinstance(like_p, RowSelect) or (None in inner and not has_off) or any(
        isinstance(e, RowSelect) for e in entries)
    merge = getattr(type(template), "merge_rows", None)
    if merge is None:  # a user's genfn-style processor without row support: rows must share it
        if any(e is not template for e in inner if e is not None):
            raise ValueError(f"{_name(kind)} has no per-row support; every row must share the same instance")
        body = template
    elif needs_mask:
        body = merge([template if e is None else e for e in inner], device, like_inner)
    else:
        body = merge(inner, device, like_inner)
    if not needs_mask:
        return body
    active = []
    for e in entries:
        if isinstance(e, RowSelect):
            active.append(e.active.reshape(-1)[:1].to(torch.bool).cpu())
        else:
            active.append(torch.tensor([e is not None]))
    return RowSelect(body, torch.cat(active).to(device))

