"""Copying the batching core's frozen host-side records (requests, allocator, scheduler state)."""

from __future__ import annotations

__all__ = ["replaced"]


def replaced(record, changes: dict):
    """A copy of the frozen dataclass ``record`` with ``changes``: ``dataclasses.replace`` without
    rerunning ``__init__`` (these records have no ``__post_init__``), as the scheduler makes
    thousands per step. Unknown field names raise ``TypeError``."""
    unknown = changes.keys() - record.__dataclass_fields__.keys()
    if unknown:
        raise TypeError(f"{type(record).__name__} has no field(s) {sorted(unknown)}")
    new = object.__new__(type(record))
    new.__dict__.update(record.__dict__)
    new.__dict__.update(changes)
    return new
