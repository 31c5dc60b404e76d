"""The compile boundary: a strategy's pure ``step`` compiled once over the state's tensor leaves, and reused.

DESIGN's boundary: the state is flattened to tensors plus a static treedef outside the compiled
region, and the compiled function maps tensors to tensors. Rebuilding the dataclasses inside it is
plain Python that dynamo traces. The boundary uses torch's own pytree registry (every state class
is registered there too): dynamo traces ``torch.utils._pytree`` natively, while its handling of
optree's C++ treespecs fails inside a compiled frame. Compiled steps are cached on the model (keyed
by the step function, the treedef, which holds every static option, and the leaves' shapes and
dtypes), so later calls with the same shapes reuse them. ``genfn.driver`` runs the loop around them.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
import types
from typing import Any, Callable

import torch

import torch.utils._pytree as torch_pytree

from genfn import kernels
from genfn.kernels import invariant
from genfn.compile_backend import with_genfn_backend
from genfn.config.caches import COMPILABLE_CACHES
from genfn.models.functional import FunctionalModel
from genfn.quant import QUANTIZED_TYPES
from genfn.torch_compat import dynamic_dims, trace_errors
from genfn.torch_compat import while_loop as torch_while_loop
from genfn.traced_unflatten import Bindings, tree_source, unflattener

__all__ = ["compiled_step", "compiled_loop", "eager_step", "functional", "compile_options_for", "own_code",
           "ParamsModule", "StepFn"]

StepFn = Callable[[Any, Any], Any]

_logger = logging.getLogger(__name__)


def functional(model) -> FunctionalModel:
    """The value a step receives: ``model.functional()`` for a ``genfn.Model``, else ``model`` itself."""
    return model.functional() if hasattr(model, "functional") else model


def eager_step(step: StepFn, model) -> Callable[[Any], Any]:
    """The step as a plain Python call (for debugging; the same function that gets compiled, given the
    same kind of model value)."""
    value = functional(model)
    return lambda state: step(value, state)


class ParamsModule(torch.nn.Module):
    """A params pytree held as buffers of an ``nn.Module``.

    Inside ``torch.compile``, tensors read from module buffers are module state that inductor's
    ``freezing`` folds into the graph as constants (like a jitted JAX function closing over
    arrays); it can then pick its own GEMV kernels and prepacked layouts for them. Tensors
    reached any other way stay graph inputs and are left to the library kernels.
    """

    def __init__(self, params):
        super().__init__()
        # Quantized weights stay the objects they are: their tensors feed genfn's own op, which
        # freezing cannot improve, and building 121 of them inside the trace cost dynamo seconds.
        leaves, treedef = torch_pytree.tree_flatten(params, is_leaf=lambda node: isinstance(node, QUANTIZED_TYPES))
        # They are reached as module attributes, never through the builder's own globals: dynamo
        # names a tensor found there after the globals dict's id, which differs per process and
        # made every later process miss AOT autograd's cache.
        kept = set()
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, QUANTIZED_TYPES):
                setattr(self, f"q{i}", leaf)
                kept.add(i)
            else:
                self.register_buffer(f"p{i}", leaf, persistent=False)
        self._build_tree, bound = _literal_tree_builder(treedef, kept)
        for name, value in bound.items():
            setattr(self, name, value)

    def tree(self):
        return self._build_tree(self)


def _literal_tree_builder(treedef, kept: set[int]) -> tuple[Callable[[torch.nn.Module], Any], dict[str, Any]]:
    """``module -> tree of treedef's structure`` with leaf ``i`` read as ``module.p{i}`` (or
    ``module.q{i}`` for ``i`` in ``kept``), written out as one literal expression
    (``genfn.traced_unflatten.tree_source``); what is not a literal is read as an attribute of the
    module, from the returned dict, which the caller sets on it. Dynamo traces torch's generic
    ``tree_unflatten`` at milliseconds per node: for SmolLM2 Q4_1's ~600-node params that was 40 %
    of tracing the decode step, paid again by every process, where the literal costs it a few
    bytecodes per node. Everything is read through the module, none through the builder's globals
    (see ``ParamsModule``)."""
    bindings = Bindings(holder="module")
    leaf_exprs = [f"module.{'q' if i in kept else 'p'}{i}" for i in range(treedef.num_leaves)]
    source = f"def build_tree(module):\n    return {tree_source(treedef, leaf_exprs, bindings)}\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, "<genfn.compile_boundary params tree>", "exec"), namespace)
    return namespace["build_tree"], bindings.names


def _split_leaves(state):
    """Tensor leaves, and the static layout: the treedef plus the non-tensor leaves (None, ints)."""
    leaves, treedef = torch_pytree.tree_flatten(state)
    tensor_slots = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
    constants = tuple((i, leaf) for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor))
    return [leaves[i] for i in tensor_slots], (treedef, tensor_slots, constants)


def _layout_unflattener(layout) -> Callable:
    """``tensors -> state`` for ``layout``, what ``tree_unflatten`` of the leaves gives, but without
    reading the treedef when traced (see ``genfn.traced_unflatten``): inside a compiled step, what
    dynamo reads it guards."""
    treedef, _, constants = layout
    return unflattener(treedef, dict(constants))


# The generated rebuild of each layout the driver has returned states in: between compiled steps
# it rebuilds a state in ~13 us where tree_unflatten walks the treedef in ~35.
_join_code = functools.lru_cache(maxsize=64)(_layout_unflattener)


def _static_shape(tensor: torch.Tensor) -> tuple:
    """The shape with dims marked dynamic (``maybe_mark_dynamic``) replaced by None: those sizes
    vary from call to call under one compiled function, so they must not key the cache."""
    dynamic = dynamic_dims(tensor)
    return tuple(None if dim in dynamic else size for dim, size in enumerate(tensor.shape))


@functools.lru_cache(maxsize=256)
def _canonical_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _with_canonical_strides(tensor: torch.Tensor) -> torch.Tensor:
    # ``is_contiguous`` ignores the strides of size-1 dims, but dynamo's guards do not.
    if tensor.stride() == _canonical_strides(tensor.shape):
        return tensor
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device).copy_(tensor)


def _hashable(value):
    """``value`` with its dicts (``compile_options["options"]`` is one) as sorted item tuples."""
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


# Process-wide: dynamo keys what it learns about a frame (which ints and sizes varied, so that the
# next compile makes them dynamic) by the code's file, line and name. Two models whose steps shared
# a name would share it: after a tiny model, SmolLM2's spec ints compiled as symbols.
_COMPILE_SERIAL = itertools.count()


def own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own, to hand to ``torch.compile``. Dynamo keeps one cache (and
    one recompile budget, 8 by default) per code object; every compiled step is built from the same
    closure code, so without this a process that compiles a few strategies and layouts would exhaust
    that budget, and a new model's frame would be checked against every earlier model's guards (a
    continuous-batching forward of GPT-OSS after one of Llama failed inside dynamo, evaluating the
    Llama graph's guards on GPT-OSS's weights)."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{next(_COMPILE_SERIAL)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _cached_compile(model, kind: str, step: StepFn, state, compile_options: dict | None, build: Callable):
    """``torch.compile(build(value, weights, layout), **compile_options)``, cached on ``model``: ``value``
    is ``functional(model)``, ``weights`` its params as a ``ParamsModule``.

    The key holds ``kind``, the step function, the treedef (which holds every static option) and
    the leaves' shapes and dtypes (dims marked dynamic excluded), so a state with the same
    structure reuses the compiled function without recompiling.
    """
    compile_options = dict(compile_options or {})
    tensors, layout = _split_leaves(state)
    signature = tuple((_static_shape(t), t.dtype) for t in tensors)
    # The batch-invariant mode is read while the step is traced: a graph serves only its own mode.
    cache_key = (kind, step, layout, signature, _hashable(compile_options), invariant.batch_invariant())
    fn = model.compiled_steps.get(cache_key)
    if fn is None:
        # Build/load the native kernels now, not while dynamo traces the model.
        kernels.decode_linear_available()
        # The weights come from module buffers, so freezing (where the backend turns it on) makes them constants.
        value = functional(model)
        fn = torch.compile(own_code(build(value, ParamsModule(value.params), layout)),
                           **_without_weight_guards(with_genfn_backend(compile_options)))
        fn = _announced_first_call(fn, f"compiling the {'decode step' if kind == 'step' else 'decoding loop'}")
        model.compiled_steps[cache_key] = fn
    return fn


# How dynamo's guard entries name the compiled function's ParamsModule (the closure variable
# ``weights`` of ``_step_on_leaves`` / ``_loop_on_leaves``) and what is reached through it.
_WEIGHTS_SOURCE = "weights"


def _keep_guard(entries) -> list[bool]:
    """Dynamo's guards, less those on the weights: the ParamsModule is built for this compiled
    function and closed over by it alone, and its tensors are never replaced, so checking their
    shapes, strides and dtypes before every step can never fail. They were ~1,100 of a SmolLM2
    step's ~1,450 guards (six per weight tensor); dropping them took guard evaluation from 0.42 to
    0.25 ms of a ~10 ms bfloat16 step."""
    return [not (entry.name == _WEIGHTS_SOURCE or entry.name.startswith((_WEIGHTS_SOURCE + ".", _WEIGHTS_SOURCE + "[")))
            for entry in entries]


def _without_weight_guards(compile_options: dict) -> dict:
    """``compile_options`` with ``_keep_guard`` as ``torch.compile``'s ``guard_filter_fn``, unless
    the caller set a filter of their own."""
    options = dict(compile_options)
    inner = dict(options.get("options") or {})
    inner.setdefault("guard_filter_fn", _keep_guard)
    options["options"] = inner
    return options


def _announced_first_call(fn: Callable, what: str) -> Callable:
    """``fn``, logging (INFO, ``genfn.compile_boundary``) when its first call starts and how long it took:
    the first call is the compile, which takes seconds to minutes."""
    state = {"first": True}

    def call(*args):
        if not state["first"]:
            return fn(*args)
        state["first"] = False
        _logger.info("%s (torch.compile)", what)
        start = time.perf_counter()
        result = fn(*args)
        _logger.info("%s: done in %.1f s", what, time.perf_counter() - start)
        return result

    return call


def _canonical_leaves(state) -> tuple[list, tuple]:
    """``_split_leaves(state)`` with every tensor leaf given canonical strides. Dynamo guards on
    strides: a leaf that is a strided view (a column sliced out of a prompt-shaped tensor, say)
    would recompile once per prompt length. Contiguous leaves pass through untouched, so donated
    buffers are never copied."""
    flat, layout = _split_leaves(state)
    return [_with_canonical_strides(t) for t in flat], layout


def _call_on_leaves(fn: Callable, state, *leading):
    """``fn(*leading, *tensor leaves of state)`` rebuilt into a state of ``state``'s layout."""
    flat, layout = _canonical_leaves(state)
    # Inference only (freezing, where the backend turns it on, needs grad disabled).
    with torch.no_grad():
        return _join_code(layout)(fn(*leading, *flat))


