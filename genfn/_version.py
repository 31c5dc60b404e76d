"""genfn's version, from the installed package's metadata (``importlib.metadata``).

A source checkout that was never installed has no metadata; its version is then read from the
``pyproject.toml`` beside the package, marked ``+source``.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

__all__ = ["package_version"]


def package_version() -> str:
    """The installed distribution's version, or the checkout's ``pyproject.toml`` version + ``+source``."""
    try:
        return metadata.version("genfn")
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(encoding="utf-8"), re.M) \
            if pyproject.is_file() else None
        return f"{found.group(1)}+source" if found else "0+unknown"
