"""The small loop that runs a strategy's pure ``step``: eagerly, or compiled once and reused.

The compile boundary follows DESIGN: the state is flattened to tensors plus a static treedef
outside the compiled region, and the compiled function maps tensors to tensors. Rebuilding the
dataclasses inside it is plain Python that dynamo traces. The boundary uses torch's own pytree
registry (every state class is registered there too): dynamo traces ``torch.utils._pytree``
natively, while its handling of optree's C++ treespecs fails inside a compiled frame. Compiled steps are cached on the model
(keyed by the step function, the treedef, which holds every static option, and the leaves'
shapes and dtypes), so later calls with the same shapes reuse them.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

import torch._inductor.config
import torch.utils._pytree as torch_pytree

from genfn import kernels
from genfn.models.model import BoundModel, ParamsModule

__all__ = ["run_loop", "compiled_step", "compiled_loop", "eager_step", "limit_attention"]

StepFn = Callable[[Any, Any], Any]


def eager_step(step: StepFn, model) -> Callable[[Any], Any]:
    """The step as a plain Python call (for debugging; the same function that gets compiled)."""
    return lambda state: step(model, state)


def _split_leaves(state):
    """Tensor leaves, and the static layout: the treedef plus the non-tensor leaves (None, ints)."""
    leaves, treedef = torch_pytree.tree_flatten(state)
    tensor_slots = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
    constants = tuple((i, leaf) for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor))
    return [leaves[i] for i in tensor_slots], (treedef, tensor_slots, constants)


def _join_leaves(tensors, layout):
    treedef, tensor_slots, constants = layout
    leaves: list = [None] * (len(tensor_slots) + len(constants))
    for i, tensor in zip(tensor_slots, tensors):
        leaves[i] = tensor
    for i, value in constants:
        leaves[i] = value
    return torch_pytree.tree_unflatten(leaves, treedef)


def _static_shape(tensor: torch.Tensor) -> tuple:
    """The shape with dims marked dynamic (``maybe_mark_dynamic``) replaced by None: those sizes
    vary from call to call under one compiled function, so they must not key the cache."""
    dynamic = getattr(tensor, "_dynamo_weak_dynamic_indices", set()) | getattr(tensor, "_dynamo_dynamic_indices", set())
    return tuple(None if dim in dynamic else size for dim, size in enumerate(tensor.shape))


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


def limit_attention(state, num_slots: int):
    """``state`` with its cache's attention limited to ``num_slots`` slots, when the cache supports it."""
    cache = getattr(state, "cache", None)
    if cache is None or not hasattr(cache, "with_span"):
        return state
    return state.replace(cache=cache.with_span(num_slots))


def _hashable(value):
    """``value`` with its dicts (``compile_options["options"]`` is one) as sorted item tuples."""
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


def _cached_compile(model, kind: str, step: StepFn, state, compile_options: dict | None, build: Callable):
    """``torch.compile(build(weights, layout), **compile_options)``, cached on ``model``.

    The key holds ``kind``, the step function, the treedef (which holds every static option) and
    the leaves' shapes and dtypes (dims marked dynamic excluded), so a state with the same
    structure reuses the compiled function without recompiling.
    """
    compile_options = dict(compile_options or {})
    tensors, layout = _split_leaves(state)
    signature = tuple((_static_shape(t), t.dtype) for t in tensors)
    cache_key = (kind, step, layout, signature, _hashable(compile_options))
    fn = model.compiled_steps.get(cache_key)
    if fn is None:
        # Build/load the native kernels now, not while dynamo traces the model.
        kernels.decode_linear_available()
        # The weights come from module buffers, so freezing makes them constants.
        fn = torch.compile(build(ParamsModule(model.params), layout), **compile_options)
        model.compiled_steps[cache_key] = fn
    return fn


def _call_on_leaves(fn: Callable, state, *leading):
    """``fn(*leading, *tensor leaves of state)`` rebuilt into a state of ``state``'s layout."""
    flat, layout = _split_leaves(state)
    # Dynamo guards on strides: a leaf that is a strided view (a column sliced out of a
    # prompt-shaped tensor, say) would recompile once per prompt length. Contiguous leaves
    # pass through untouched, so donated buffers are never copied.
    flat = [_with_canonical_strides(t) for t in flat]
    # Inference only: freezing folds the weights into constants (it needs grad disabled).
    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        return _join_leaves(fn(*leading, *flat), layout)


def _step_on_leaves(step: StepFn, model, weights: ParamsModule, layout) -> Callable:
    def tensors_to_tensors(*flat):
        bound = BoundModel(model, weights.tree())
        new_tensors, _ = _split_leaves(step(bound, _join_leaves(flat, layout)))
        return tuple(new_tensors)

    return tensors_to_tensors


def compiled_step(step: StepFn, model, state, compile_options: dict | None = None) -> Callable[[Any], Any]:
    """``state -> state`` running ``torch.compile``'d ``step`` for states shaped like ``state``.

    The compiled function is cached on ``model``; a state with the same structure, static options,
    shapes and dtypes reuses it without recompiling.
    """
    fn = _cached_compile(model, "step", step, state, compile_options,
                         lambda weights, layout: _step_on_leaves(step, model, weights, layout))
    return lambda state: _call_on_leaves(fn, state)


def _loop_on_leaves(step: StepFn, model, weights: ParamsModule, layout) -> Callable:
    from torch._higher_order_ops.while_loop import while_loop

    one_step = _step_on_leaves(step, model, weights, layout)

    def whole_loop(num_steps, *flat):
        def keep_going(i, *carried):
            return (i < num_steps) & ~_join_leaves(carried, layout).done.all()

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
        fn = _loop_on_leaves(step, model, ParamsModule(model.params), _split_leaves(state)[1])
    else:
        fn = _cached_compile(model, "while_loop", step, state, compile_options,
                             lambda weights, layout: _loop_on_leaves(step, model, weights, layout))

    def run(state, num_steps: int):
        steps = torch.tensor(num_steps, dtype=torch.int64, device=state.done.device)
        return _call_on_leaves(fn, state, steps)

    return run


def run_loop(
    advance: Callable[[Any], Any],
    state,
    *,
    num_steps: int,
    all_done: Callable[[Any], bool],
    on_step: Callable[[Any], Any] | None = None,
    max_time: float | None = None,
    start_time: float | None = None,
    extra_stop: Callable[[Any], Any] | None = None,
):
    """Advance ``state`` at most ``num_steps`` times, stopping when every row is done.

    Between steps (outside any compiled region) the driver may sync with the host: it checks
    ``all_done``, the wall-clock ``max_time`` budget, and ``extra_stop`` (user criteria that run
    eagerly and may return an updated state). ``on_step`` sees every new state (streaming,
    collecting per-step scores).
    """
    start_time = time.monotonic() if start_time is None else start_time
    for _ in range(num_steps):
        if all_done(state):
            break
        if max_time is not None and time.monotonic() - start_time >= max_time:
            break
        state = advance(state)
        if extra_stop is not None:
            state = extra_stop(state)
        if on_step is not None:
            on_step(state)
    return state