class _StepOnLeaves:
    """``state -> state`` through the compiled ``fn`` over the state's tensor leaves, as
    ``_call_on_leaves``, remembering the state it returned with its leaves and layout: the driver
    hands most steps exactly that state back (``limit_attention`` moves the span every 16 slots),
    which then is not flattened, checked and looked up again. Those cost ~0.1 ms a step, ~3 % of a
    SmolLM2 Q4_1 step. The outputs' strides are made canonical before the state is built from them,
    so a remembered state's leaves are what ``_call_on_leaves`` would hand ``fn``."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.last = None  # (the state returned, its canonical leaves, its layout, the layout's rebuild)

    def __call__(self, state):
        last = self.last
        if last is not None and last[0] is state:
            _, flat, layout, join = last
        else:
            flat, layout = _canonical_leaves(state)
            join = _join_code(layout)
        self.last = None  # nothing outlives a failed step
        with torch.no_grad():
            out = [_with_canonical_strides(t) for t in self.fn(*flat)]
        stepped = join(out)
        self.last = (stepped, out, layout, join)
        return stepped


def _step_on_leaves(step: StepFn, value, weights: ParamsModule, layout) -> Callable:
    join = _layout_unflattener(layout)

    def tensors_to_tensors(*flat):
        new_tensors, _ = _split_leaves(step(value.with_params(weights.tree()), join(flat)))
        return tuple(new_tensors)

    return tensors_to_tensors


def _with_own_errors(compiled: Callable[[Any], Any], step: StepFn, model) -> Callable[[Any], Any]:
    """``compiled``, except that an exception the step raises while it is traced reaches the caller
    as itself (its type and message), not as dynamo's wrapper: the step runs eagerly once on the same
    state (tracing touched no real buffer) and its own exception propagates. A model whose spec sets
    ``compile_fallback`` (a wrapped ``nn.Module``) keeps that eager result when the step itself
    succeeded, and runs eagerly from then on."""
    fallback_key = ("eager_fallback", step)

    def call(state):
        if model.compiled_steps.get(fallback_key):
            return eager_step(step, model)(state)
        try:
            return compiled(state)
        except trace_errors() as traced:
            result = eager_step(step, model)(state)
            if not getattr(model.spec, "compile_fallback", False):
                raise traced
            # A wrapped nn.Module (genfn.from_module) that dynamo cannot trace runs eagerly instead:
            # its step just worked, so only the compile failed. Said once per model and step.
            model.compiled_steps[fallback_key] = True
            _logger.warning("genfn: %s does not trace under torch.compile (%s: %s); its decode step runs eagerly",
                            model.spec, type(traced).__name__, str(traced).splitlines()[0][:200])
            return result

    return call


def compiled_step(step: StepFn, model, state, compile_options: dict | None = None) -> Callable[[Any], Any]:
    """``state -> state`` running ``torch.compile``'d ``step`` for states shaped like ``state``.

    The compiled function is cached on ``model``; a state with the same structure, static options,
    shapes and dtypes reuses it without recompiling.
    """
    if model.compiled_steps.get(("eager_fallback", step)):
        return eager_step(step, model)
    fn = _cached_compile(model, "step", step, state, compile_options,
                         lambda value, weights, layout: _step_on_leaves(step, value, weights, layout))
    return _with_own_errors(_StepOnLeaves(fn), step, model)


def _loop_on_leaves(step: StepFn, value, weights: ParamsModule, layout) -> Callable:
    while_loop = torch_while_loop()
    one_step = _step_on_leaves(step, value, weights, layout)
    join = _layout_unflattener(layout)

    def whole_loop(num_steps, *flat):
        def keep_going(i, *carried):
            return (i < num_steps) & ~join(carried).done.all()

        def advance(i, *carried):
            return (i + 1, *one_step(*[t.clone() for t in carried]))  # no in-place update of carried state

        start = torch.zeros((), dtype=torch.int64, device=num_steps.device)
        return while_loop(keep_going, advance, (start, *flat))[1:]

    return whole_loop


def compiled_loop(step: StepFn, model, state, compile_options: dict | None = None) -> Callable[[Any, int], Any]:
    """``(state, num_steps) -> state``: the whole decoding loop as one graph.

    The loop is torch's ``while_loop`` higher-order op: up to ``num_steps`` applications of
    ``step``, ending early once every row is done, with no return to Python in between. The step
    count is a tensor input, so every ``max_new_tokens`` shares one compile; the state's shapes
    must stay fixed across iterations, so attention reads the whole cache (no span).
    ``compile_options=None`` runs the same ``while_loop`` eagerly (``disable_compile``).

    ``while_loop`` forbids its body from mutating or aliasing the carried state, so each iteration
    starts by copying the state, cache included: O(cache) bytes per step in exchange for no
    per-step Python, guard checks or launch round trips. That pays off where those dominate
    (small models); on SmolLM2 the copies cost more than they save (benchmarks/decode.py).
    """
    if compile_options is None:
        value = functional(model)
        fn = _loop_on_leaves(step, value, ParamsModule(value.params), _split_leaves(state)[1])
    else:
        fn = _cached_compile(model, "while_loop", step, state, compile_options,
                             lambda value, weights, layout: _loop_on_leaves(step, value, weights, layout))

    def run(state, num_steps: int):
        steps = torch.tensor(num_steps, dtype=torch.int64, device=state.done.device)
        try:
            return _call_on_leaves(fn, state, steps)
        except trace_errors() as traced:
            # while_loop traces its body even when run eagerly, and reports whatever the step raised
            # as its own "higher order operator" error: one eager step on the same state (tracing
            # touched no real buffer) raises the step's exception itself, type and message.
            with torch.no_grad():
                eager_step(step, model)(state)
            raise traced

    return run


# What a CPU step compiles with when compile_config names no mode (or transformers' default,
# "reduce-overhead", which means CUDA graphs and does nothing on a CPU): the options of mode
# "max-autotune-no-cudagraphs" plus the C++ wrapper. max-autotune lets inductor pick its own GEMM
# kernels for the frozen weights wherever genfn's decode kernel does not take a linear (bfloat16
# past 4 rows); the C++ wrapper calls the step's ~500 kernels without Python in between (SmolLM2
# bf16 b=1: 18.4 -> 16.6 ms/step, f32 b=8: 44.7 -> 43.6, interleaved in one process).
# The wrapper is built apart from the kernels (``cpp_wrapper_build_separate``): one translation
# unit of ~13,000 lines of shim calls at -O1 beside the kernels at -O3, where a single -O3 unit
# was most of a cold compile (SmolLM2 Q4_1, g++ CPU seconds: 10.6 wrapper + 7.3 kernels, in
# parallel, against 104 as one unit), with steady ms/step unchanged (interleaved A/B: 7.06 vs 7.27
# under load). Where genfn's kernels take every linear
# (nothing to autotune) max-autotune and coordinate descent change no generated line: measured,
# the compile reused the other's C++ byte for byte.
# Without inductor's size asserts: the C++ wrapper checks every input's sizes and strides on every
# call, building a string and a std::stringstream for each (~440 inputs on SmolLM2, the weights
# among them): 1-3 % of a SmolLM2 Q4_1 step, same tokens (`benchmarks/lookup_steps.py --inductor-option
# size_asserts=True`: 0.8-2.1 % a plain step, 2.8-3.4 % an 8-row round). The driver already guarantees
# what they check: it keys each compiled step on its leaves' static shapes and dtypes and hands it
# canonical strides (``_canonical_leaves``), and the weights it closes over never change.
_CPU_COMPILE_OPTIONS = {"max_autotune": True, "coordinate_descent_tuning": True, "cpp_wrapper": True,
                        "cpp_wrapper_build_separate": True, "size_asserts": False}


def compile_options_for(config, device: torch.device, whole_loop: bool = False) -> dict | None:
    """The ``torch.compile`` kwargs for a generation config, or None for the eager path.

    Compiles only for a fixed-shape cache (``cache_implementation`` in ``COMPILABLE_CACHES``)
    unless ``disable_compile``; ``compile_config`` passes options through.
    """
    if config.disable_compile or config.cache_implementation not in COMPILABLE_CACHES:
        return None
    compile_config = config.compile_config
    options = {"fullgraph": True}
    if compile_config is not None:
        options = {k: v for k, v in compile_config.to_dict().items() if v is not None}
    mode = options.get("mode")
    if mode == "reduce-overhead" or (mode is None and "options" not in options):
        if device.type == "cpu" and options.get("backend", "inductor") == "inductor":
            options.pop("mode", None)  # torch.compile takes a mode or options, not both
            options["options"] = dict(_CPU_COMPILE_OPTIONS)
            if whole_loop:
                # A while_loop's C++ wrapper inlines every layer's kernels into one ~1 MB source
                # (SmolLM2: over 8 minutes of g++ -O3); the loop has no per-step Python to save.
                options["options"].pop("cpp_wrapper")
                options["options"].pop("cpp_wrapper_build_separate")
        else:
            options.pop("mode", None)  # CUDA graphs would capture the donated buffers' addresses
    return options
