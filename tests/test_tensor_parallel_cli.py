"""``genfn batch --tp 2`` and ``genfn chat --tp 2`` as subprocesses, each spawning its second rank:
rank 0 reads the input (a file, standard input) and hands it to the other rank, writes OUTPUT or
prints alone, and the results are one process's."""

from __future__ import annotations

import json

import pytest

from cli_support import CHAT_TEMPLATE, build_tiny_model, run_cli

pytest.importorskip("transformers")

REQUESTS = [{"id": "a", "prompt": "The capital of France is", "max_tokens": 6},
            {"id": "b", "prompt": "Say hi", "max_tokens": 4},
            {"id": "chat", "messages": [{"role": "user", "content": "Say hi to everyone"}], "max_tokens": 5},
            {"id": "sampled", "prompt": "Paris", "max_tokens": 5, "temperature": 0.9, "seed": 3}]
CHAT_LINES = "Say hi\nto everyone\n/reset\nParis\n/exit\nnever read\n"


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tp_cli"), chat_template=CHAT_TEMPLATE))


def _results(path) -> dict:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_batch_tp_writes_one_process_results_once(chat_dir, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    one, two, piped = tmp_path / "one.jsonl", tmp_path / "two.jsonl", tmp_path / "piped.jsonl"
    result = run_cli("batch", str(source), str(one), "--model", chat_dir, "-q")
    assert result.returncode == 0, result.stderr
    result = run_cli("batch", str(source), str(two), "--model", chat_dir, "-q", "--tp", "2")
    assert result.returncode == 0, result.stderr
    assert len(two.read_text().splitlines()) == len(REQUESTS)  # rank 0 alone wrote, each result once
    assert _results(two) == _results(one)
    # the input from standard input: rank 0 reads it, rank 1 gets it from rank 0
    result = run_cli("batch", "-", str(piped), "--model", chat_dir, "-q", "--tp", "2",
                     stdin=source.read_text())
    assert result.returncode == 0, result.stderr
    assert _results(piped) == _results(one)
    # resuming: every id is done, on every rank's word from rank 0
    result = run_cli("batch", str(source), str(two), "--model", chat_dir, "--tp", "2")
    assert result.returncode == 0 and "nothing to do" in result.stderr, result.stderr
    assert len(two.read_text().splitlines()) == len(REQUESTS)


def test_batch_tp_refuses_a_bad_line_on_every_rank(chat_dir, tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps(REQUESTS[0]) + "\n{not json\n")
    result = run_cli("batch", str(source), str(tmp_path / "out.jsonl"), "--model", chat_dir, "-q", "--tp", "2")
    assert result.returncode == 2, result.stderr
    assert "input line 2 is not valid JSON" in result.stderr.splitlines()[-1]
    assert not (tmp_path / "out.jsonl").exists()


def test_chat_tp_replies_as_one_process(chat_dir):
    flags = ("chat", "--model", chat_dir, "--max-new-tokens", "4", "-q")
    one = run_cli(*flags, stdin=CHAT_LINES)
    assert one.returncode == 0, one.stderr
    two = run_cli(*flags, "--tp", "2", stdin=CHAT_LINES)
    assert two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and two.stdout.count("\n") >= 3  # three replies, printed by rank 0 alone
    assert one.stderr == "genfn: conversation forgotten\n"
    assert two.stderr.count("genfn: conversation forgotten\n") == 1  # rank 1 answers nothing
