"""A cold compile's C++ side, shortened without changing what inductor builds.

Two of inductor's g++ jobs sit on a cold CPU compile's critical path although nothing waits on
them being serial:

- **The ISA probes.** Before it generates its first CPU kernel, inductor checks which vector ISAs
  this machine and compiler can build and load (``cpu_vec_isa.valid_vec_isa_list``: one small
  g++ build of ``vec.h`` and one ``dlopen`` per ISA the CPU reports, six on an AVX-512 machine, 4-9
  s of g++ on SmolLM2's cold compile). The builds land in inductor's cache directory, so only the
  first compile per cache directory pays them, but that one pays them while its Python waits.
  :func:`start_vec_isa_probes` runs the same probe in a thread when the backend is handed the
  graph, so the g++ runs beside AOT autograd and inductor's lowering (several seconds of Python)
  instead of after them. Inductor's own call then reads the answer from its ``functools.cache``;
  if it comes first it waits on the probe's file lock and reuses what was built.
  Better still, they need not be built again for every cache directory: ``genfn kernels build``
  (the one-time set-up that builds genfn's own kernels) runs inductor's probe once in a child
  process with a temporary inductor cache and keeps the libraries it built
  (:func:`store_vec_isa_probes`, under genfn's kernel cache); a compile copies any that its
  inductor cache lacks into it first (:func:`seed_vec_isa_probes`), so inductor's probe finds
  them built and only loads them. Inductor keys each file by its source, compiler version, flags
  and torch version, so a stored library whose compiler or torch changed is never found. (The
  kernels' build inside ``pip install`` stores none: its isolated build environment's torch is not
  the one the user runs.)
- **The wrapper and the kernels.** With ``cpp_wrapper_build_separate`` the C++ wrapper (-O1) and
  the kernels (-O3) are two translation units linked into one library, but inductor compiles them
  one after the other. :func:`parallel_cpp_units` has the two compiled at once for the duration
  of one compile (then the link, as before): the same commands, the same library.

Neither changes an inductor setting or the environment: the probe is inductor's own code run
earlier, and the build swap is undone when the compile returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator

import torch

from genfn.kernels import native
from genfn.torch_compat import import_inductor_compiler, inductor_cache_dir, inductor_cpp_worker, inductor_vec_isa_probe

__all__ = ["start_vec_isa_probes", "parallel_cpp_units", "build_units_in_parallel", "store_vec_isa_probes",
           "seed_vec_isa_probes", "probe_store"]

_logger = logging.getLogger(__name__)


# Inductor's probe, as a child process runs it (its own import of torch, so no state of ours leaks in).
_PROBE_PROGRAM = "from torch._inductor.cpu_vec_isa import valid_vec_isa_list; valid_vec_isa_list()"
PROBE_TIMEOUT_S = 600


def probe_store() -> Path:
    """Where genfn keeps inductor's ISA probe libraries: beside its kernels, in ``$GENFN_KERNEL_CACHE``."""
    return native.cache_dir() / "inductor-isa-probes"


def store_vec_isa_probes(store: Path | None = None) -> list[Path]:
    """Run inductor's vector-ISA probe in a child process on a temporary inductor cache, and copy
    the libraries it built into ``store`` (default :func:`probe_store`) at their paths relative to
    that cache; returns those relative paths."""
    store = probe_store() if store is None else store
    with tempfile.TemporaryDirectory(prefix="genfn-isa-probe-") as cache:
        subprocess.run([sys.executable, "-c", _PROBE_PROGRAM], env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache),
                       check=True, capture_output=True, timeout=PROBE_TIMEOUT_S)
        built = sorted(path.relative_to(cache) for path in Path(cache).rglob("*.so"))
        for relative in built:
            _copy_atomically(Path(cache) / relative, store / relative)
    return built


def seed_vec_isa_probes(store: Path, inductor_cache: Path) -> int:
    """Copy the probe libraries in ``store`` that ``inductor_cache`` lacks into it; returns how many."""
    if not store.is_dir():
        return 0
    copied = 0
    for stored in store.rglob("*.so"):
        target = inductor_cache / stored.relative_to(store)
        if not target.exists():
            _copy_atomically(stored, target)
            copied += 1
    return copied


def _copy_atomically(source: Path, target: Path) -> None:
    """A reader (a concurrent compile) sees the whole library or none."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.partial")
    shutil.copy2(source, partial)
    os.replace(partial, target)


def start_vec_isa_probes(example_inputs: Iterable, options: dict) -> threading.Thread | None:
    """Start inductor's vector-ISA probe in a daemon thread when the graph runs on the CPU (first
    seeding inductor's cache from :func:`probe_store`), and return the thread; None when this
    process has probed already, or when ``options`` (the compile's inductor options) set anything
    under ``cpp.`` (the probe would read the settings the compile is about to patch)."""
    probe = inductor_vec_isa_probe()
    if probe is None or probe.cache_info().currsize or any(key.startswith("cpp.") for key in options):
        return None
    if not any(isinstance(x, torch.Tensor) and x.device.type == "cpu" for x in example_inputs):
        return None
    try:
        seeded = seed_vec_isa_probes(probe_store(), inductor_cache_dir())
        _logger.debug("seeded inductor's cache with %d stored ISA probe libraries", seeded)
    except OSError:  # an unwritable cache: inductor's probe builds what it needs, as without a store
        _logger.debug("could not seed inductor's ISA probe libraries", exc_info=True)

    def run():
        try:
            probe()
        except Exception:  # inductor's own call will probe again and report it
            _logger.debug("the early vector-ISA probe failed", exc_info=True)

    import_inductor_compiler()  # before the thread: the two must not initialize inductor's modules at once
    thread = threading.Thread(target=run, name="genfn-vec-isa-probe", daemon=True)
    thread.start()
    return thread


def build_units_in_parallel(lock_path: str, builders) -> None:
    """Inductor's ``_worker_compile_cpp`` with the compile-only units built at once: for
    ``(wrapper, kernels, linker)`` the first two run in parallel, then the link; any other
    sequence of builders is built in order, as inductor does."""
    from torch.utils._filelock import FileLock
    from torch._inductor.codecache import LOCK_TIMEOUT

    def missing(builder) -> bool:
        return not os.path.exists(builder.get_target_file_path())

    with FileLock(lock_path, timeout=LOCK_TIMEOUT):
        units, rest = (builders[:2], builders[2:]) if len(builders) == 3 else ((), builders)
        pending = [unit for unit in units if missing(unit)]
        if len(pending) > 1:
            with ThreadPoolExecutor(len(pending), thread_name_prefix="genfn-cpp-build") as pool:
                for done in [pool.submit(unit.build) for unit in pending]:
                    done.result()
        else:
            rest = [*pending, *rest]
        for builder in rest:
            if missing(builder):
                builder.build()


_swap_lock = threading.Lock()
_swap = {"depth": 0, "original": None}


@contextlib.contextmanager
def parallel_cpp_units() -> Iterator[None]:
    """Inductor's C++ units built by :func:`build_units_in_parallel` inside the block (nested and
    concurrent blocks share one swap; the last to leave puts inductor's function back)."""
    module = inductor_cpp_worker()
    if module is None:
        yield
        return
    with _swap_lock:
        if _swap["depth"] == 0:
            _swap["original"] = module._worker_compile_cpp  # read under the lock: never our own swap
            module._worker_compile_cpp = build_units_in_parallel
        _swap["depth"] += 1
    try:
        yield
    finally:
        with _swap_lock:
            _swap["depth"] -= 1
            if _swap["depth"] == 0:
                module._worker_compile_cpp = _swap["original"]
