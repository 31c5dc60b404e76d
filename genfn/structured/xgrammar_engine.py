"""The xgrammar engine (optional): JSON Schema, regex, EBNF and Lark grammars, choices.

xgrammar precompiles, per grammar, which tokens each parser state accepts (adaptive token mask
cache), so compiling costs more and a mask less. Its wheel pulls transformers, triton and
apache-tvm-ffi, and importing it imports transformers (~5 s): genfn imports it only when asked
(``engine="xgrammar"``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import xgrammar as xgr

from genfn.config.response_format import ConstraintSpec
from genfn.structured import Grammar, GrammarError

__all__ = ["tokenizer_tables", "compile_grammar", "VERSION"]

VERSION = getattr(xgr, "__version__", "unknown")

@dataclasses.dataclass(frozen=True)
class Tables:
    compiler: Any  # xgr.GrammarCompiler (holds the TokenizerInfo)
    vocab_size: int
    eos_token_id: int


def tokenizer_tables(tokenizer, vocab_size: int) -> Tables:
    """xgrammar's TokenizerInfo for a ``genfn.Tokenizer``: its tokens in id order, and the vocabulary
    kind xgrammar detects from the ``tokenizers`` JSON (byte-level BPE, byte fallback, raw)."""
    vocab = tokenizer.get_vocab()
    encoded = [""] * max(len(tokenizer), max(vocab.values()) + 1)
    for token, index in vocab.items():
        encoded[index] = token
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
    eos = tokenizer.eos_token_id
    info = xgr.TokenizerInfo(encoded, vocab_type=metadata["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=None if eos is None else [int(eos)],
                             add_prefix_space=metadata["add_prefix_space"])
    return Tables(xgr.GrammarCompiler(info, cache_enabled=False), vocab_size, -1 if eos is None else int(eos))


def _start(grammar: Grammar) -> XGrammarMatcher:
    return XGrammarMatcher(xgr.GrammarMatcher(grammar.compiled))


class XGrammarMatcher:
    """One request's parse state (see :mod:`genfn.structured` for the interface)."""

    def __init__(self, inner):
        self.inner = inner

    def fill_bitmask(self, row) -> None:
        self.inner.fill_next_token_bitmask(row.unsqueeze(0))

    def accept(self, token: int) -> bool:
        return self.inner.accept_token(int(token))

    def accept_prefix(self, tokens: list[int]) -> int:
        for count, token in enumerate(tokens):
            if not self.inner.accept_token(int(token)):
                return count
        return len(tokens)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.inner.rollback(int(num_tokens))

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def can_terminate(self) -> bool:
        return self.inner.is_completed()

    def error(self) -> str:
        return ""

    def fork(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.inner.fork())


def compile_grammar(tables: Tables, spec: ConstraintSpec) -> Grammar:
    compiler = tables.compiler
    try:
        if spec.kind == "json_schema":
            compiled = compiler.compile_json_schema(spec.text, any_whitespace=False, separators=(", ", ": "))
        elif spec.kind == "json_object":
            compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                    separators=(", ", ": "))
        elif spec.kind == "regex":
            compiled = compiler.compile_regex(spec.text)
        elif spec.kind == "choice":
            compiled = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choices))
        elif spec.kind == "ebnf":
            compiled = compiler.compile_grammar(spec.text)
        else:
            compiled = compiler.compile_lark(spec.text) if hasattr(compiler, "compile_lark") else None
            if compiled is None:
                raise GrammarError("response_format: this xgrammar version has no Lark grammars; use syntax='ebnf'")
    except GrammarError:
        raise
    except Exception as error:  # xgrammar raises RuntimeError/ValueError with its parser's message
        raise GrammarError(f"response_format ({spec.kind}) cannot be compiled by xgrammar: "
                           f"{str(error).strip()[:500]}") from None
    return Grammar(spec, "xgrammar", tables, compiled, _start)
