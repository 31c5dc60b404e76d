"""The inductor backend genfn compiles its steps with: weights frozen only where freezing pays.

Freezing (inductor's ``freezing``) turns the weights into graph constants so that inductor can
choose and prepack its own GEMM kernels for them. That is worth it only for linears that reach
the library ``F.linear`` (bfloat16 past 4 rows, the encoder-decoder families). Where genfn's native
kernels take every linear (``genfn.kernels.linear``: float32 and bfloat16 decode rows, every
quantized weight) it buys nothing, and it costs every later process its start: a frozen graph
bypasses AOT autograd's on-disk cache, so a second process re-runs the whole AOT pipeline and the
freezing passes (SmolLM2 Q4_1: ~60 s under load, where the cached path loads the compiled graph).

So the backend looks at the graph dynamo traced and turns freezing on only if it holds a
``linear`` call; an explicit ``freezing`` in the user's ``options`` always wins. It also starts
inductor's ISA probe early and builds the C++ wrapper and kernels at once (``genfn.cold_build``).

And it keys inductor's and AOT autograd's on-disk caches on genfn's native libraries. Their keys
hold the graph's code, which names an op but not its signature, so after an op gained an argument
a cached C++ wrapper called it with the old one's (``free(): invalid pointer`` in the next
process). A post-grad pass that does nothing and whose ``uuid`` is the libraries' build keys
(``native_libraries_key``) puts them in both keys: a new build of the kernels compiles its steps
again, once.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F

from genfn.cold_build import parallel_cpp_units, start_vec_isa_probes
from genfn.kernels import native
from genfn.torch_compat import custom_graph_pass_base, inductor_wrapper_base

__all__ = ["InductorFreezingWhereItPays", "native_libraries_key", "library_linears", "with_genfn_backend"]

_logger = logging.getLogger(__name__)

_LIBRARY_LINEARS = (torch._C._nn.linear, F.linear, torch.ops.aten.linear.default)


def library_linears(graph_module: torch.fx.GraphModule) -> int:
    """How many calls to the library linear ``graph_module`` holds (none: the native kernels took all)."""
    return sum(1 for node in graph_module.graph.nodes if node.op == "call_function" and node.target in _LIBRARY_LINEARS)


# torch's inductor backend object (private: genfn.torch_compat checks it is there).
_InductorWrapper = inductor_wrapper_base() or object


@functools.cache
def _native_libraries_key_type() -> type | None:
    # Made on the first compile: its base class lives in inductor, which `import genfn` leaves unloaded.
    base = custom_graph_pass_base()
    if base is None:
        return None

    class NativeLibrariesKey(base):
        """A post-grad pass that leaves the graph as it is; its ``uuid``, the build keys of genfn's
        native libraries (their sources, torch, flags, machine), enters the on-disk caches' keys."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            return None

        def uuid(self) -> str:
            return "genfn-native:" + ",".join(native.library_key(library) for library in native.LIBRARIES)

    return NativeLibrariesKey


def native_libraries_key():
    """The pass that keys inductor's and AOT autograd's on-disk caches on genfn's native libraries
    (module docstring), or None where this torch has no custom passes."""
    key_type = _native_libraries_key_type()
    return None if key_type is None else key_type()


class InductorFreezingWhereItPays(_InductorWrapper):
    """``torch.compile``'s own inductor backend, with ``freezing`` decided per graph (module docstring)."""

    def __init__(self, mode, options, dynamic=None):
        super().__init__(mode, options, dynamic)

    def __call__(self, model_, inputs_, *, config_patches=None):
        patches = dict(config_patches or {})
        if "freezing" not in self.config and "freezing" not in patches:
            linears = library_linears(model_)
            # Freezing needs inference (no grad); a graph traced with grad enabled keeps its weights as inputs.
            patches["freezing"] = linears > 0 and not torch.is_grad_enabled()
            _logger.debug("inductor: %d library linears in the graph, freezing %s", linears,
                          "on" if patches["freezing"] else "off")
        if not _user_post_pass(self.config, patches):
            key_pass = native_libraries_key()
            if key_pass is not None:
                patches["post_grad_custom_post_pass"] = key_pass
            else:
                patches["fx_graph_cache"] = False
        # INFO, so that a CLI user waiting on a first compile reads that the wait is a C++ build.
        _logger.info("inductor: compiling the traced graph (%d ops): seconds from its on-disk cache, "
                     "a minute or more of C++ build the first time", _graph_ops(model_))
        hits_before = _cache_hits()
        start = time.perf_counter()
        # A cold compile's ISA probes and C++ units run beside its Python (genfn.cold_build).
        start_vec_isa_probes(inputs_, {**self.config, **patches})
        with parallel_cpp_units():
            compiled = super().__call__(model_, inputs_, config_patches=patches)
        _logger.info("inductor: %s in %.1f s", "loaded the compiled graph from its cache" if _cache_hits() > hits_before
                     else "generated and built the graph's C++", time.perf_counter() - start)
        return compiled

    def __eq__(self, other):
        return isinstance(other, InductorFreezingWhereItPays) and super().__eq__(other)

    def __hash__(self):
        return id(self)


def _user_post_pass(options: dict, patches: dict) -> bool:
    """Whether the user set inductor's post-grad custom pass (in the options, the patches or the
    global config): theirs runs, and keys the caches as they chose."""
    from torch._inductor import config

    name = "post_grad_custom_post_pass"
    return name in options or name in patches or getattr(config, name, None) is not None


def _graph_ops(graph_module: torch.fx.GraphModule) -> int:
    return sum(1 for node in graph_module.graph.nodes if node.op in ("call_function", "call_method", "call_module"))


def _cache_hits() -> int:
    """AOT autograd's and inductor's on-disk cache hits in this process so far."""
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]


def with_genfn_backend(compile_options: dict) -> dict:
    """``torch.compile`` kwargs with the inductor backend (named or implied) replaced by
    :class:`InductorFreezingWhereItPays` carrying the same ``mode``, ``options`` and ``dynamic``;
    any other backend, or every backend on a torch without inductor's wrapper class, is left as it is."""
    options = dict(compile_options)
    if options.get("backend", "inductor") != "inductor" or _InductorWrapper is object:
        return options
    options["backend"] = InductorFreezingWhereItPays(options.pop("mode", None), options.pop("options", None),
                                                     options.get("dynamic"))
    return options
