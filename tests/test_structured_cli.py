"""``genfn generate --json-schema FILE / --regex / --grammar FILE`` on a tiny random model."""

from __future__ import annotations

import json
import re
import sys
import os

import pytest

pytest.importorskip("llguidance")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cli_support import build_tiny_model  # noqa: E402
from genfn import cli  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_structured"))


def _run(capsys, *args) -> dict:
    assert cli.main(["generate", "The capital of", "--json", "--quiet", "--max-new-tokens", "30", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_regex_schema_and_grammar_flags(tiny_model_dir, tmp_path, capsys):
    model = ["--model", str(tiny_model_dir)]
    assert re.fullmatch(r"[0-9]{3}", _run(capsys, *model, "--regex", "[0-9]{3}")["text"])
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    assert 1 <= json.loads(_run(capsys, *model, "--json-schema", str(tmp_path / "schema.json"))["text"])["n"] <= 9
    (tmp_path / "yes_no.lark").write_text('start: "yes" | "no"\n')
    assert _run(capsys, *model, "--grammar", str(tmp_path / "yes_no.lark"))["text"] in ("yes", "no")
    (tmp_path / "ab.gbnf").write_text('root ::= "a" "b"\n')
    assert _run(capsys, *model, "--grammar", str(tmp_path / "ab.gbnf"))["text"] == "ab"


def test_bad_constraints_are_one_line_errors(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    assert cli.main(["generate", "x", "--model", str(tiny_model_dir), "--json-schema", str(tmp_path / "bad.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert cli.main(["generate", "x", "--model", str(tiny_model_dir), "--regex", "(ab"]) == 2
    assert "regex cannot be compiled" in capsys.readouterr().err


def test_batch_jsonl_response_format(tiny_model_dir, tmp_path, capsys):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"id": "digits", "prompt": "The capital of", "max_tokens": 12,
              "response_format": {"type": "regex", "pattern": "[0-9]{4}"}},
             {"id": "choice", "prompt": "Say", "max_tokens": 12,
              "response_format": {"type": "choice", "choices": ["hi", "everyone"]}},
             {"id": "free", "prompt": "Say hi", "max_tokens": 4}]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert cli.main(["batch", str(source), str(out), "--model", str(tiny_model_dir), "--quiet"]) == 0
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert re.fullmatch("[0-9]{4}", rows["digits"]["text"])
    assert rows["choice"]["text"] in ("hi", "everyone")
    source.write_text(json.dumps({"prompt": "x", "response_format": {"type": "regex"}}) + "\n")
    assert cli.main(["batch", str(source), str(tmp_path / "o2.jsonl"), "--model", str(tiny_model_dir)]) == 2
    assert "input line 1" in capsys.readouterr().err
