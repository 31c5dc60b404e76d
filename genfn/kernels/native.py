"""Building, finding and loading genfn's native kernel libraries: the one loader for all of them.

Each library in ``LIBRARIES`` is compiled from its C++ sources with the system C++ compiler
against this torch, into ``<stem>-<key>.so`` whose key hashes the sources' and headers' text,
torch's version and C++ ABI, the compiler flags, and the machine. Loading a library
takes, in order:

1. the installed build, ``genfn/kernels/prebuilt/`` (``$GENFN_KERNEL_PREBUILT``): ``pip install``
   compiles the libraries there when the build environment has torch and a compiler (setup.py),
   and a wheel made with ``pip wheel .`` carries them;
2. the cache, ``$GENFN_KERNEL_CACHE`` (default ``~/.cache/genfn/kernels``);
3. else a build into the cache, once (``BUILD_NOTE``: minutes of g++).

A file whose key differs (other sources, torch, flags) is never picked, since its name differs. A
library compiled with ISA flags (the decode kernels' ``-mavx512f ...``) is loaded, or built, only
on a CPU that has those features: a wheel built on an AVX-512 machine falls back to torch's ops on
one without. The features the kernels use beyond those (AVX512_BF16, VNNI) are picked per function
at run time, never assumed.

This module imports nothing of genfn's, and torch only inside functions, so that setup.py can load
it from the source tree and build the same libraries with the same flags at install time.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

__all__ = ["NativeLibrary", "DECODE", "DECODE_AVX2", "KQUANT", "LIBRARIES", "BUILD_NOTE", "Plan", "plan", "load", "build", "library_key",
           "file_name", "cache_dir", "prebuilt_dir", "compiler", "compile_command", "cpu_flags", "cpu_has"]

_HERE = Path(__file__).resolve().parent
_BUILD_TIMEOUT_S = 600
# What a build's status line says it costs: the decode kernels alone took 152 s of g++ on an idle
# 2-core Zen 4 (session 41, benchmarks/results/startup-2026-12-07-s41-zen4-eager.log).
BUILD_NOTE = "once; a few minutes of g++ on a 2-core machine"
# Named, not __name__: setup.py loads this file under another module name.
_logger = logging.getLogger("genfn.kernels")


@dataclass(frozen=True)
class NativeLibrary:
    """One shared library of ops: ``sources`` are compiled into it, ``headers`` only enter the key,
    ``isa_flags`` go on the command line, and ``cpu_features`` (``/proc/cpuinfo`` names) are what
    those flags let the compiler assume: a CPU without them must not load the library."""

    stem: str
    what: str  # for messages: "decode kernels"
    sources: tuple[Path, ...]
    headers: tuple[Path, ...]
    isa_flags: tuple[str, ...]
    cpu_features: tuple[str, ...]
    fallback: str  # what runs where the library is unavailable, for the warning


DECODE = NativeLibrary(
    stem="decode_linear", what="decode kernels",
    sources=tuple(_HERE / name for name in ("decode_linear.cpp", "quant_linear.cpp", "decode_attention.cpp",
                                            "decode_layer.cpp", "decode_stack.cpp", "token_ops.cpp", "thread_pool.cpp",
                                            "bf16_gemm.cpp", "moe_decode.cpp", "gguf_tiles.cpp",
                                            "quant_gemm.cpp", "prefill_attention.cpp", "lookup_ops.cpp",
                                            "coded_bf16.cpp", "stack_table.cpp", "plain_linear.cpp")),
    headers=(_HERE / "decode_kernels.h", _HERE / "decode_layer.h", _HERE / "row_queue.h", _HERE / "team_barrier.h", _HERE / "kquant.h",
             _HERE / "attention_lanes.h", _HERE / "row_ops.h", _HERE / "tile_kinds.h", _HERE / "stack_table.h",
             _HERE / "lanes16.h", _HERE / "plain_rows.h"),
    isa_flags=("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"),
    cpu_features=("avx512f", "avx512bw", "avx512vl", "fma"),
    fallback="using torch's ops (block-quantized linears: the K-quant kernels' AVX2 path)")
# The decode kernels that lanes16.h writes once, built for a CPU with AVX2 but no AVX-512, where DECODE
# cannot load: the stack (decode_stack.cpp, its table, the decode attention), the plain linears
# (plain_rows.h, and decode_linear.cpp's ops), the token ops (token_ops.cpp, lookup_ops.cpp), the
# prefill attention and the GGUF loader's tile fill (gguf_tiles.cpp), in lanes16.h's two-register form,
# the same bits; tiles16 layers through tiles_avx2.h's kernels, K-quant layers through the K-quant
# library's. It registers ops under DECODE's names, so a process loads one of the two, never both.
# Built without contracting a product and a sum into one fused multiply-add where the code wrote two
# operations: g++ does so by default, and where an AVX2 sum of two halves read a product directly (a
# head_dim 16 score) it fused what the AVX-512 form's shuffles keep apart, one rounding fewer than the
# AVX-512 library's bits.
DECODE_AVX2 = NativeLibrary(
    stem="decode_avx2", what="decode kernels for AVX2",
    sources=tuple(_HERE / name for name in ("decode_avx2.cpp", "decode_attention.cpp", "decode_stack.cpp",
                                            "stack_table.cpp", "thread_pool.cpp", "plain_linear.cpp",
                                            "decode_linear.cpp", "token_ops.cpp", "lookup_ops.cpp",
                                            "prefill_attention.cpp", "gguf_tiles.cpp")),
    headers=(_HERE / "decode_kernels.h", _HERE / "decode_layer.h", _HERE / "row_queue.h", _HERE / "team_barrier.h",
             _HERE / "kquant.h", _HERE / "attention_lanes.h", _HERE / "row_ops.h", _HERE / "tile_kinds.h",
             _HERE / "stack_table.h", _HERE / "lanes16.h", _HERE / "tiles_avx2.h", _HERE / "plain_rows.h"),
    isa_flags=("-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"),
    cpu_features=("avx2", "fma", "f16c"),
    fallback="using the layer op by op")
# Its AVX-512 and AVX2 paths are compiled per function and chosen at run time (kquant.h).
KQUANT = NativeLibrary(
    stem="kquant_linear", what="K-quant kernels", sources=(_HERE / "kquant_linear.cpp", _HERE / "kquant_quantize.cpp",
                                                      _HERE / "kquant_gemm.cpp", _HERE / "iq4nl_gemm.cpp", _HERE / "iq4_linear.cpp",
                                                      _HERE / "kquant_r8.cpp", _HERE / "kquant_q6k.cpp",
                                                      _HERE / "kquant_lookup.cpp", _HERE / "tiles_avx2.cpp"),
    headers=(_HERE / "kquant.h", _HERE / "kquant_quantize.h", _HERE / "row_queue.h", _HERE / "team_barrier.h",
             _HERE / "kquant_rows.h", _HERE / "kquant_panel.h", _HERE / "tile_kinds.h", _HERE / "tiles_avx2.h"),
    isa_flags=("-mno-avx512f",), cpu_features=(), fallback="using the torch reference")
LIBRARIES = (DECODE, DECODE_AVX2, KQUANT)


def cache_dir() -> Path:
    return Path(os.environ.get("GENFN_KERNEL_CACHE") or Path.home() / ".cache" / "genfn" / "kernels")


def prebuilt_dir() -> Path:
    """Where ``pip install`` put the libraries it compiled (``GENFN_KERNEL_PREBUILT`` overrides it:
    a shared read-only directory, or an empty one in tests)."""
    return Path(os.environ.get("GENFN_KERNEL_PREBUILT") or _HERE / "prebuilt")


def compiler() -> str:
    return os.environ.get("CXX") or "c++"


def _flags(library: NativeLibrary) -> list[str]:
    """The command line's flags that decide the machine code: everything but paths (those depend
    on where torch is installed, which a prebuilt library must not)."""
    import torch

    return ["-O3", "-std=c++20", "-shared", "-fPIC", "-w", *library.isa_flags, "-fopenmp",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


def compile_command(library: NativeLibrary, output: Path, sources=None) -> list[str]:
    """The compiler's command line that builds ``library`` (its ``sources``, or these) into ``output``."""
    from torch.utils import cpp_extension

    lib_dirs = cpp_extension.library_paths()
    return [
        compiler(), *_flags(library),
        *[f"-I{p}" for p in cpp_extension.include_paths()],
        *map(str, library.sources if sources is None else sources), "-o", str(output),
        *[f"-L{d}" for d in lib_dirs], "-lc10", "-ltorch_cpu",
        # Resolve OpenMP and torch's libraries to the ones this torch ships, so the kernel's
        # parallel regions run on torch's thread pool rather than a second OpenMP runtime. (Loaded
        # after torch, the library finds them already loaded: the path only matters standalone.)
        *[f"-Wl,-rpath,{d}" for d in lib_dirs],
    ]


