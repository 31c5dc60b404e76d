"""The private torch internals genfn's driver relies on, behind one module.

genfn is tested on torch 2.13 (``TESTED_TORCH``). What it uses that is not public API, and may
move between releases:

- ``tensor._dynamo_weak_dynamic_indices`` / ``_dynamo_dynamic_indices``: which dims
  ``torch._dynamo.maybe_mark_dynamic`` marked, so that those sizes do not key the driver's cache
  of compiled steps. Without them every size keys it: correct, but a new attended span compiles
  again.
- ``torch._dynamo.eval_frame._stance``: the stance in effect, so that the driver's
  ``skip_guard_eval_unsafe`` keeps the user's own stance. Without it the driver evaluates every
  guard (about 0.15 ms a step slower, same tokens).
- ``torch._TorchCompileInductorWrapper``: the inductor backend ``torch.compile`` builds, which
  ``genfn.compile_backend`` subclasses to decide ``freezing`` per graph. Without it the step
  compiles with plain ``backend="inductor"`` (a later process may miss inductor's caches).
- ``fn._dynamo_marked_constant``: the mark ``torch.compiler.assume_constant_result`` leaves,
  set by ``constant_result`` without importing dynamo (the public decorator imports it: 1.1-1.3
  CPU s of every ``import genfn``, for an eager run that never traces). A test checks that the public
  decorator still leaves this mark.

- ``torch._inductor.cpu_vec_isa.valid_vec_isa_list`` (inductor's cached vector-ISA probe) and
  ``torch._inductor.codecache._worker_compile_cpp`` (the function that runs a C++ library's g++
  jobs): ``genfn.cold_build`` runs the first earlier, in a thread, and has the second's separate
  units built at once. Without them a cold compile runs both serially, as inductor does.
  ``torch._inductor.runtime.cache_dir_utils.cache_dir``: where those probes' libraries go.
  ``torch._inductor.compile_fx`` is imported before that thread starts, so that the two threads never
  initialize inductor's modules at once.
- ``torch._inductor.custom_graph_pass.CustomGraphPass``: a post-grad pass whose ``uuid`` enters
  inductor's and AOT autograd's on-disk cache keys, through which ``genfn.compile_backend`` keys
  them on genfn's native libraries. Without it those caches can hand a process a compiled wrapper
  built against another build's op signatures (genfn then turns inductor's graph cache off for its
  steps).

Each accessor falls back to public API when the internal is missing and says so once, in one
line on the ``genfn.torch_compat`` logger; an untested torch version is noted the same way.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from pathlib import Path
from typing import Callable

import torch

__all__ = ["TESTED_TORCH", "torch_is_tested", "dynamic_dims", "trusted_guards", "inductor_wrapper_base",
           "while_loop", "constant_result", "CONSTANT_RESULT_MARK", "trace_errors", "inductor_vec_isa_probe",
           "inductor_cpp_worker", "inductor_cache_dir", "import_inductor_compiler", "custom_graph_pass_base"]

# The torch releases (major.minor) the test suite runs on; pyproject.toml's range says the same.
TESTED_TORCH = ("2.13",)

_logger = logging.getLogger(__name__)
_noted: set[str] = set()


def _note_once(what: str, fallback: str) -> None:
    if what not in _noted:
        _noted.add(what)
        _logger.warning("torch %s lacks %s (genfn is tested on torch %s): %s", torch.__version__, what,
                        "/".join(TESTED_TORCH), fallback)


def torch_is_tested(version: str | None = None) -> bool:
    """Whether ``version`` (default: the torch in use) is a release genfn's tests run on.

    >>> torch_is_tested("2.13.0+cpu"), torch_is_tested("2.12.1")
    (True, False)
    """
    release = ".".join((version or torch.__version__).split("+")[0].split(".")[:2])
    return release in TESTED_TORCH


def dynamic_dims(tensor: torch.Tensor) -> set[int]:
    """The dims of ``tensor`` marked dynamic for dynamo (``maybe_mark_dynamic`` or ``mark_dynamic``)."""
    if not _marks_readable():
        return set()
    return set(getattr(tensor, "_dynamo_weak_dynamic_indices", ())) | set(getattr(tensor, "_dynamo_dynamic_indices", ()))


@functools.cache
def _marks_readable() -> bool:
    """Whether ``maybe_mark_dynamic`` still leaves its mark where ``dynamic_dims`` reads it."""
    probe = torch.empty(2)
    torch._dynamo.maybe_mark_dynamic(probe, 0)
    if 0 in getattr(probe, "_dynamo_weak_dynamic_indices", ()):
        return True
    _note_once("tensor._dynamo_weak_dynamic_indices", "every size keys the cache of compiled steps")
    return False


def trusted_guards() -> contextlib.AbstractContextManager:
    """A context in which dynamo checks only the guards that tell compiled entries apart
    (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``), keeping the user's stance; a
    null context when the user set a stance of their own or the stance cannot be read."""
    try:
        current = torch._dynamo.eval_frame._stance
        set_stance = torch.compiler.set_stance
    except AttributeError:
        _note_once("torch._dynamo.eval_frame._stance", "every guard is evaluated before each compiled step")
        return contextlib.nullcontext()
    if current.stance != "default" or current.skip_guard_eval_unsafe:
        return contextlib.nullcontext()
    return set_stance("default", skip_guard_eval_unsafe=True, force_backend=current.backend)


# The attribute torch.compiler.assume_constant_result sets on the function it marks (torch 2.13).
CONSTANT_RESULT_MARK = "_dynamo_marked_constant"


def constant_result(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result(fn)``, without importing dynamo when nothing has:
    dynamo reads the mark when it traces a call to ``fn``, and that import is then dynamo's own."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    setattr(fn, CONSTANT_RESULT_MARK, True)
    return fn


@functools.cache
def trace_errors() -> tuple[type[BaseException], ...]:
    """What dynamo raises when the traced code raised, or failed on values a plain run would report
    better. Read when a compiled step fails (dynamo is loaded by then), never at ``import genfn``."""
    import torch._dynamo.exc as dynamo_errors

    return tuple(getattr(dynamo_errors, name) for name in
                 ("Unsupported", "UserError", "UncapturedHigherOrderOpError", "TorchRuntimeError",
                  "BackendCompilerFailed", "InternalTorchDynamoError") if hasattr(dynamo_errors, name))


def inductor_wrapper_base() -> type | None:
    """``torch._TorchCompileInductorWrapper`` (the backend object ``torch.compile`` builds for
    inductor), or None when this torch has no such class."""
    base = getattr(torch, "_TorchCompileInductorWrapper", None)
    if base is None:
        _note_once("torch._TorchCompileInductorWrapper", "steps compile with plain backend='inductor'")
    return base


def custom_graph_pass_base() -> type | None:
    """``torch._inductor.custom_graph_pass.CustomGraphPass`` (an inductor pass whose ``uuid`` keys
    the on-disk caches), or None when this torch has no such class."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:
        _note_once("torch._inductor.custom_graph_pass.CustomGraphPass",
                   "genfn's compiled steps skip inductor's on-disk caches")
        return None
    return CustomGraphPass


