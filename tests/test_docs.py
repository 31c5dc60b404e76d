"""The documentation: the MkDocs site builds with --strict (broken links and anchors fail), the
cheap docstring examples run as doctests, and every benchmark log the docs cite is kept (and only
those)."""

from __future__ import annotations

import doctest
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 600


def test_mkdocs_build_is_strict_clean(tmp_path):
    # The test extra installs mkdocs: a missing one is a broken install, never a skip.
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as missing:
        pytest.fail(f"the docs build needs the docs extra ({missing}): pip install '.[docs]' (or '.[test]')")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    page = (tmp_path / "site" / "reference" / "state" / "index.html").read_text(encoding="utf-8")
    assert "pytree_dataclass" in page  # the API reference is generated from the docstrings


@pytest.mark.parametrize("module", ["genfn.random", "genfn.state.base", "genfn.torch_compat"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{module} has no docstring examples"
    assert result.failed == 0


def _cited_results() -> set[str]:
    texts = [(REPO / "README.md").read_text(encoding="utf-8")]
    texts += [p.read_text(encoding="utf-8") for p in (REPO / "docs").rglob("*.md")]
    names = set()
    for text in texts:
        names |= set(re.findall(r"\b([a-z][a-z0-9_-]*-20\d\d-\d\d-\d\d[\w.-]*?\.(?:log|json))\b", text))
        # A cited family, e.g. batching-2026-12-02-session7-*.log or -{float32,bfloat16}.log
        for stem, alternatives, ext in re.findall(r"\b([a-z][\w-]*-20\d\d-[\w-]*?)\{([\w,]+)\}([\w.-]*)", text):
            names |= {f"{stem}{alt}{ext}" for alt in alternatives.split(",")}
    return names


def test_every_cited_benchmark_run_is_kept_and_only_those():
    kept = {p.name for p in (REPO / "benchmarks" / "results").iterdir()}
    cited = _cited_results()
    missing = sorted(name for name in cited if name not in kept)
    assert not missing, f"cited in README.md or docs/ but not in benchmarks/results: {missing}"
    text = (REPO / "README.md").read_text(encoding="utf-8") + "".join(
        p.read_text(encoding="utf-8") for p in (REPO / "docs").rglob("*.md"))
    uncited = sorted(name for name in kept if name not in cited and name.rsplit(".", 1)[0] not in text
                     and not any(re.fullmatch(pattern.replace("*", ".*"), name)
                                 for pattern in re.findall(r"[\w-]+\*[\w.-]*", text)))
    assert not uncited, f"kept in benchmarks/results but cited nowhere (delete or cite them): {uncited}"


def test_readme_links_into_the_manual_resolve():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme)
    assert len(links) >= 10
    assert not [link for link in links if not (REPO / link).is_file()]
    assert "../shared" not in readme  # a clone has no shared folder