def library_key(library: NativeLibrary) -> str:
    """16 hex digits naming this build: sources' and headers' text, torch, flags, machine."""
    import torch

    key = hashlib.sha256()
    for path in (*library.sources, *library.headers):
        key.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    key.update(torch.__version__.encode())
    # Not the compiler: the key says what a library works with (not who built it), so one built
    # with g++ is found where CXX names another compiler, or none.
    key.update(" ".join([*_flags(library), "-lc10", "-ltorch_cpu"]).encode())
    key.update(platform.machine().encode())
    return key.hexdigest()[:16]


def file_name(library: NativeLibrary) -> str:
    return f"{library.stem}-{library_key(library)}.so"


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from ``/proc/cpuinfo``; ``None`` where there is none to read. Read once a
    process: ``cpu_has`` asks it on paths a step takes (``genfn.kernels.linear``'s bfloat16 GEMMs)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def cpu_has(feature: str) -> bool:
    flags = cpu_flags()
    return flags is not None and feature in flags


def _unsupported(library: NativeLibrary) -> str | None:
    """Why ``library`` cannot be used on this machine at all, or None."""
    if os.environ.get("GENFN_KERNELS", "1") == "0":
        return "disabled by GENFN_KERNELS=0"
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"needs an x86-64 CPU on Linux (this: {sys.platform}, {platform.machine()})"
    flags = cpu_flags()
    missing = [f for f in library.cpu_features if flags is not None and f not in flags]
    if missing:
        return f"needs a CPU with {', '.join(library.cpu_features)} (this one lacks {', '.join(missing)})"
    return None


class Plan(NamedTuple):
    """What loading a library will do: ``action`` is ``"prebuilt"`` or ``"cached"`` (load ``path``),
    ``"build"`` (compile into ``path`` first), ``"no compiler"`` (none of those: fall back) or
    ``"unavailable"`` (not on this machine, or turned off); ``reason`` says why for the last two."""

    action: str
    path: Path | None = None
    reason: str = ""


def plan(library: NativeLibrary) -> Plan:
    """What ``load(library)`` would do now, without doing it."""
    reason = _unsupported(library)
    if reason is not None:
        return Plan("unavailable", reason=reason)
    name = file_name(library)
    for action, directory in (("prebuilt", prebuilt_dir()), ("cached", cache_dir())):
        if (directory / name).is_file():
            return Plan(action, directory / name)
    if shutil.which(compiler()) is None:
        return Plan("no compiler", reason="not built, and no C++ compiler to build it (set CXX or install g++)")
    return Plan("build", cache_dir() / name)


def build(library: NativeLibrary, directory: Path | None = None) -> Path:
    """Path of ``library`` compiled into ``directory`` (default: the cache), compiling it unless this
    key is there already. Concurrent builders of one directory wait on its lock; one compiles."""
    if shutil.which(compiler()) is None:
        raise RuntimeError("no C++ compiler (set CXX or install g++)")
    directory = cache_dir() if directory is None else Path(directory)
    target = directory / file_name(library)
    directory.mkdir(parents=True, exist_ok=True)
    if target.exists():  # built: no need to queue behind another process's build of other sources
        return target
    with open(directory / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            # Say so: the one-time build takes minutes of g++ and would otherwise look like a hang.
            _logger.info("building the native %s into %s (%s)", library.what, directory, BUILD_NOTE)
            start = time.perf_counter()
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            done = subprocess.run(compile_command(library, partial), capture_output=True, text=True,
                                  timeout=_BUILD_TIMEOUT_S)
            if done.returncode != 0:
                partial.unlink(missing_ok=True)
                names = ", ".join(s.name for s in library.sources)
                raise RuntimeError(f"compiling {names} failed:\n{done.stderr[-2000:]}")
            partial.replace(target)
            _logger.info("built the native %s in %.1f s", library.what, time.perf_counter() - start)
    return target


def load(library: NativeLibrary) -> tuple[bool, str]:
    """Load ``library``'s ops into torch (installed build, else cached, else compiled now). Returns
    whether they loaded and the status: ``"loaded from <path>"`` or why not (also warned)."""
    import torch

    reason = _unsupported(library)
    if reason is not None:
        return False, reason
    try:
        found = plan(library)
        path = found.path if found.action in ("prebuilt", "cached") else build(library)
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        status = f"unavailable: {error}"
        warnings.warn(f"genfn: {library.what} {status}; {library.fallback}", RuntimeWarning, stacklevel=3)
        return False, status
    return True, f"loaded from {path}"
