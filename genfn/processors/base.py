"""What every logits processor shares: the calling convention and masked reads of the buffer.

A processor is a frozen value with ``__call__(logits, ctx) -> logits``: ``logits`` is ``[B, V]``
float32 and ``ctx`` a :class:`~genfn.processors.context.LogitsContext`. A *stateful* processor
(SynthID) instead has ``init_state(batch_size, device)`` and ``apply(logits, ctx, state) ->
(logits, state)``, so its memory lives in the decoding state, not in the object.

The helpers below read ``ctx.tokens`` without ever slicing by ``cur_len``: garbage columns are
replaced by a sentinel (usually ``V``, one past the vocabulary) so that scatters land in a spare
column that is dropped afterwards. That keeps every shape static inside a compiled step. Every
length is per row (``[B]``), so rows of one batch may stand at different positions.

Numbers are per-row values (see :mod:`genfn.processors.rowvalues`): ``ProcessorBase.per_row``
turns them into ``[B]`` leaves, ``with_row`` replaces one row, ``merge_rows`` builds a batch
processor from one processor (or ``None``: the kind is off) per row.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

from genfn.processors.context import LogitsContext
from genfn.processors.rowvalues import RowValue, cat_rows, check_same_kind, evolve, set_row, to_row
from genfn.state.base import leaf_fields

__all__ = [
    "LogitsProcessor",
    "StatefulLogitsProcessor",
    "ProcessorBase",
    "filled_tokens",
    "tail_tokens",
    "token_set_mask",
    "vocab_mask",
    "as_id_list",
    "check_vocab",
    "per_row_column",
    "accepts_transformers_arguments",
    "uses_keywords",
    "takes_device",
]


@runtime_checkable
class LogitsProcessor(Protocol):
    """``processor(logits, ctx) -> logits``: pure, shape preserving."""

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor: ...


@runtime_checkable
class StatefulLogitsProcessor(Protocol):
    """A processor that carries memory across steps in an explicit state pytree."""

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> Any: ...

    def apply(self, logits: torch.Tensor, ctx: LogitsContext, state: Any) -> tuple[torch.Tensor, Any]: ...


class ProcessorBase:
    """Mixin with the class-level facts the chain needs about a processor, and its row methods.

    ``compile_safe``: the processor traces under ``torch.compile(fullgraph=True)`` (no host sync,
    no data-dependent shapes). ``stateful``: it needs ``init_state``/``apply`` instead of ``__call__``.
    ``row_values``: the fields that are per-row numbers (dtype, and the value meaning "off").
    """

    compile_safe: ClassVar[bool] = True
    stateful: ClassVar[bool] = False
    row_values: ClassVar[dict[str, RowValue]] = {}

    @property
    def has_row_off(self) -> bool:
        """Whether a row can switch this kind off through its values (else it needs a row mask)."""
        return any(rv.off is not None for rv in self.row_values.values())

    def per_row(self, batch_size: int, device: Any = None) -> Any:
        """This processor with every per-row number a ``[batch_size]`` tensor leaf on ``device``
        (constant tables move to ``device`` too)."""
        changes = {}
        for name in leaf_fields(type(self)):
            value = getattr(self, name)
            if name in self.row_values:
                rv = self.row_values[name]
                value = rv.none_as if value is None else value
                changes[name] = to_row(value, batch_size, rv.dtype, device, name)
            elif device is not None:
                changes[name] = _to_device(value, device)
        return evolve(self, **changes)

    def off_row(self) -> Any:
        """This processor with every switch set to its "off" value (a row that does not use it)."""
        return evolve(self, **{n: rv.off for n, rv in self.row_values.items() if rv.off is not None})

    def first_row(self) -> Any:
        """A one-row processor holding row 0 of this one's per-row values (a template for a row)."""
        return evolve(self, **{n: _row0(getattr(self, n)) for n in self.row_values})

    def with_row(self, slot: int | torch.Tensor, row: Any) -> Any:
        """Pure: this per-row processor with row ``slot`` replaced by the one row of ``row``.

        Shared tables and static fields stay; ``row`` must be of the same kind (checked here, in
        Python, so a mismatch never reaches a compiled step).
        """
        if not self.row_values:
            return self
        check_same_kind([self, row], skip=self._row_tables())
        changes = {}
        for name, rv in self.row_values.items():
            value, row_value = getattr(self, name), getattr(row, name)
            if row_value is None:
                row_value = rv.none_as
            if value is None and row_value is None:
                continue
            if value is None or row_value is None:
                raise ValueError(f"`{name}` of {type(self).__name__} is set for the batch or the row, not both")
            if not isinstance(row_value, (torch.Tensor, tuple)):
                row_value = to_row(row_value, 1, rv.dtype, None, name)
            changes[name] = set_row(value, row_value, slot)
        return evolve(self, **changes)

    @classmethod
    def merge_rows(cls, entries: list[Any], device: Any = None, like: Any = None) -> Any:
        """One processor for a batch whose row ``b`` uses ``entries[b]`` (``None``: off for that row).

        ``like``: the batch processor the result must be compatible with (its tables), or ``None``.
        The rows must agree on everything but their per-row values.
        """
        present = [e for e in entries if e is not None]
        check_same_kind(present if like is None else [like, *present], skip=())
        template = present[0] if present else like.first_row()
        if not template.row_values:
            return template.per_row(len(entries), device)
        rows = [(e if e is not None else template.off_row()).per_row(1, device) for e in entries]
        merged = {n: cat_rows([getattr(r, n) for r in rows], n) for n in cls.row_values}
        return evolve(template.per_row(len(entries), device), **merged)

    def _row_tables(self) -> tuple[str, ...]:
        """Leaf names that are per-row tables checked by ``with_row`` itself (none by default)."""
        return ()


