"""``generate(custom_generate="dir")``: a decoding loop shipped as code in a directory.

The layout is transformers': ``<dir>/custom_generate/generate.py`` defines ``generate(model,
input_ids, **kwargs)``. Running it executes code from disk, so it loads only with
``trust_remote_code=True``. A Hub repository id is looked up in the local Hugging Face cache only
(genfn never downloads); when it is not there the error says how to get it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
import types
from typing import Callable

__all__ = ["load_custom_generate"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _cached_hub_snapshot(repo_id: str) -> str | None:
    """The local snapshot of ``repo_id`` in the Hugging Face cache, or None (never downloads)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return snapshot_download(repo_id, local_files_only=True)
    except Exception:  # not cached (LocalEntryNotFoundError) or an invalid id: both mean "not here"
        return None


def _directory_for(source: str) -> str:
    if os.path.isdir(source):
        return source
    if _HUB_ID.match(source):
        snapshot = _cached_hub_snapshot(source)
        if snapshot is not None:
            return snapshot
        raise ValueError(f"custom_generate={source!r} names a Hub repository that is not in the local Hugging Face "
                         f"cache, and genfn does not download (it runs offline): fetch it with "
                         f"`huggingface-cli download {source} --local-dir DIR` and pass custom_generate=DIR")
    raise FileNotFoundError(f"custom_generate={source!r} is neither a directory nor a Hub repository id")


def load_custom_generate(source, *, trust_remote_code: bool = False) -> Callable:
    """The ``generate`` function of the directory (or cached Hub repository) ``source``."""
    source = os.fspath(source)
    directory = _directory_for(source)
    code_dir = os.path.join(directory, "custom_generate")
    path = os.path.join(code_dir, "generate.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"custom_generate={source!r}: {path} does not exist (a custom generation directory "
                                f"holds custom_generate/generate.py defining generate(model, input_ids, **kwargs))")
    if trust_remote_code is not True:
        raise ValueError(f"custom_generate={source!r} runs the code in {path}; pass trust_remote_code=True to "
                         f"generate() once you have read it and trust it")
    # A package per directory, so generate.py may import its sibling files relatively.
    package = "genfn_custom_generate_" + hashlib.sha1(os.path.abspath(code_dir).encode()).hexdigest()[:12]
    if package not in sys.modules:
        parent = types.ModuleType(package)
        parent.__path__ = [code_dir]
        sys.modules[package] = parent
    spec = importlib.util.spec_from_file_location(f"{package}.generate", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    function = getattr(module, "generate", None)
    if not callable(function):
        raise TypeError(f"custom_generate={source!r}: {path} defines no generate(model, input_ids, **kwargs) function")
    return function
