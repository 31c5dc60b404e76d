"""``genfn kernels``: where the native kernel libraries are (``status``), or build them now (``build``).

``python -m genfn.kernels`` is the same command. The report goes to stdout, one line per library;
``build`` compiles what is neither installed with genfn nor cached (into the cache, the same file
a first use would build) and exits 1 if a library this CPU can run could not be built.
"""

from __future__ import annotations

import argparse
import shutil

from genfn.cli.status import Status

__all__ = ["add_arguments", "main", "describe"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=("status", "build"), default="status",
                        help="status: where each library is and what a first use would do (the default); "
                             "build: compile what is missing, now")


def describe(found) -> str:
    """One library's state, from ``genfn.kernels.native.plan``."""
    from genfn.kernels import native

    if found.action == "prebuilt":
        return f"installed with genfn: {found.path}"
    if found.action == "cached":
        return f"cached: {found.path}"
    if found.action == "build":
        return f"not built yet: the first use (or `genfn kernels build`) compiles it into {native.cache_dir()}"
    return f"unavailable: {found.reason}"


def _header() -> list[str]:
    import torch

    from genfn.kernels import native

    flags = native.cpu_flags()
    features = "unknown" if flags is None else " ".join(
        f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni") if f in flags)
    return [f"torch: {torch.__version__}",
            f"compiler: {native.compiler()} ({shutil.which(native.compiler()) or 'not found'})",
            f"CPU features used: {features or 'none'}",
            f"installed builds: {native.prebuilt_dir()}",
            f"cache: {native.cache_dir()}"]


def main(args, status: Status) -> int:
    from genfn.kernels import native

    for line in _header():
        print(line)
    failed = False
    for library in native.LIBRARIES:
        found = native.plan(library)
        if args.action == "build" and found.action == "build":
            status.begin(f"building the native {library.what} into {native.cache_dir()} ({native.BUILD_NOTE})")
            try:
                path = native.build(library)
            except (OSError, RuntimeError) as error:
                status.end(f"building the native {library.what} failed")
                print(f"{library.what}: build failed: {error}")
                failed = True
                continue
            status.end(f"built the native {library.what}")
            print(f"{library.what}: built: {path}")
            continue
        if args.action == "build" and found.action == "no compiler":
            failed = True
        print(f"{library.what}: {describe(found)}")
    if args.action == "build" and not failed:
        failed = not _store_inductor_probes(status)
    return 1 if failed else 0


def _store_inductor_probes(status: Status) -> bool:
    """Inductor's vector-ISA probe libraries, built once here so that a cold compile in any
    inductor cache directory finds them (genfn.cold_build)."""
    import subprocess

    from genfn import cold_build

    status.begin("building inductor's vector-ISA probes (seconds of g++)")
    try:
        stored = cold_build.store_vec_isa_probes()
    except (OSError, subprocess.SubprocessError) as error:
        status.end("building inductor's vector-ISA probes failed")
        print(f"inductor ISA probes: build failed: {error}")
        return False
    status.end("built inductor's vector-ISA probes")
    print(f"inductor ISA probes: {len(stored)} libraries in {cold_build.probe_store()}")
    return True
