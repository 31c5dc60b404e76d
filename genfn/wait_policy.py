"""How long genfn's threads spin before they sleep, set before torch starts its OpenMP runtime.

torch here runs its thread pool on GNU OpenMP (libgomp), and so do the native kernels
(``at::parallel_for``) and inductor's compiled C++. Between two parallel regions libgomp's idle
threads spin for ``GOMP_SPINCOUNT`` iterations (300 000 by default, some milliseconds) before
they sleep. A decode step runs hundreds of short regions, so on a quiet machine spinning
saves a wake-up per region; beside another busy process it is a collapse, because the spinning
thread keeps the core the working thread needs (measured here: 1.5 tok/s with the default spin,
14 tok/s with ``OMP_WAIT_POLICY=PASSIVE``, which sleeps at once).

``benchmarks/contention.py`` measures each choice quiet and beside a competing process; the
bounded spin :data:`DEFAULT_SPINCOUNT` is the one that stays close to the passive figure under
load and close to the default spin when quiet. libgomp reads its settings once, when it is
loaded, so ``import genfn`` sets it only if torch is not imported yet, and only if the user set
none of ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` or ``GENFN_WAIT_POLICY`` (``GENFN_WAIT_POLICY=default``
keeps OpenMP's own policy). :func:`wait_policy` says what is in effect.
"""

from __future__ import annotations

import os
import sys

__all__ = ["DEFAULT_SPINCOUNT", "apply_default", "wait_policy"]

# Spin iterations before an idle OpenMP thread sleeps (benchmarks/contention.py).
DEFAULT_SPINCOUNT = 10_000
_USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_OPT_OUT = "GENFN_WAIT_POLICY"

# What apply_default() did: "set", or why it left the settings alone.
_outcome = "not applied"


def apply_default(environ=None, torch_loaded: bool | None = None) -> str:
    """Set ``GOMP_SPINCOUNT=DEFAULT_SPINCOUNT`` in ``environ`` (default ``os.environ``) unless the
    user chose a policy or torch (and so libgomp) is already loaded; returns what it did."""
    global _outcome
    environ = os.environ if environ is None else environ
    torch_loaded = "torch" in sys.modules if torch_loaded is None else torch_loaded
    chosen = [name for name in (*_USER_SETTINGS, _OPT_OUT) if environ.get(name)]
    if chosen:
        outcome = f"left to the environment ({', '.join(f'{n}={environ[n]}' for n in chosen)})"
    elif torch_loaded:
        outcome = "OpenMP default (torch was imported before genfn; set GOMP_SPINCOUNT to choose)"
    else:
        environ["GOMP_SPINCOUNT"] = str(DEFAULT_SPINCOUNT)
        outcome = f"GOMP_SPINCOUNT={DEFAULT_SPINCOUNT} (genfn's default)"
    if environ is os.environ:
        _outcome = outcome
    return outcome


def wait_policy() -> str:
    """The OpenMP wait policy in effect for this process, and who chose it."""
    return _outcome