def import_inductor_compiler() -> None:
    """Import inductor's compiler (``torch._inductor.compile_fx`` and the modules it pulls in) in the
    calling thread. A thread that starts importing inductor while another imports the same circle
    of modules can see one half-initialized: a second process's compile failed with
    ``cannot import name 'dependencies' from 'torch._inductor'`` while the ISA probe thread ran."""
    try:
        import torch._inductor.compile_fx  # noqa: F401
    except ImportError:  # torch.compile would fail the same way, and say why
        _note_once("torch._inductor.compile_fx", "the ISA probe thread imports inductor beside the compile")


def inductor_vec_isa_probe() -> Callable | None:
    """Inductor's ``valid_vec_isa_list`` (a ``functools.cache``: it probes once per process), or
    None when this torch has no such function. Imports inductor: call it from a compile."""
    try:
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    except ImportError:
        valid_vec_isa_list = None
    if not hasattr(valid_vec_isa_list, "cache_info"):
        _note_once("torch._inductor.cpu_vec_isa.valid_vec_isa_list", "the ISA probe runs when inductor asks")
        return None
    return valid_vec_isa_list


def inductor_cache_dir() -> Path:
    """The directory inductor's on-disk caches live in (``TORCHINDUCTOR_CACHE_DIR`` or its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def inductor_cpp_worker():
    """``torch._inductor.codecache``, the module whose ``_worker_compile_cpp`` builds a C++
    library's g++ jobs, or None when this torch has no such function. Imports inductor: call it
    from a compile."""
    import torch._inductor.codecache as codecache

    if getattr(codecache, "_worker_compile_cpp", None) is None:
        _note_once("torch._inductor.codecache._worker_compile_cpp", "a C++ library's units build one after another")
        return None
    return codecache


def while_loop():
    """torch's ``while_loop`` higher-order op (public as ``torch.while_loop`` from 2.13 on)."""
    public = getattr(torch, "while_loop", None)
    if public is not None:
        return public
    from torch._higher_order_ops.while_loop import while_loop as private

    return private


if not torch_is_tested():
    _logger.warning("genfn is tested on torch %s; this is torch %s (pip install torch==2.13.0)",
                    "/".join(TESTED_TORCH), torch.__version__)
