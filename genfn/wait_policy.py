"""How long genfn's threads spin before they sleep, set before torch starts its OpenMP runtime.

torch here runs its thread pool on GNU OpenMP (libgomp), and so do the native kernels
(``at::parallel_for``) and inductor's compiled C++. Between two parallel regions libgomp's idle
threads spin for ``GOMP_SPINCOUNT`` iterations (300 000 by default, some milliseconds) before
they sleep. A decode step runs hundreds of short regions, so on a quiet machine spinning
saves a wake-up per region; beside another busy process it is a collapse, because the spinning
thread keeps the core the working thread needs (measured here: 1.5 tok/s with the default spin,
14 tok/s with ``OMP_WAIT_POLICY=PASSIVE``, which sleeps at once).

``benchmarks/contention.py`` measures each choice quiet and beside a competing process. On this
2-core machine no fixed setting served both: OpenMP's default spin was fastest quiet (92 tok/s,
Q4_1, where passive gave 45-68) and collapsed beside a busy loop (2-25 tok/s against passive's
18-62); every bounded spin of 300 iterations or more lost about half of passive's speed under
load, and 100 iterations was passive. So genfn chooses when it is imported, from the machine's
state then (``/proc/loadavg``): :data:`BUSY_POLICY` (passive) when other work holds half a core
or more, else :data:`QUIET_POLICY` (a short bounded spin, so that a competitor arriving later
costs far less than under the default spin). A process keeps its choice: libgomp reads its
settings once, when it is loaded, so ``import genfn`` sets them only if torch is not imported
yet, and only if the user set none of ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` or
``GENFN_WAIT_POLICY`` (``GENFN_WAIT_POLICY=default`` keeps OpenMP's own policy).
:func:`wait_policy` says what is in effect and why.
"""

from __future__ import annotations

import os
import sys

__all__ = ["BUSY_POLICY", "QUIET_POLICY", "BUSY_LOAD", "apply_default", "other_load", "wait_policy"]

# What import genfn sets (benchmarks/contention.py; module docstring).
BUSY_POLICY = {"OMP_WAIT_POLICY": "PASSIVE"}
QUIET_POLICY = {"GOMP_SPINCOUNT": "1000"}
# Other work, in cores, from which the machine counts as busy.
BUSY_LOAD = 0.5
_USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "GENFN_WAIT_POLICY")

# What apply_default() did, and why.
_outcome = "not applied"


def other_load(loadavg_text: str | None = None) -> float:
    """Cores' worth of work other than this process: the larger of the 1-minute load average and
    the processes runnable right now besides this one (``/proc/loadavg``); 0.0 where unreadable."""
    try:
        if loadavg_text is None:
            with open("/proc/loadavg") as f:
                loadavg_text = f.read()
        fields = loadavg_text.split()
        runnable = int(fields[3].split("/")[0])
        return max(float(fields[0]), float(runnable - 1))
    except (OSError, ValueError, IndexError):
        return 0.0


def apply_default(environ=None, torch_loaded: bool | None = None, load: float | None = None) -> str:
    """Set :data:`BUSY_POLICY` or :data:`QUIET_POLICY` in ``environ`` (default ``os.environ``) by
    ``load`` (default :func:`other_load`), unless the user chose a policy or torch (and so
    libgomp) is already loaded; returns what it did."""
    global _outcome
    environ = os.environ if environ is None else environ
    torch_loaded = "torch" in sys.modules if torch_loaded is None else torch_loaded
    chosen = [name for name in _USER_SETTINGS if environ.get(name)]
    if chosen:
        outcome = f"left to the environment ({', '.join(f'{n}={environ[n]}' for n in chosen)})"
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
