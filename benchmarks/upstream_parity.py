"""Run transformers' own generation test files against genfn, and against transformers itself.

The test files are not in transformers' wheel, nor (5.24.0) in its sdist; pass a folder holding
them (``--tests``: transformers' ``tests/generation`` folder, or a checkout whose
``tests/generation`` it is), or ``--sdist VERSION`` to have pip fetch transformers' sdist and look
for them there. Nothing of them is copied into this repository: each run lays out two throwaway
trees in a temporary folder,

* ``transformers/``: the files as they are (the reference run: what transformers itself passes
  here, offline; tests that need the Hub fail on both sides and are left out of the comparison);
* ``genfn/``: the same files with every ``from transformers[.generation[.X]] import ...`` turned
  into ``from genfn.bench.upstream_shim import ...`` (genfn's objects under transformers' names,
  called transformers' way; see that module),

runs pytest on each in a subprocess and reports, per test, both outcomes and genfn's error, then
the totals: of the tests transformers passes, how many genfn passes, and the remaining failures
by category (the exception genfn raised). ``tests/test_modeling_common.py``, which the files
import ``ids_tensor`` from, is replaced by a few lines of this script's own.

    python benchmarks/upstream_parity.py --tests /path/to/transformers/tests/generation --json out.json
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

DEFAULT_FILES = ("test_logits_process.py", "test_stopping_criteria.py", "test_configuration_utils.py",
                 "test_streamers.py")

# `from transformers import`, `from transformers.generation import`, `from transformers.generation.X import`;
# transformers.testing_utils (the tests' own tools) stays.
_IMPORT = re.compile(r"^(\s*)from\s+transformers(?:\.generation(?:\.\w+)*)?\s+import\b", re.MULTILINE)
SHIM = "genfn.bench.upstream_shim"

_MODELING_COMMON = '''\
"""Stands in for transformers' tests/test_modeling_common.py: the helpers the generation tests import."""
import random

import torch
from transformers.testing_utils import torch_device


def ids_tensor(shape, vocab_size, rng=None, name=None):
    rng = rng or random.Random()
    values = [rng.randint(0, vocab_size - 1) for _ in range(int(torch.Size(shape).numel()))]
    return torch.tensor(values, dtype=torch.long, device=torch_device).view(shape).contiguous()


def floats_tensor(shape, scale=1.0, rng=None, name=None):
    rng = rng or random.Random()
    values = [rng.random() * scale for _ in range(int(torch.Size(shape).numel()))]
    return torch.tensor(values, dtype=torch.float, device=torch_device).view(shape).contiguous()
'''

# Used only where the `parameterized` package is not installed: its `expand`, enough for these files.
_PARAMETERIZED = '''\
"""A minimal `parameterized.expand` (the package is not installed here)."""
import functools
import inspect


class parameterized:
    @staticmethod
    def expand(cases):
        def decorate(test):
            namespace = inspect.currentframe().f_back.f_locals
            for index, case in enumerate(cases):
                case = case if isinstance(case, (tuple, list)) else (case,)

                def bound(self, _case=tuple(case)):
                    return test(self, *_case)

                suffix = "_".join(str(part) for part in case if isinstance(part, (int, float, str)))
                name = f"{test.__name__}_{index}" + (f"_{suffix}" if suffix else "")
                namespace[name] = functools.wraps(test)(bound)
                namespace[name].__name__ = name
            return None
        return decorate
