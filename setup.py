"""Compiles genfn's native kernels into the package while it is built, where the build has torch and
a C++ compiler; everything else about the package is in pyproject.toml.

``[build-system] requires`` holds the torch release genfn is tested on, so an isolated ``pip install .``
(or ``pip install -e .``, ``pip wheel .``) has it. The libraries are the ones a first use would
build (``genfn/kernels/native.py``, loaded from the source tree: same sources, flags and key),
compiled through the user's kernel cache (a second install reuses it) and copied into
``genfn/kernels/prebuilt/`` (the source tree's for an editable install). Without torch or a
compiler, on a machine that cannot run them, or with ``GENFN_BUILD_KERNELS=0``, the package installs
without them and a first use (or ``genfn kernels build``) builds them; a failed compile never
fails the install.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
import warnings
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


def _native():
    spec = importlib.util.spec_from_file_location("genfn_native_build", ROOT / "genfn" / "kernels" / "native.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look up their class's module
    spec.loader.exec_module(module)
    return module


def _why_not(native) -> str | None:
    """Why the kernels are not built at install time, or None."""
    if os.environ.get("GENFN_BUILD_KERNELS", "1") == "0":
        return "GENFN_BUILD_KERNELS=0"
    try:
        with warnings.catch_warnings():  # "Failed to initialize NumPy": the build env has no numpy, nor needs it
            warnings.simplefilter("ignore")
            import torch  # noqa: F401
    except ImportError:
        return "torch is not in the build environment (pip --no-build-isolation without torch installed?)"
    if shutil.which(native.compiler()) is None:
        return "no C++ compiler (set CXX or install g++)"
    return None


def _say(text: str) -> None:
    print(f"genfn: {text}", file=sys.stderr, flush=True)


def build_kernels(target: Path) -> list[Path]:
    """Compile every library this machine can run into ``target``; returns the files written."""
    native = _native()
    reason = _why_not(native)
    if reason is not None:
        _say(f"not building the native kernels at install time: {reason}; the first use builds them "
             "(or run `genfn kernels build`)")
        return []
    target.mkdir(parents=True, exist_ok=True)
    # native.build's progress lines, once each, whatever logging the build backend set up.
    logger = logging.getLogger("genfn.kernels")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("genfn: %(message)s"))
    saved = logger.handlers[:], logger.propagate, logger.level
    logger.handlers, logger.propagate, logger.level = [handler], False, logging.INFO
    try:
        return _build_each(native, target)
    finally:
        logger.handlers, logger.propagate, logger.level = saved


def _build_each(native, target: Path) -> list[Path]:
    written = []
    for library in native.LIBRARIES:
        found = native.plan(library)
        if found.action in ("unavailable", "no compiler"):
            _say(f"not building the native {library.what}: {found.reason}")
            continue
        if found.action == "build":  # native.build says "building ..." and "built ... in N s"
            try:
                try:
                    built = native.build(library)  # through the cache: a reinstall reuses it
                except OSError:  # no writable cache (a sandboxed build): compile straight into the package
                    built = native.build(library, target)
            except (OSError, RuntimeError) as error:
                _say(f"could not build the native {library.what} ({error}); the first use tries again")
                continue
        else:  # cached, or built by an earlier editable install: copied, not compiled
            built = found.path
        for stale in target.glob(f"{library.stem}-*.so"):  # other sources or torch: never picked again
            if stale.name != built.name:
                stale.unlink()
        if built.resolve().parent != target.resolve():
            shutil.copyfile(built, target / built.name)
        written.append(target / built.name)
        _say(f"installed the native {library.what}: {target / built.name}")
    return written


class BuildWithKernels(build_py):
    """build_py, then the native kernels into the built package (the source tree when editable)."""

    def run(self):
        super().run()
        root = ROOT if getattr(self, "editable_mode", False) else Path(self.build_lib)
        self._kernels = build_kernels(root / "genfn" / "kernels" / "prebuilt")

    def get_outputs(self, *args, **kwargs):
        return [*super().get_outputs(*args, **kwargs), *map(str, getattr(self, "_kernels", []))]


class KernelDistribution(Distribution):
    """A wheel that carries native libraries is tied to this platform (not ``py3-none-any``)."""

    def has_ext_modules(self):
        return _why_not(_native()) is None


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import build_kernels
    setup(cmdclass={"build_py": BuildWithKernels}, distclass=KernelDistribution)
