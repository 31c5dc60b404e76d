"""The README's commands run: every fenced shell block marked ``<!-- runnable -->`` runs on a tiny
random model; ``python -m genfn --version`` and ``genfn.__version__`` give the package's version;
the README's Python examples are valid Python."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cli_support import build_tiny_model

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
RUN_TIMEOUT_S = 300
MARKER = "<!-- runnable -->"
# Inside a runnable block, `genfn CMD ...` runs this checkout's genfn with `--model <tiny model>`
# for the commands that load one; every other line runs as written.
SHELL_PRELUDE = textwrap.dedent("""\
    set -euo pipefail
    genfn() {
        local command="$1"; shift
        case "$command" in
            generate|chat|batch|serve) "$PYTHON" -m genfn "$command" --model "$TINY_MODEL" "$@" ;;
            *) "$PYTHON" -m genfn "$command" "$@" ;;
        esac
    }
    python() { "$PYTHON" "$@"; }
    """)


def fenced_blocks(text: str) -> list[tuple[str, str, bool]]:
    """(language, body, marked runnable) of every fenced block in ``text``."""
    pattern = re.compile(r"(?P<marker><!-- runnable -->\s*\n)?```(?P<lang>\w*)[^\n]*\n(?P<body>.*?)\n```", re.S)
    return [(m["lang"], m["body"], m["marker"] is not None) for m in pattern.finditer(text)]


def runnable_blocks() -> list[str]:
    return [body for lang, body, runnable in fenced_blocks(README) if runnable and lang in ("bash", "sh", "shell")]


def test_the_readme_marks_runnable_blocks():
    assert README.count(MARKER) == len(runnable_blocks()) >= 1, "a marker not followed by a shell block"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("readme_model"))


@pytest.mark.parametrize("index", range(len(runnable_blocks())))
def test_runnable_block_runs(index, tiny_model_dir, tmp_path):
    block = runnable_blocks()[index]
    env = {**os.environ, "PYTHON": sys.executable, "TINY_MODEL": str(tiny_model_dir),
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(["bash", "-c", SHELL_PRELUDE + block], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"README block {index} failed:\n{block}\n--- stderr ---\n{done.stderr[-3000:]}"
    lines = block.count("\n") + 1
    assert done.stdout.strip(), f"README block {index} ({lines} lines) printed nothing"
    json_lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    for line in json_lines:  # `--json` prints one object a run
        assert "text" in json.loads(line)


def test_python_examples_parse():
    python_blocks = [body for lang, body, _ in fenced_blocks(README) if lang == "python"]
    assert len(python_blocks) >= 3
    for body in python_blocks:
        ast.parse(body)


def test_version_from_the_package_metadata():
    import genfn
    from importlib import metadata

    try:
        expected = metadata.version("genfn")
    except metadata.PackageNotFoundError:
        expected = None
    assert isinstance(genfn.__version__, str) and re.match(r"\d+\.\d+", genfn.__version__)
    if expected is not None:
        assert genfn.__version__ == expected
    done = subprocess.run([sys.executable, "-m", "genfn", "--version"], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("genfn ")
    if expected is not None:
        assert done.stdout.strip() == f"genfn {expected}"


def test_version_without_metadata_reads_the_checkout(monkeypatch):
    from importlib import metadata

    from genfn import _version

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    found = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert _version.package_version() == f"{found}+source"
