"""The llguidance engine (genfn's default): JSON Schema, regex, Lark and GBNF grammars, choices.

llguidance computes masks lazily with an Earley parser over a token trie: no per-schema
precomputation, so compiling a schema costs about as much as parsing it, and a mask costs tens
of microseconds (measured in ``benchmarks/structured.py``). The wheel has no dependencies.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import llguidance
from llguidance import LLMatcher, LLTokenizer
from llguidance.gbnf_to_lark import gbnf_to_lark

from genfn.config.response_format import ConstraintSpec
from genfn.structured import Grammar, GrammarError

__all__ = ["tokenizer_tables", "compile_grammar", "VERSION"]

VERSION = getattr(llguidance, "__version__", "unknown")

# Compact JSON (", " and ": " between items, no free whitespace): what models write, and a bound on
# how long a valid answer can ramble.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclasses.dataclass(frozen=True)
class Tables:
    tokenizer: Any  # LLTokenizer
    vocab_size: int
    eos_token_id: int


def tokenizer_tables(tokenizer, vocab_size: int) -> Tables:
    """llguidance's view of a ``genfn.Tokenizer`` (its ``tokenizers`` JSON): built once per tokenizer."""
    backend = copy.copy(tokenizer.backend)
    backend.no_padding()
    backend.no_truncation()
    eos = tokenizer.eos_token_id
    return Tables(LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos), vocab_size,
                  -1 if eos is None else int(eos))


def _lark_for(spec: ConstraintSpec) -> str:
    if spec.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec.text, defaults=_JSON_OPTIONS)
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choices))
    if spec.kind == "ebnf":
        try:
            return LLMatcher.grammar_from_lark(gbnf_to_lark(spec.text))
        except Exception as error:  # the converter raises its own parse errors
            raise GrammarError(f"response_format['grammar'] (EBNF) has a syntax error: {error}") from None
    return LLMatcher.grammar_from_lark(spec.text)


_SUBSCHEMA_KEYS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else")


def _children(schema: Any, path: str):
    if not isinstance(schema, dict):
        return
    for key in _SUBSCHEMA_KEYS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield sub, f"{path}/{key}/{name}"
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield sub, f"{path}/{key}/{i}"
    for key in _SUBSCHEMA_ONE:
        if isinstance(schema.get(key), dict):
            yield schema[key], f"{path}/{key}"


def _path_at_fault(schema: Any, message: str, path: str = "#") -> str:
    """The deepest subschema that fails alone with the same message (a JSON pointer), else ``path``."""
    for sub, sub_path in _children(schema, path):
        try:
            error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(sub, defaults=_JSON_OPTIONS))
        except ValueError:
            continue
        if error == message:
            return _path_at_fault(sub, message, sub_path)
    return path


def _error(spec: ConstraintSpec, message: str) -> GrammarError:
    message = message.strip()
    if spec.kind == "json_schema":
        where = _path_at_fault(spec.schema, message)
        return GrammarError(f"response_format: the JSON schema is invalid at {where}: {message}")
    what = {"regex": "the regex", "lark": "the grammar (Lark)", "ebnf": "the grammar (EBNF)",
            "choice": "the choices", "json_object": "json_object"}[spec.kind]
    return GrammarError(f"response_format: {what} cannot be compiled: {message}")


def _start(grammar: Grammar) -> LLGuidanceMatcher:
    return LLGuidanceMatcher(LLMatcher(grammar.tables.tokenizer, grammar.compiled, log_level=0))


class LLGuidanceMatcher:
    """One request's parse state (see :mod:`genfn.structured` for the interface)."""

    def __init__(self, inner: LLMatcher):
        self.inner = inner

    def fill_bitmask(self, row) -> None:
        self.inner.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token: int) -> bool:
        # try_consume_tokens leaves the matcher as it was when the token does not fit.
        return self.inner.try_consume_tokens([int(token)]) == 1

    def accept_prefix(self, tokens: list[int]) -> int:
        return self.inner.try_consume_tokens([int(t) for t in tokens])

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.inner.rollback(int(num_tokens))

    def is_terminated(self) -> bool:
        return self.inner.is_stopped()

    def can_terminate(self) -> bool:
        return self.inner.is_accepting()

    def error(self) -> str:
        return self.inner.get_error()

    def fork(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.inner.deep_copy())


def compile_grammar(tables: Tables, spec: ConstraintSpec) -> Grammar:
    try:
        grammar = _lark_for(spec)
    except GrammarError:
        raise
    except ValueError as error:
        raise _error(spec, str(error)) from None
    message = LLMatcher.validate_grammar(grammar, tables.tokenizer)
    if message and not message.startswith("WARNING"):
        raise _error(spec, message)
    return Grammar(spec, "llguidance", tables, grammar, _start)
