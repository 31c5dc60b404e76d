"""A native kernel library as a git revision had it, built beside this tree's for A/B benchmarks.

The revision's sources and headers are read with ``git show``, every name in ``renames`` replaced
(the op namespace, and any C++ namespace, so that no symbol of one library stands in for the
other's), written into a directory of the kernel cache named by that text, and compiled there
once with this tree's compiler command. Loaded with ``torch.ops.load_library``, its ops run under
the renamed namespace next to this tree's in one process.
"""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Mapping
from pathlib import Path

from genfn.kernels import native

__all__ = ["build_at_revision"]

_REPO = Path(__file__).resolve().parents[2]


def _show(revision: str, path: Path) -> str | None:
    """The text of genfn/kernels/<path.name> at ``revision``; None where it did not exist yet."""
    shown = subprocess.run(["git", "show", f"{revision}:genfn/kernels/{path.name}"], cwd=_REPO,
                           capture_output=True, text=True)
    return shown.stdout if shown.returncode == 0 else None


def build_at_revision(library: native.NativeLibrary, revision: str, renames: Mapping[str, str],
                      sources: tuple[str, ...] | None = None) -> Path:
    """Path of ``library`` (or just its ``sources``, by file name) compiled from ``revision``'s text
    with ``renames`` applied; files the revision lacks are left out. Built once per text."""
    def renamed(text: str) -> str:
        for old, new in renames.items():
            text = text.replace(old, new)
        return text

    wanted = [s for s in library.sources if sources is None or s.name in sources]
    texts = {p.name: renamed(t) for p in (*wanted, *library.headers) if (t := _show(revision, p)) is not None}
    if not any(p.name in texts for p in wanted):
        raise ValueError(f"revision {revision!r} has none of {[p.name for p in wanted]}")
    key = hashlib.sha256("\0".join(f"{n}\0{t}" for n, t in sorted(texts.items())).encode()).hexdigest()[:16]
    directory = native.cache_dir() / f"{library.stem}-at-{key}"
    output = directory / f"{library.stem}.so"
    if output.exists():
        return output
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():  # headers beside the sources: they are included by name
        (directory / name).write_text(text)
    built = [directory / p.name for p in wanted if p.name in texts]
    print(f"  building {library.what} of {revision} ...", flush=True)
    partial = directory / f"{library.stem}.so.partial"
    subprocess.run(native.compile_command(library, partial, built), check=True, timeout=1800)
    partial.rename(output)
    return output