def _row0(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() >= 1:
        return value[:1]
    if isinstance(value, tuple):
        return tuple(_row0(v) for v in value)
    return value


def _to_device(value: Any, device: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    return value


def per_row_column(value: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """A number stays a number; a ``[B]`` per-row value becomes a ``[B, 1]`` column of ``dtype``
    (so it broadcasts against ``[B, V]`` logits)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).reshape(-1, 1)
    return value


def filled_tokens(ctx: LogitsContext, fill: int, start: torch.Tensor | int | None = None) -> torch.Tensor:
    """``[B, N]`` tokens with every column outside ``[start, cur_len)`` replaced by ``fill``.

    ``start`` may be an int, a 0-d tensor, or a ``[B]`` tensor (per-row start, e.g. left padding).
    """
    n = ctx.tokens.shape[1]
    pos = torch.arange(n, device=ctx.tokens.device).unsqueeze(0)
    keep = ctx.filled_mask()
    if start is not None:
        if isinstance(start, torch.Tensor):
            keep = keep & (pos >= start.to(pos.device).reshape(-1, 1))
        else:
            keep = keep & (pos >= start)
    return torch.where(keep, ctx.tokens, torch.full_like(ctx.tokens, fill))


def tail_tokens(ctx: LogitsContext, length: int) -> torch.Tensor:
    """``[B, length]`` the last ``length`` filled tokens of each row (``input_ids[b, -length:]``).

    When ``cur_len[b] < length`` the leading entries are clamped reads of column 0 and
    meaningless: callers guard with ``ctx.row_cur_len() >= length``.
    """
    n = ctx.tokens.shape[1]
    idx = ctx.row_cur_len().unsqueeze(1) - length + torch.arange(length, device=ctx.tokens.device)
    return ctx.tokens.gather(1, idx.clamp(min=0, max=n - 1))


def token_set_mask(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, V]`` bool: which vocabulary entries appear in each row of ``ids``.

    Entries ``>= vocab_size`` (the sentinel) fall into a spare column that is dropped.
    """
    b = ids.shape[0]
    mask = torch.zeros((b, vocab_size + 1), dtype=torch.bool, device=ids.device)
    mask = mask.scatter(1, ids.clamp(max=vocab_size), True)
    return mask[:, :vocab_size]


def vocab_mask(ids: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[V]`` bool: ``isin(arange(V), ids)``."""
    return torch.isin(torch.arange(vocab_size, device=device), ids.to(device))


def as_id_list(value: Any, name: str = "token ids") -> tuple[int, ...]:
    """Normalize an int / list / tensor of token ids into a tuple of ints (a static value)."""
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist()
    if isinstance(value, int):
        value = [value]
    if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in value):
        raise ValueError(f"`{name}` has to be a list of non-negative integers, but is {list(value)}")
    out = tuple(int(v) for v in value)
    if any(v < 0 for v in out):
        raise ValueError(f"`{name}` has to be a list of non-negative integers, but is {list(out)}")
    return out


def check_vocab(ids: Any, vocab_size: int | None, name: str) -> None:
    """``ValueError`` naming ``name`` when a token id is outside ``[0, vocab_size)``."""
    if vocab_size is None:
        return
    flat = [int(v) for v in _flatten_ids(ids)]
    bad = sorted({v for v in flat if v < 0 or v >= vocab_size})
    if bad:
        raise ValueError(f"`{name}` holds token ids outside the vocabulary [0, {vocab_size}): {bad}")


def _flatten_ids(ids: Any):
    if isinstance(ids, torch.Tensor):
        yield from ids.reshape(-1).tolist()
    elif isinstance(ids, (list, tuple)):
        for v in ids:
            yield from _flatten_ids(v)
    elif ids is not None:
        yield ids


def accepts_transformers_arguments(is_transformers_call: Callable[[tuple, dict], bool],
                                   build: Callable[..., Any],
                                   readback: Callable[..., dict] | None = None):
    """Class decorator (outside ``@pytree_dataclass``): the processor also takes transformers'
    constructor arguments. ``is_transformers_call(args, kwargs)`` tells the two forms apart;
    ``build(cls, *args, **kwargs)`` makes the instance the genfn way (``create``/``from_config``);
    ``readback(*args, **kwargs)`` gives the public attributes transformers' object would expose
    (``sequence_bias``, ``bad_word_ids``...), set on the instance as built. The dataclass form
    (fields, what ``replace`` and the pytree machinery use) is unchanged."""
    def wrap(cls):
        field_init = cls.__init__
        field_names = [f.name for f in dataclasses.fields(cls) if f.init]

        field_signature = inspect.signature(field_init)

        def binds_fields(args: tuple, kwargs: dict) -> bool:
            try:
                field_signature.bind(None, *args, **kwargs)
            except TypeError:
                return False
            return True

        def __init__(self, *args, **kwargs):
            if not is_transformers_call(args, kwargs) and binds_fields(args, kwargs):
                field_init(self, *args, **kwargs)
                return
            built = build(cls, *args, **kwargs)
            for name in field_names:
                object.__setattr__(self, name, getattr(built, name))
            for name, value in (readback(*args, **kwargs) if readback is not None else {}).items():
                object.__setattr__(self, name, value)

        __init__.__doc__ = field_init.__doc__
        cls.__init__ = __init__
        return cls
    return wrap


def uses_keywords(*names: str, first_type: type | tuple[type, ...] | None = None):
    """An ``is_transformers_call`` predicate: a keyword among ``names``, or a first positional
    argument of ``first_type``."""
    def check(args: tuple, kwargs: dict) -> bool:
        if any(name in kwargs for name in names):
            return True
        return first_type is not None and bool(args) and isinstance(args[0], first_type)
    return check


def _built_without_device(cls, *args, device: Any = None, **kwargs):
    if device is not None:
        torch.device(device)  # a device name torch does not know raises here, as transformers' constructor would
    return cls(*args, **kwargs)


def takes_device(cls):
    """Class decorator (outside ``@pytree_dataclass``): the constructor also takes transformers'
    ``device=`` keyword. It is checked, not kept: genfn's numbers are Python values until
    ``per_row(B, device)`` places them, on the device the step runs on."""
    return accepts_transformers_arguments(uses_keywords("device"), _built_without_device)(cls)
