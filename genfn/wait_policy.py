"""How long genfn's threads spin before they sleep, set before torch starts its OpenMP runtime.

torch here runs its thread pool on GNU OpenMP (libgomp), and so do the native kernels
(``at::parallel_for``) and inductor's compiled C++. Between two parallel regions libgomp's idle
threads spin for ``GOMP_SPINCOUNT`` iterations (300 000 by default, some milliseconds) before
they sleep, and so do the threads of genfn's native decode stack at the barriers where they
meet inside a region (``genfn/kernels/team_barrier.h`` reads the same settings the same way: one
policy for both). A decode step runs hundreds of short regions, so on a quiet machine spinning
saves a wake-up per region; beside another busy process it is a collapse, because the spinning
thread keeps the core the working thread needs (measured here: 1.5 tok/s with the default spin,
14 tok/s with ``OMP_WAIT_POLICY=PASSIVE``, which sleeps at once).

``benchmarks/contention.py`` measures each choice quiet and beside a competing process. On this
2-core machine no fixed setting served both (Q4_1, compiled step, run 4 in benchmarks/results):
OpenMP's default spin was fastest quiet (129 tok/s; passive 49, its sleeping threads wake
slowly on idle cores) and lost most of it beside a busy loop (29 tok/s; passive 70). A bounded
spin of 1000 iterations kept 0.92 of the quiet figure and reached 0.5-0.8 of passive's under
load (runs 2-4); 300 and more iterations lost about half under load, 100 behaved like passive.
So genfn's own programs choose, from the machine's state when they start (:func:`other_load`:
the CPU time other processes take over 50 ms): :data:`BUSY_POLICY` (passive) when other work
holds half a core or more, else :data:`QUIET_POLICY` (the bounded spin, so that a competitor
arriving later costs far less than under the default spin). libgomp reads its settings once, when
torch loads it, so the choice is made in ``genfn/__init__.py`` before torch is imported, and only
where the process is genfn's command line (``genfn ...``, ``python -m genfn ...``, ranks started
by ``torchrun -m genfn``) or the user asked for it with ``GENFN_WAIT_POLICY=auto``. A program that
merely imports genfn as a library keeps its environment as it was: the policy is process-wide and
the program's to choose (set ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` or ``GENFN_WAIT_POLICY=auto``
before starting Python). Nothing is set either where the user chose (``OMP_WAIT_POLICY``,
``GOMP_SPINCOUNT``, or ``GENFN_WAIT_POLICY=default``) or torch is loaded already.
:func:`wait_policy` says what is in effect and why.
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["AUTO", "BUSY_POLICY", "QUIET_POLICY", "BUSY_LOAD", "apply_default", "launched_as_cli", "other_load",
           "wait_policy"]

# What import genfn sets (benchmarks/contention.py; module docstring).
BUSY_POLICY = {"OMP_WAIT_POLICY": "PASSIVE"}
QUIET_POLICY = {"GOMP_SPINCOUNT": "1000"}
# Other work, in cores, from which the machine counts as busy, and how long import genfn samples it.
BUSY_LOAD = 0.5
SAMPLE_S = 0.05
_USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "GENFN_WAIT_POLICY")
# GENFN_WAIT_POLICY=auto: a library user's opt-in to the choice genfn's command line makes.
AUTO = "auto"
_CLI_MODULES = ("genfn", "genfn.cli", "genfn.__main__")
_OPTIONS_WITH_VALUE = ("-X", "-W", "--check-hash-based-pycs")

# What apply_default() did, and why.
_outcome = "not applied"


def _cpu_ticks(stat_text: str) -> tuple[int, int]:
    """(busy, total) clock ticks over all CPUs from the first line of ``/proc/stat``."""
    values = [int(v) for v in stat_text.splitlines()[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values[:8]) - idle, sum(values[:8])


def _own_ticks() -> int:
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def other_load(window_s: float = SAMPLE_S) -> float:
    """Cores' worth of work other than this process, measured over ``window_s`` from
    ``/proc/stat`` (all CPUs) minus this process's own ticks; 0.0 where unreadable. Sampled, not
    the load average: that lags a minute behind, so it still counts processes that just ended."""
    try:
        with open("/proc/stat") as f:
            busy0, total0 = _cpu_ticks(f.read())
        own0, start = _own_ticks(), time.monotonic()
        time.sleep(window_s)
        with open("/proc/stat") as f:
            busy1, total1 = _cpu_ticks(f.read())
        own1, elapsed = _own_ticks(), time.monotonic() - start
    except (OSError, ValueError, IndexError):
        return 0.0
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    load = max(0.0, (busy1 - busy0) - (own1 - own0)) / ticks_per_s / max(elapsed, 1e-3)
    # Ticks are whole (10 ms each at 100 Hz): a short window can count one more than it held,
    # which once read 2.18 cores of other work on a 2-core machine.
    return min(load, float(os.cpu_count() or 1))


def launched_as_cli(argv: list[str] | None = None) -> bool:
    """Whether the process is genfn's command line: ``genfn ...`` (the console script) or
    ``python [flags] -m genfn ...`` (what ``torchrun -m genfn`` starts on each rank). ``argv`` is
    the interpreter's own command line (default ``sys.orig_argv``)."""
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    words = iter(argv[1:])
    for word in words:  # the interpreter's options, up to what it runs
        if word == "-m":
            return next(words, None) in _CLI_MODULES
        if word == "-c" or word == "-":
            return False
        if word in _OPTIONS_WITH_VALUE:
            next(words, None)
        elif not word.startswith("-"):
            return os.path.basename(word) == "genfn"  # the console script
    return False


def apply_default(environ=None, torch_loaded: bool | None = None, load: float | None = None,
                  argv: list[str] | None = None) -> str:
    """In genfn's command line (:func:`launched_as_cli` on ``argv``) or with
    ``GENFN_WAIT_POLICY=auto``, set :data:`BUSY_POLICY` or :data:`QUIET_POLICY` in ``environ``
    (default ``os.environ``) by ``load`` (default :func:`other_load`), unless the user chose a
    policy or torch (and so libgomp) is already loaded; returns what it did."""
    global _outcome
    environ = os.environ if environ is None else environ
    torch_loaded = "torch" in sys.modules if torch_loaded is None else torch_loaded
    opted_in = environ.get("GENFN_WAIT_POLICY") == AUTO
    chosen = [name for name in _USER_SETTINGS if environ.get(name) and not (name == "GENFN_WAIT_POLICY" and opted_in)]
    if chosen:
        outcome = f"left to the environment ({', '.join(f'{n}={environ[n]}' for n in chosen)})"
    elif not (opted_in or launched_as_cli(argv)):
        outcome = ("OpenMP's default (genfn sets no policy when imported as a library; set OMP_WAIT_POLICY, "
                   "GOMP_SPINCOUNT or GENFN_WAIT_POLICY=auto before starting Python)")
    elif torch_loaded:
        outcome = "OpenMP's default (torch was imported before genfn; set OMP_WAIT_POLICY or GOMP_SPINCOUNT to choose)"
    else:
        load = other_load() if load is None else load
        policy = BUSY_POLICY if load >= BUSY_LOAD else QUIET_POLICY
        environ.update(policy)
        setting = ", ".join(f"{k}={v}" for k, v in policy.items())
        outcome = f"{setting} (genfn's choice: other load {load:.2f} cores {'>=' if load >= BUSY_LOAD else '<'} {BUSY_LOAD})"
    if environ is os.environ:
        _outcome = outcome
    return outcome


def wait_policy() -> str:
    """The OpenMP wait policy in effect for this process, and who chose it."""
    return _outcome
