"""Structured outputs on the real SmolLM2: every constrained output parses and validates against
its JSON schema (24 schemas), regex outputs fully match, greedy and sampled, batch 1 and a batch
of 16 mixed rows in which the free rows keep exactly their unconstrained tokens."""

from __future__ import annotations

import json
import re

import pytest
import torch

import genfn
from genfn.bench.structured_schemas import REGEXES, SCHEMAS

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

# Seconds on a quiet machine; on a shared 2-core one whose OpenMP threads spin against other
# processes a test took up to 21 minutes (all four: 47), hence the generous per-test timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MAX_NEW = 96


def _prompt(tokenizer, what: str, kind: str = "JSON") -> list[int]:
    messages = [{"role": "user", "content": f"Give me {what}. Answer in {kind} only."}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def _texts(model, out, prompt_width: int) -> list[str]:
    return [model.tokenizer.decode(row[prompt_width:].tolist(), skip_special_tokens=True) for row in out]


def _check_json(text: str, schema: dict) -> None:
    value = json.loads(text)
    jsonschema.validate(value, schema)


def _batch(tokenizer, rows):
    """Left-padded ids and mask of ``rows`` (lists of token ids)."""
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_every_schema_in_one_batch(smollm2, do_sample):
    """All 24 schemas as the rows of one batch (each row its own schema)."""
    ids, mask = _batch(smollm2.tokenizer, [_prompt(smollm2.tokenizer, what) for what, _ in SCHEMAS])
    out = genfn.generate(smollm2, ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=do_sample, key=11,
                         response_format=[_json_format(schema) for _, schema in SCHEMAS])
    failures = []
    for (what, schema), text in zip(SCHEMAS, _texts(smollm2, out, ids.shape[1])):
        try:
            _check_json(text, schema)
        except Exception as error:  # collected so one run names every failing schema
            failures.append((what, text, repr(error)[:200]))
    assert not failures, failures


def test_batch_1_greedy_and_sampled(smollm2):
    for i, (what, schema) in enumerate(SCHEMAS[::8]):
        ids = torch.tensor([_prompt(smollm2.tokenizer, what)])
        for do_sample in (False, True):
            out = genfn.generate(smollm2, ids, max_new_tokens=MAX_NEW, do_sample=do_sample, key=i,
                                 response_format=_json_format(schema))
            _check_json(_texts(smollm2, out, ids.shape[1])[0], schema)
    for what, pattern in REGEXES:
        ids = torch.tensor([_prompt(smollm2.tokenizer, what, "plain text")])
        out = genfn.generate(smollm2, ids, max_new_tokens=MAX_NEW, response_format={"type": "regex", "pattern": pattern})
        text = _texts(smollm2, out, ids.shape[1])[0]
        assert re.fullmatch(pattern, text), (what, text)


def _mixed_batch(tokenizer):
    """16 rows: 10 JSON schemas, 3 regexes, 3 free rows (left padded)."""
    rows = []
    for what, schema in SCHEMAS[:10]:
        rows.append((_prompt(tokenizer, what), _json_format(schema), ("json", schema)))
    for what, pattern in REGEXES[:3]:
        rows.append((_prompt(tokenizer, what, "plain text"), {"type": "regex", "pattern": pattern}, ("regex", pattern)))
    for text in ("Write a haiku about the sea.", "The capital of France is", "Count to five:"):
        rows.append((tokenizer.encode(text, add_special_tokens=False), None, ("free", None)))
    ids, mask = _batch(tokenizer, [r[0] for r in rows])
    return ids, mask, [r[1] for r in rows], [r[2] for r in rows]


def _check_rows(texts, checks):
    for text, (kind, target) in zip(texts, checks):
        if kind == "json":
            _check_json(text, target)
        elif kind == "regex":
            assert re.fullmatch(target, text), (target, text)


def test_mixed_batch_of_16_keeps_free_rows_unchanged(smollm2):
    ids, mask, formats, checks = _mixed_batch(smollm2.tokenizer)
    settings = dict(attention_mask=mask, max_new_tokens=MAX_NEW)
    out = genfn.generate(smollm2, ids, response_format=formats, **settings)
    _check_rows(_texts(smollm2, out, ids.shape[1]), checks)
    free = [i for i, (kind, _) in enumerate(checks) if kind == "free"]
    plain = genfn.generate(smollm2, ids, **settings)
    width = min(out.shape[1], plain.shape[1])
    assert torch.equal(out[free, :width], plain[free, :width])
