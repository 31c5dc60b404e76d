"""`genfn chat` (a REPL whose history is rendered through the chat template each turn) and
`genfn batch` (JSON lines through continuous batching, resumable, bad lines named by number)."""

from __future__ import annotations

import io
import json

import pytest

import genfn
from cli_support import CHAT_TEMPLATE, build_tiny_model, run_cli
from genfn import cli


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_chat"), chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def chat_model(chat_dir):
    return genfn.load(chat_dir)


@pytest.fixture
def prompts_seen(monkeypatch):
    """The text of every prompt genfn.generate is called with (the call still runs)."""
    seen = []
    real_generate = genfn.generate

    def recording_generate(model, input_ids, **kwargs):
        seen.append(model.tokenizer.decode(input_ids[0].tolist()))
        return real_generate(model, input_ids, **kwargs)

    monkeypatch.setattr(genfn, "generate", recording_generate)
    return seen


def _chat(monkeypatch, capsys, lines: str, *flags) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    code = cli.main(["chat", *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---- chat ----------------------------------------------------------------------------------------

def test_chat_keeps_the_conversation_and_resets_it(chat_dir, prompts_seen, monkeypatch, capsys):
    code, out, err = _chat(monkeypatch, capsys, "Say hi\n\nto everyone\n/reset\nParis\n/exit\nnever read\n",
                           "--model", str(chat_dir), "--max-new-tokens", "4", "--system", "Be brief.", "-q")
    assert code == 0 and len(prompts_seen) == 3, (err, prompts_seen)
    system = "<|im_start|>system\nBe brief.<|im_end|>\n"
    first, second, third = prompts_seen
    assert first == f"{system}<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
    # The second turn renders the whole conversation: the first question, the model's reply, then the new one.
    assert second.startswith(f"{system}<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n")
    assert second.endswith("<|im_end|>\n<|im_start|>user\nto everyone<|im_end|>\n<|im_start|>assistant\n")
    reply = second[len(first):-len("<|im_end|>\n<|im_start|>user\nto everyone<|im_end|>\n<|im_start|>assistant\n")]
    assert reply and reply in out
    # After /reset only the system message is left.
    assert third == f"{system}<|im_start|>user\nParis<|im_end|>\n<|im_start|>assistant\n"
    assert "genfn: conversation forgotten" in err


def test_chat_ends_cleanly_at_end_of_input_and_names_unknown_commands(chat_dir, prompts_seen, monkeypatch, capsys):
    code, out, err = _chat(monkeypatch, capsys, "/frobnicate\nSay hi", "--model", str(chat_dir),
                           "--max-new-tokens", "3")
    assert code == 0 and len(prompts_seen) == 1  # the last line has no newline: still a turn, then EOF
    assert "unknown command '/frobnicate'" in err and "/reset" in err
    assert any(line.startswith("genfn: ") and " tok" in line for line in err.splitlines())  # each turn's summary


def test_chat_without_a_template_is_a_user_error(tmp_path, capsys, monkeypatch):
    plain = build_tiny_model(tmp_path)
    capsys.readouterr()
    code, out, err = _chat(monkeypatch, capsys, "hi\n", "--model", str(plain), "-q")
    assert code == 2 and err.startswith("genfn: error: ") and "no chat template" in err and "--chat" not in err


def test_chat_as_a_subprocess_with_piped_lines(chat_dir):
    result = run_cli("chat", "--model", str(chat_dir), "--max-new-tokens", "3", "-q",
                     stdin="Say hi\n/reset\nParis\n/exit\n")
    assert result.returncode == 0, result.stderr
    assert result.stderr == "genfn: conversation forgotten\n"
    assert result.stdout.count("\n") >= 2 and result.stdout.strip()


# ---- batch ---------------------------------------------------------------------------------------

def _clean_stop_text(model, prompt: str, max_new_tokens: int) -> tuple[str, int]:
    """A stop text from the greedy continuation: the first later token that decodes to plain
    letters (random weights also produce bytes of broken characters), and its index."""
    ids = model.tokenizer([prompt])["input_ids"]
    tokens = genfn.generate(model, ids, max_new_tokens=max_new_tokens)[0, ids.shape[1]:].tolist()
    pieces = [model.tokenizer.decode([t]) for t in tokens]
    at = next(i for i, piece in enumerate(pieces) if i > 0 and len(piece.strip()) >= 2 and piece.isascii()
              and piece.strip().isalnum())
    return pieces[at].strip(), at


def _inputs(tmp_path, stop_text: str):
    records = [
        {"id": "a", "prompt": "The capital of France is", "max_tokens": 6},
        {"id": 7, "prompt": "Say hi", "max_tokens": 3},
        {"prompt": "Paris is", "max_tokens": 5},  # known as line-3
        {"id": "chat", "messages": [{"role": "user", "content": "Say hi to everyone"}], "max_tokens": 4},
        {"id": "sampled", "prompt": "The capital", "temperature": 0.8, "seed": 5, "max_tokens": 4},
        {"id": "stop", "prompt": "Say hi to", "stop": [stop_text], "max_tokens": 12},
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path, records


def _outputs(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_batch_writes_every_request_and_resumes(chat_dir, chat_model, tmp_path, capsys):
    stop_text, stop_at = _clean_stop_text(chat_model, "Say hi to", 12)
    source, records = _inputs(tmp_path, stop_text)
    out = tmp_path / "out.jsonl"
    args = ["batch", str(source), str(out), "--model", str(chat_dir)]
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert "requests" in err and "6 requests" in err  # the progress bar and the summary
    first = _outputs(out)
    assert sorted(r["id"] for r in first) == sorted(["a", "7", "line-3", "chat", "sampled", "stop"])
    by_id = {r["id"]: r for r in first}
    tok = chat_model.tokenizer
    for record in records[:3]:  # greedy: continuous batching gives each request generate's tokens
        ids = tok([record["prompt"]])["input_ids"]
        expected = genfn.generate(chat_model, ids, max_new_tokens=record["max_tokens"])[0, ids.shape[1]:].tolist()
        row = by_id[str(record.get("id", "line-3"))]
        assert row["tokens"] == expected and row["text"] == tok.decode(expected, skip_special_tokens=True)
        assert row["finish_reason"] == ("length" if len(expected) == record["max_tokens"] else "stop")
    chat_ids = tok.apply_chat_template(records[3]["messages"], add_generation_prompt=True, return_tensors="pt")
    expected = genfn.generate(chat_model, chat_ids, max_new_tokens=4)[0, chat_ids.shape[1]:].tolist()
    assert by_id["chat"]["tokens"] == expected
    stopped = by_id["stop"]
    assert stopped["text"].endswith(stop_text) and stopped["finish_reason"] == "stop"
    assert len(stopped["tokens"]) <= stop_at + 1

    # Cut the output to two whole lines and half of a third (a run killed while writing), rerun.
    lines = out.read_text(encoding="utf-8").splitlines(keepends=True)
    out.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2], encoding="utf-8")
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert "resuming: 2 of 6 requests are already in" in err
    again = _outputs(out)
    assert sorted(r["id"] for r in again) == sorted(r["id"] for r in first)  # each id exactly once
    assert {r["id"]: r for r in again} == by_id  # the same results (greedy, and the seeded sample)
    assert cli.main(args) == 0 and "nothing to do" in capsys.readouterr().err


@pytest.mark.parametrize("lines, words", [
    (['{"prompt": "hi"}', '{"prompt": "hi"', '{"prompt": "x"}'], ["input line 2", "not valid JSON"]),
    (['{"prompt": "hi", "colour": 3}'], ["input line 1", "unknown field", "colour"]),
    (['{"prompt": "hi"}', '', '{"id": 1}'], ["input line 3", "'prompt'", "'messages'"]),
    (['{"prompt": "hi", "max_tokens": -1}'], ["input line 1", "max_tokens", "positive"]),
    (['{"prompt": "hi", "max_tokens": "ten"}'], ["input line 1", "max_tokens", "integer"]),
    (['{"id": "x", "prompt": "a"}', '{"id": "x", "prompt": "b"}'], ["input line 2", "'x'", "line 1"]),
    (['[1, 2]'], ["input line 1", "JSON object"]),
    (['{"messages": "hi"}'], ["input line 1", "messages"]),
    ([''], ["no requests"]),
])
def test_batch_bad_lines_name_the_line(lines, words, tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    assert cli.main(["batch", str(source), str(tmp_path / "out.jsonl"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("genfn: error: "), err
    for word in words:
        assert word in err, (word, err)
    assert not (tmp_path / "out.jsonl").exists()


def test_batch_missing_input_file(tmp_path, capsys):
    assert cli.main(["batch", str(tmp_path / "none.jsonl"), str(tmp_path / "out.jsonl")]) == 2
    assert "input file not found" in capsys.readouterr().err


def test_bad_settings_refuse_the_file_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from genfn.cli import batch

    monkeypatch.setattr(batch, "load_model", lambda *_: pytest.fail("the model must not load for a bad file"))
    for line, words in (('{"prompt": "hi", "temperature": -1}', ["input line 2", "'temperature'", ">= 0.0"]),
                        ('{"prompt": "hi", "top_p": 1.5}', ["input line 2", "'top_p'"]),
                        ('{"prompt": "hi", "top_k": -4, "do_sample": true}', ["input line 2", "'top_k'"]),
                        ('{"prompt": "hi", "repetition_penalty": 0}', ["input line 2", "'repetition_penalty'"])):
        source = tmp_path / "in.jsonl"
        source.write_text('{"prompt": "fine"}\n' + line + "\n")
        assert cli.main(["batch", str(source), str(tmp_path / "out.jsonl"), "-q"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and all(word in err for word in words), err


def test_batch_skip_bad_runs_the_good_lines_in_order_and_lists_the_bad(chat_dir, tmp_path, capsys):
    lines = ['{"id": "a", "prompt": "The capital of France is", "max_tokens": 9}',
             '{"id": "b", "prompt": "hi", "temperature": -1}',
             '{"id": "c", "prompt": "Say", "max_tokens": 1}',
             'not json',
             '{"id": "d", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}',
             '{"id": "e", "prompt": "Paris", "max_tokens": 2}']
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["batch", str(source), str(out), "--model", str(chat_dir), "--ordered", "--skip-bad"]
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "skipped: input line 2" in err and "skipped: input line 4" in err and "2 bad input lines skipped" in err
    assert [r["id"] for r in _outputs(out)] == ["a", "c", "d", "e"]  # input order, though "a" finishes last
    assert cli.main(args) == 1  # a rerun has nothing left but still reports the bad lines
    err = capsys.readouterr().err
    assert "nothing to do" in err and "2 bad input lines skipped" in err
    assert [r["id"] for r in _outputs(out)] == ["a", "c", "d", "e"]
    assert cli.main(["batch", str(source), str(tmp_path / "other.jsonl"), "--model", str(chat_dir)]) == 2
    assert "input line 2" in capsys.readouterr().err  # without --skip-bad the file is refused


def test_ordered_writer_waits_for_earlier_results_and_skips_failures(tmp_path):
    from genfn.cli.batch import ResultWriter

    path = tmp_path / "out.jsonl"
    with open(path, "ab") as f:
        writer = ResultWriter(f, ["a", "b", "c", "d"])
        writer.add("c", {"id": "c"})
        writer.add("b", {"id": "b"})
        assert path.read_text() == ""
        writer.add("a", {"id": "a"})
        assert [r["id"] for r in _outputs(path)] == ["a", "b", "c"]
        writer.fail("d")
        assert writer.next == 4


def test_sigkill_mid_run_then_rerun_keeps_every_result_exactly_once(chat_dir, tmp_path):
    """``genfn batch`` killed with SIGKILL while it writes: the file holds whole lines (at most a
    last one cut short), and the rerun ends with every request's result exactly once, the ones
    written before the kill unchanged."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from cli_support import REPO, WAIT

    count = 48
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Say hi {i}", "max_tokens": 40}) + "\n"
                              for i in range(count)))
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "genfn.cli", "batch", str(source), str(out), "--model", str(chat_dir),
               "--max-requests", "1", "-q"]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + WAIT
        while not (out.exists() and out.read_bytes().count(b"\n") >= 3):
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "no results were written"
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
        process.wait(WAIT)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(WAIT)
    data = out.read_bytes()
    whole = data[:data.rfind(b"\n") + 1]
    before = [json.loads(line) for line in whole.decode().splitlines()]  # every whole line parses
    assert 3 <= len(before) < count, "the run must be killed part way"
    assert len({r["id"] for r in before}) == len(before)
    rerun = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=WAIT)
    assert rerun.returncode == 0, rerun.stderr
    after = _outputs(out)
    assert sorted(r["id"] for r in after) == sorted(f"r{i}" for i in range(count))
    assert after[:len(before)] == before


@pytest.mark.parametrize("flags, expected", [
    ([], {"do_sample": True, "temperature": 0.7, "top_p": 0.95, "top_k": 50}),  # the model sets none: chat defaults
    (["--sampling-defaults", "temperature=0.3"], {"do_sample": True, "temperature": 0.3, "top_p": 0.95, "top_k": 50}),
    (["--sampling-defaults", "none"], {"do_sample": False}),
    (["--temperature", "0"], {"do_sample": False}),
    (["--top-k", "3"], {"do_sample": True, "temperature": 0.7, "top_p": 0.95, "top_k": 3}),
])
def test_chat_samples_with_the_servers_defaults(chat_dir, monkeypatch, capsys, flags, expected):
    settings = []
    real_generate = genfn.generate

    def recording_generate(model, input_ids, **kwargs):
        settings.append({k: kwargs[k] for k in ("do_sample", "temperature", "top_p", "top_k") if k in kwargs})
        return real_generate(model, input_ids, **kwargs)

    monkeypatch.setattr(genfn, "generate", recording_generate)
    code, _, _ = _chat(monkeypatch, capsys, "hello\n", "--model", str(chat_dir), "--max-new-tokens", "2", *flags)
    assert code == 0 and settings == [expected]