'''


def find_test_files(folder: Path, names: list[str]) -> dict[str, Path]:
    """``name -> path`` of the requested test files under ``folder`` (or its tests/generation)."""
    for base in (folder, folder / "tests" / "generation"):
        found = {n: base / n for n in names if (base / n).is_file()}
        if found:
            return found
    return {}


def fetch_sdist(version: str, into: Path) -> Path:
    """Download transformers' sdist with pip and unpack its tests/generation; the folder, or exit."""
    subprocess.run([sys.executable, "-m", "pip", "download", f"transformers=={version}", "--no-binary", ":all:",
                    "--no-deps", "--no-build-isolation", "-d", str(into)], check=True, timeout=600)
    archive = next(into.glob("transformers-*.tar.gz"))
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/tests/generation/" in m.name and m.isfile()]
        if not members:
            sys.exit(f"{archive.name} holds no tests/generation: pass --tests with a folder of transformers' "
                     f"generation test files (a checkout of github.com/huggingface/transformers at v{version})")
        tar.extractall(into, members=members, filter="data")
    return next(into.glob("transformers-*")) / "tests" / "generation"


def rewrite_for_genfn(source: str) -> str:
    """The test file with transformers' generation imports answered by genfn's shim."""
    return _IMPORT.sub(lambda m: f"{m.group(1)}from {SHIM} import", source)


def lay_out(root: Path, files: dict[str, Path], for_genfn: bool) -> None:
    generation = root / "tests" / "generation"
    generation.mkdir(parents=True)
    (root / "tests" / "__init__.py").write_text("")
    (generation / "__init__.py").write_text("")
    (root / "tests" / "test_modeling_common.py").write_text(_MODELING_COMMON)
    if importlib.util.find_spec("parameterized") is None:
        (root / "parameterized.py").write_text(_PARAMETERIZED)
    for name, path in files.items():
        source = path.read_text(encoding="utf-8")
        (generation / name).write_text(rewrite_for_genfn(source) if for_genfn else source, encoding="utf-8")


def run_pytest(root: Path, names: list[str], timeout: float, keyword: str | None = None) -> dict[str, tuple[str, str]]:
    """``test id -> (outcome, first line of the message)``; outcome is passed/failed/error/skipped."""
    report = root / "report.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           f"--junitxml={report}", "--rootdir", str(root), *(["-k", keyword] if keyword else []),
           *[f"tests/generation/{n}" for n in names]]
    try:
        subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"pytest in {root.name} ran past {timeout:.0f} s", file=sys.stderr)
    if not report.exists():
        return {}
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        file_id = case.get("classname", "").split(".")[2] if case.get("classname", "").count(".") >= 2 else ""
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (node.get("message") or node.text or "").strip().splitlines()[0:1]
                message = message[0][:300] if message else ""
                break
        outcomes[f"{file_id}::{test_id}" if file_id else test_id] = (outcome, message)
    return outcomes


def category(message: str) -> str:
    """A failure's kind: the exception's name, or `assertion` for a value that differs."""
    match = re.match(r"\s*([A-Za-z_][\w.]*(?:Error|Exception|InGenfn|Warning))\b", message)
    if match:
        return match.group(1).rpartition(".")[2]
    if message.startswith(("assert", "AssertionError")) or "!=" in message or "not true" in message.lower():
        return "AssertionError"
    return message.split(":")[0][:60] or "unknown"


def compare(theirs: dict, ours: dict) -> dict:
    reference = sorted(t for t, (o, _) in theirs.items() if o == "passed")
    passed = [t for t in reference if ours.get(t, ("missing", ""))[0] == "passed"]
    failing = {t: ours.get(t, ("missing", "not collected")) for t in reference if t not in passed}
    categories = collections.Counter(category(m) for _, m in failing.values())
    return {"transformers_passed": len(reference), "genfn_passed": len(passed), "genfn_failing": failing,
            "categories": dict(categories.most_common()),
            "genfn_only_passed": sorted(t for t, (o, _) in ours.items() if o == "passed" and t not in reference)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=textwrap.dedent("""\
                                         Prints one line per test (transformers' outcome, genfn's, genfn's error) and
                                         the totals; --json writes them too. Needs pytest and transformers installed."""))
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tests", type=Path, help="folder of transformers' generation test files (or a checkout)")
    source.add_argument("--sdist", metavar="VERSION", help="download transformers' sdist VERSION and use its tests")
    parser.add_argument("--files", nargs="+", default=list(DEFAULT_FILES), help="test files to run (those present)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per side (default 1800)")
    parser.add_argument("--json", type=Path, help="write the per-test outcomes and totals here")
    parser.add_argument("-k", dest="keyword", help="pytest's -k expression, on both sides (e.g. 'not convergence': "
                                                     "SynthID's four convergence tests take minutes each on CPU)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="genfn-upstream-") as tmp:
        tmp = Path(tmp)
        folder = args.tests if args.tests is not None else fetch_sdist(args.sdist, tmp / "sdist")
        files = find_test_files(folder, args.files)
        if not files:
            sys.exit(f"none of {', '.join(args.files)} found in {folder}")
        sides = {}
        for side in ("transformers", "genfn"):
            lay_out(tmp / side, files, for_genfn=side == "genfn")
            print(f"running {len(files)} file(s) against {side}...", file=sys.stderr, flush=True)
            sides[side] = run_pytest(tmp / side, sorted(files), args.timeout, args.keyword)
    theirs, ours = sides["transformers"], sides["genfn"]
    summary = compare(theirs, ours)

    width = max((len(t) for t in theirs), default=10)
    for test in sorted(set(theirs) | set(ours)):
        (t_out, _), (g_out, g_msg) = theirs.get(test, ("-", "")), ours.get(test, ("-", ""))
        note = f"  {g_msg[:120]}" if g_out not in ("passed", "-") and t_out == "passed" else ""
        print(f"{test:<{width}}  transformers {t_out:<7}  genfn {g_out:<7}{note}")
    print(f"\nfiles: {', '.join(sorted(files))}")
    print(f"transformers passes {summary['transformers_passed']} of {len(theirs)} tests here; genfn passes "
          f"{summary['genfn_passed']} of those {summary['transformers_passed']}")
    print("remaining failures by category: " + (", ".join(f"{k} {v}" for k, v in summary["categories"].items())
                                                 or "none"))
    if args.json:
        args.json.write_text(json.dumps({"files": sorted(files), "transformers": theirs, "genfn": ours,
                                         **summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
