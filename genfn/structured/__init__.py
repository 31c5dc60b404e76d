"""Structured outputs: a grammar (JSON schema, regex, Lark/EBNF grammar, choice list) compiled
against a tokenizer, and the host-side matcher that says which tokens may come next.

One small interface over two engines (``llguidance``, the default, and ``xgrammar``)::

    grammar = compile(tokenizer, spec, vocab_size=model.vocab_size)   # cached per (tokenizer, spec)
    matcher = grammar.matcher()
    matcher.fill_bitmask(row)      # row: a [ceil(V / 32)] int32 CPU tensor; bit i set = token i allowed
    matcher.accept(token) -> bool  # False: the token breaks the grammar (the matcher is unchanged)
    matcher.rollback(n)            # undo the last n accepted tokens (rejected speculative drafts)
    matcher.is_terminated()        # the grammar is complete and admits nothing more but EOS
    matcher.can_terminate()        # EOS is allowed now
    matcher.fork()                 # an independent copy (beam search)
    matcher.error()                # "" unless the engine entered an error state

The matcher lives on the host; the mask it fills enters a pure decode step as a tensor
(:func:`genfn.processors.grammar.apply_token_bitmask`); :mod:`genfn.structured.rows` drives a batch of them.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Callable, Protocol

from genfn.config.response_format import ConstraintSpec, parse_response_format

__all__ = ["compile", "Grammar", "Matcher", "ENGINES", "DEFAULT_ENGINE", "available_engines", "GrammarError",
           "bitmask_width"]

ENGINES = ("llguidance", "xgrammar")
DEFAULT_ENGINE = "llguidance"


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled, or that no token sequence can match."""


class Matcher(Protocol):
    def fill_bitmask(self, row) -> None: ...

    def accept(self, token: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def is_terminated(self) -> bool: ...

    def can_terminate(self) -> bool: ...

    def error(self) -> str: ...

    def fork(self) -> "Matcher": ...


@dataclasses.dataclass(frozen=True)
class Grammar:
    """A compiled grammar: its spec, the engine's tokenizer tables (``vocab_size``, ``eos_token_id``:
    the token the engine's masks use for "end"), the engine's compiled form, and how a matcher is
    started from it."""

    spec: ConstraintSpec
    engine: str
    tables: Any
    compiled: Any
    start: Callable[["Grammar"], Matcher]

    @property
    def vocab_size(self) -> int:
        return self.tables.vocab_size

    @property
    def eos_token_id(self) -> int:
        return self.tables.eos_token_id

    def matcher(self) -> Matcher:
        return self.start(self)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return (vocab_size + 31) // 32


def available_engines() -> list[str]:
    """The engines installed here (``pip install genfn[structured]`` installs llguidance)."""
    import importlib.util

    return [name for name in ENGINES if importlib.util.find_spec(name) is not None]


def _backend(engine: str):
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    try:
        if engine == "llguidance":
            from genfn.structured import llguidance_engine as module
        else:
            from genfn.structured import xgrammar_engine as module
    except ImportError as error:
        raise ImportError(f"structured outputs with engine={engine!r} need the {engine} package: "
                          f"pip install 'genfn[structured]'" + (" xgrammar" if engine == "xgrammar" else "")
                          + f" ({error})") from None
    return module


# tokenizer -> {(engine, vocab_size, spec): Grammar}; the engine's tokenizer tables are cached
# the same way under (engine, vocab_size, None). Weak keys: a dropped tokenizer frees its grammars.
_CACHE: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_MAX_GRAMMARS_PER_TOKENIZER = 256


def _entries(tokenizer) -> dict:
    with _LOCK:
        return _CACHE.setdefault(tokenizer, {})


def compile(tokenizer, spec, *, vocab_size: int | None = None, engine: str | None = None) -> Grammar:
    """The grammar for ``spec`` (a ``response_format`` value or a ``ConstraintSpec``) over
    ``tokenizer`` (a ``genfn.Tokenizer``), with masks ``vocab_size`` wide (the model's logits; default
    the tokenizer's length). Cached per (tokenizer, engine, vocab_size, spec). A spec that cannot be
    compiled, or that no token sequence can satisfy, raises :class:`GrammarError` (a ValueError)."""
    parsed = parse_response_format(spec)
    if parsed is None:
        raise ValueError("compile needs a constraint; response_format {'type': 'text'} / None constrains nothing")
    engine = engine or DEFAULT_ENGINE
    backend = _backend(engine)
    vocab_size = int(vocab_size if vocab_size is not None else len(tokenizer))
    entries = _entries(tokenizer)
    key = (engine, vocab_size, parsed)
    grammar = entries.get(key)
    if grammar is not None:
        return grammar
    tables_key = (engine, vocab_size, None)
    tables = entries.get(tables_key)
    if tables is None:
        tables = entries.setdefault(tables_key, backend.tokenizer_tables(tokenizer, vocab_size))
    grammar = backend.compile_grammar(tables, parsed)
    _check_satisfiable(grammar)
    with _LOCK:
        if len(entries) > _MAX_GRAMMARS_PER_TOKENIZER:
            for old in [k for k in entries if k[2] is not None][: len(entries) // 2]:
                entries.pop(old, None)
        entries[key] = grammar
    return grammar


def _check_satisfiable(grammar: Grammar) -> None:
    """A grammar whose first mask allows nothing (a regex such as ``[]`` or ``a^b``) can never be
    satisfied: refuse it now rather than generate nothing."""
    import torch

    matcher = grammar.matcher()
    row = torch.zeros(bitmask_width(grammar.vocab_size), dtype=torch.int32)
    matcher.fill_bitmask(row)
    if matcher.error() or (not bool(row.any()) and not matcher.can_terminate()):
        raise GrammarError(f"response_format ({grammar.spec.kind}) can match no token sequence: "
                           f"{grammar.spec.text[:200]!r}")
