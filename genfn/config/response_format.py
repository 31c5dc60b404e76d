"""``response_format``: what a structured-output request asks the output to match, checked and made
hashable (so a compiled grammar can be cached per (tokenizer, spec)).

Accepted shapes (OpenAI's ``response_format`` and vLLM's ``structured_outputs``)::

    None / {"type": "text"}                                    no constraint
    {"type": "json_object"}                                    any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}
    {"type": "json_schema", "schema": {...}}                   (the Responses API's flat form)
    {"type": "regex", "pattern": "..."}
    {"type": "grammar", "grammar": "...", "syntax": "lark" | "ebnf"}   (default syntax: lark)
    {"type": "choice", "choices": ["yes", "no"]}
    {"json": {...}} / {"regex": ...} / {"grammar": ...} / {"choice": [...]} / {"json_object": True}
    a pydantic model class (anything with ``model_json_schema()``)

Whether a schema, regex or grammar compiles is checked by the grammar engine
(``genfn.structured.compile``), which names the path at fault.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

__all__ = ["ConstraintSpec", "parse_response_format", "check_response_format", "per_row_formats",
           "CONSTRAINT_KINDS"]

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "lark", "ebnf", "choice")
_TYPES = ("text", "json_object", "json_schema", "regex", "grammar", "choice")
_VLLM_KEYS = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "choice": "choice",
              "json_object": "json_object"}


@dataclasses.dataclass(frozen=True)
class ConstraintSpec:
    """One constraint: ``kind`` (one of ``CONSTRAINT_KINDS``) and its canonical text (a JSON schema
    dumped compactly, key order kept, a regex, a grammar, or the JSON list of choices)."""

    kind: str
    text: str

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"ConstraintSpec.kind must be one of {CONSTRAINT_KINDS}, got {self.kind!r}")

    @property
    def schema(self) -> dict | None:
        return json.loads(self.text) if self.kind == "json_schema" else None

    @property
    def choices(self) -> list[str] | None:
        return json.loads(self.text) if self.kind == "choice" else None


def _fail(name: str, message: str) -> ValueError:
    return ValueError(f"{name}: {message}")


def _schema_text(schema: Any, where: str) -> str:
    if hasattr(schema, "model_json_schema") and callable(schema.model_json_schema):
        schema = schema.model_json_schema()
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, Mapping):
        raise _fail(where, f"a JSON schema must be a dict (or a pydantic model class), got {type(schema).__name__}")
    try:
        # Key order is kept: a schema's property order is the order the output writes them in.
        return json.dumps(schema, separators=(",", ":"))
    except (TypeError, ValueError) as error:
        raise _fail(where, f"the JSON schema is not JSON-serializable ({error})") from None


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(where, f"must be a non-empty string, got {value!r:.80}")
    return value


def _choices_text(choices: Any, where: str) -> str:
    if not isinstance(choices, (list, tuple)) or not choices:
        raise _fail(where, f"must be a non-empty list of strings, got {choices!r:.80}")
    for i, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice:
            raise _fail(f"{where}[{i}]", f"must be a non-empty string, got {choice!r:.80}")
    return json.dumps(list(choices))


def _from_vllm(value: Mapping, name: str) -> ConstraintSpec | None:
    present = [key for key in _VLLM_KEYS if value.get(key) not in (None, False)]
    if len(present) != 1:
        raise _fail(name, f"needs a 'type' (one of {list(_TYPES)}) or exactly one of {list(_VLLM_KEYS)}; "
                          f"got keys {sorted(value)}")
    key = present[0]
    if key == "json":
        text = value[key] if isinstance(value[key], str) else _schema_text(value[key], f"{name}['json']")
        if isinstance(value[key], str):
            try:
                text = _schema_text(json.loads(text), f"{name}['json']")
            except json.JSONDecodeError as error:
                raise _fail(f"{name}['json']", f"is not valid JSON ({error})") from None
        return ConstraintSpec("json_schema", text)
    if key == "json_object":
        return ConstraintSpec("json_object", "{}")
    if key == "regex":
        return ConstraintSpec("regex", _string(value[key], f"{name}['regex']"))
    if key == "choice":
        return ConstraintSpec("choice", _choices_text(value[key], f"{name}['choice']"))
    return ConstraintSpec("lark", _string(value[key], f"{name}['grammar']"))


def parse_response_format(value: Any, name: str = "response_format") -> ConstraintSpec | None:
    """``value`` as a :class:`ConstraintSpec`, or None for no constraint; a ``ValueError`` naming
    ``name`` and the key at fault otherwise."""
    if value is None or isinstance(value, ConstraintSpec):
        return value
    if isinstance(value, type) and hasattr(value, "model_json_schema"):
        return ConstraintSpec("json_schema", _schema_text(value, name))
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict such as {{'type': 'json_schema', 'json_schema': {{'schema': ...}}}}, "
                        f"a pydantic model class, or None; got {type(value).__name__}")
    kind = value.get("type")
    if kind is None:
        return _from_vllm(value, name)
    if kind not in _TYPES:
        raise _fail(f"{name}['type']", f"must be one of {list(_TYPES)}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_object", "{}")
    if kind == "json_schema":
        inner = value.get("json_schema")
        if inner is None:
            if "schema" not in value:
                raise _fail(name, "type 'json_schema' needs 'json_schema': {'name': ..., 'schema': {...}}")
            return ConstraintSpec("json_schema", _schema_text(value["schema"], f"{name}['schema']"))
        if not isinstance(inner, Mapping):
            raise _fail(f"{name}['json_schema']", f"must be a dict, got {type(inner).__name__}")
        if "schema" not in inner:
            # OpenAI makes `schema` optional: no schema means any JSON object.
            return ConstraintSpec("json_object", "{}")
        return ConstraintSpec("json_schema", _schema_text(inner["schema"], f"{name}['json_schema']['schema']"))
    if kind == "regex":
        return ConstraintSpec("regex", _string(value.get("pattern", value.get("regex")), f"{name}['pattern']"))
    if kind == "choice":
        return ConstraintSpec("choice", _choices_text(value.get("choices"), f"{name}['choices']"))
    syntax = value.get("syntax", "lark")
    if syntax not in ("lark", "ebnf", "gbnf"):
        raise _fail(f"{name}['syntax']", f"must be 'lark' or 'ebnf' (GBNF), got {syntax!r}")
    return ConstraintSpec("lark" if syntax == "lark" else "ebnf",
                          _string(value.get("grammar"), f"{name}['grammar']"))


def check_response_format(name: str, value: Any) -> None:
    """The GenerationConfig field check (shape only; the grammar engine checks the content): one
    value for every row, or a list with one per prompt (None for a free row)."""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            parse_response_format(item, f"`{name}`[{i}]")
        return
    parse_response_format(value, f"`{name}`")


def per_row_formats(value: Any, batch_size: int, repeat: int = 1) -> list[Any]:
    """``response_format`` as one value per row: a single value for all ``batch_size`` prompts, or
    a list with one per prompt; each repeated ``repeat`` times (beams, returned sequences)."""
    if isinstance(value, (list, tuple)):
        if len(value) != batch_size:
            raise ValueError(f"response_format has {len(value)} entries for {batch_size} prompts; give one value for "
                             "every prompt, or a single value for all")
        values = list(value)
    else:
        values = [value] * batch_size
    return [v for v in values for _ in range(repeat)]
