"""``tree_unflatten`` for a fixed treedef as generated straight-line Python, for compiled steps.

A compiled step rebuilds its params and its state from flat tensors. Traced by dynamo,
``torch.utils._pytree.tree_unflatten`` walks the ``TreeSpec`` and dynamo guards every field it
reads: on SmolLM2 (Q8_0, 305 weight tensors) that was ~4 000 guards (node types, contexts,
``num_leaves`` per node) checked before every step, ~0.8 ms of a ~9 ms step. The function built
here holds the structure in its code instead: dicts, lists and tuples as literals, statics that are
plain literals (ints, strings, floats, bools, None and tuples of them) as constants of the code,
which dynamo never guards; only other node types and non-literal statics are read from the
function's globals (one guard each). What it returns equals ``tree_unflatten`` of the same leaves.
"""

from __future__ import annotations

import ast
import itertools
from typing import Any, Callable, Mapping, Sequence

import torch.utils._pytree as torch_pytree

__all__ = ["Bindings", "tree_source", "unflattener"]

_LITERAL_TYPES = (int, float, str, bool, type(None))


def _is_literal(value: Any) -> bool:
    """Whether ``repr(value)`` is Python source that evaluates back to an equal value of the same type."""
    if isinstance(value, tuple):
        return type(value) is tuple and all(_is_literal(v) for v in value)
    if type(value) not in _LITERAL_TYPES:
        return False
    try:
        return ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError):
        return False


class Bindings:
    """Where generated code finds the values that are not literals (node types' unflatten functions,
    non-literal statics): names in the generated function's globals, or, with ``holder``, attributes
    of the object the function takes under that parameter name (``module._g0``), which the caller
    sets from ``names``. Each distinct object is bound once."""

    def __init__(self, holder: str | None = None):
        self.holder = holder
        self.names: dict[str, Any] = {}
        self._ids: dict[int, str] = {}
        self._counter = itertools.count()

    def constant(self, value: Any) -> str:
        """``value`` as source: a literal where it is one, else the name it is bound to."""
        if _is_literal(value):
            return repr(value)
        name = self._ids.get(id(value))
        if name is None:
            name = f"_g{next(self._counter)}"
            self._ids[id(value)] = name
            self.names[name] = value
        return name if self.holder is None else f"{self.holder}.{name}"


def tree_source(treedef: torch_pytree.TreeSpec, leaf_exprs: Sequence[str], bindings: Bindings) -> str:
    """One Python expression that builds ``treedef``'s tree with leaf ``i`` given by the source
    ``leaf_exprs[i]``: dicts (literal keys), lists and tuples as literals, other nodes as calls of
    their registered unflatten function (through ``bindings``)."""
    return _expression(treedef, leaf_exprs, [0], bindings)


def _expression(spec: torch_pytree.TreeSpec, leaf_exprs: Sequence[str], position: list, source: Bindings) -> str:
    if spec.is_leaf():
        expr = leaf_exprs[position[0]]
        position[0] += 1
        return expr
    children = [_expression(spec.child(i), leaf_exprs, position, source) for i in range(spec.num_children)]
    node = spec.type
    if node is type(None):
        return "None"
    if node is list:
        return "[" + ", ".join(children) + "]"
    if node is tuple:
        return "(" + "".join(f"{c}, " for c in children) + ")"
    if node is dict and all(_is_literal(k) for k in spec.context):
        return "{" + ", ".join(f"{k!r}: {c}" for k, c in zip(spec.context, children)) + "}"
    unflatten = source.constant(torch_pytree.SUPPORTED_NODES[node].unflatten_fn)
    return f"{unflatten}([{', '.join(children)}], {source.constant(spec.context)})"


def unflattener(treedef: torch_pytree.TreeSpec, constants: Mapping[int, Any] | None = None
                ) -> Callable[[Sequence[Any]], Any]:
    """``tensors -> tree``: ``torch_pytree.tree_unflatten(leaves, treedef)`` where leaf ``i`` is
    ``constants[i]`` for the positions ``constants`` names and the next of ``tensors`` otherwise."""
    constants = dict(constants or {})
    source = Bindings()
    tensor_index = itertools.count()
    leaf_exprs = [source.constant(constants[i]) if i in constants else f"tensors[{next(tensor_index)}]"
                  for i in range(treedef.num_leaves)]
    body = tree_source(treedef, leaf_exprs, source)
    namespace = dict(source.names)
    exec(compile(f"def unflatten(tensors):\n    return {body}\n", "<genfn.traced_unflatten>", "exec"), namespace)
    return namespace["unflatten"]
