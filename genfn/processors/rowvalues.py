"""Per-row processor values: turning numbers into ``[B]`` leaves, replacing one row, merging rows.

A processor's *kind* (its class and static fields) selects code; its *numbers* (temperature,
penalties, lengths, ...) are data. A processor built by hand holds transformers' Python values;
``per_row(B, device)`` turns every number into a ``[B]`` tensor leaf, so one compiled step serves
every value and batches whose rows differ. Each class names its per-row fields in ``row_values``,
with the dtype the arithmetic needs for exactness and the value that means "off" for a row.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from genfn.state.base import leaf_fields, static_fields

__all__ = ["RowValue", "to_row", "set_row", "evolve", "same_value", "check_same_kind", "cat_rows"]


@dataclasses.dataclass(frozen=True)
class RowValue:
    """How one field becomes a per-row leaf: its dtype, and the value a row gets when the kind is
    off for it (``None``: keep the template's value, for fields that are not a switch)."""

    dtype: torch.dtype
    off: Any
    none_as: Any = None  # the per-row value of a field left at None (None: it stays None, i.e. "read ctx")


def evolve(obj: Any, **changes: Any) -> Any:
    """``obj`` with fields replaced, without re-running validation (values may now be tensors)."""
    out = copy.copy(obj)
    for name, value in changes.items():
        object.__setattr__(out, name, value)
    return out


def to_row(value: Any, batch_size: int, dtype: torch.dtype, device: Any, name: str) -> torch.Tensor | None:
    """A Python number, a 0-d, ``[1]`` or ``[B]`` tensor as a ``[B]`` tensor of ``dtype``."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        t = value.to(dtype=dtype, device=device if device is not None else value.device)
        if t.dim() == 0:
            return t.expand(batch_size).clone()
        if t.dim() == 1 and t.shape[0] == batch_size:
            return t
        if t.dim() == 1 and t.shape[0] == 1:
            return t.expand(batch_size).clone()
        raise ValueError(f"per-row `{name}` must have shape [{batch_size}], got {tuple(t.shape)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a number or a [batch] tensor, got {type(value).__name__}")
    return torch.full((batch_size,), value, dtype=dtype, device=device)


def set_row(value: Any, row_value: Any, slot: int | torch.Tensor) -> Any:
    """``value`` (``[B, ...]``, or a tuple of them) with row ``slot`` taken from ``row_value[0]``.

    A ``torch.where`` against ``arange(B) == slot``: pure, and ``slot`` may be a tensor.
    """
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(set_row(v, r, slot) for v, r in zip(value, row_value))
    b = value.shape[0]
    selected = (torch.arange(b, device=value.device) == slot).reshape(b, *([1] * (value.dim() - 1)))
    return torch.where(selected, row_value.to(device=value.device, dtype=value.dtype), value)


def cat_rows(values: list[Any], name: str) -> Any:
    """Concatenate one-row values along the batch (``None`` only if every row has ``None``)."""
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise ValueError(f"`{name}` is set for some rows and not for others; give every row a value")
    if isinstance(values[0], tuple):
        return tuple(cat_rows([v[i] for v in values], name) for i in range(len(values[0])))
    return torch.cat([v.to(values[0].device) for v in values], dim=0)


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a is b or a == b


def check_same_kind(processors: list[Any], skip: tuple[str, ...] = ()) -> None:
    """Rows merged into one processor must agree on everything that is not a per-row value."""
    first = processors[0]
    cls = type(first)
    names = [n for n in (*static_fields(cls), *leaf_fields(cls)) if n not in cls.row_values and n not in skip]
    for other in processors[1:]:
        if type(other) is not cls:
            raise ValueError(f"cannot merge a {type(other).__name__} into a {cls.__name__} row")
        for name in names:
            a, b = getattr(first, name), getattr(other, name)
            if not same_value(a, b):
                raise ValueError(
                    f"the rows of a batch must share `{name}` of {cls.__name__} (it selects code or is a shared "
                    f"table); got {a!r} and {b!r}"
                )
