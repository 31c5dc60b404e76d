"""Frozen dataclasses that are pytrees.

``@pytree_dataclass`` turns a class into a frozen dataclass registered with optree (and with
``torch.utils._pytree``, which dynamo understands natively). Fields are leaves unless declared
with ``static_field()``: static fields are pytree metadata, compared by value, so they key
compilation instead of being traced.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import optree
import torch.utils._pytree as torch_pytree

__all__ = ["pytree_dataclass", "static_field", "NAMESPACE", "leaf_fields", "static_fields"]

# Every genfn node lives in its own optree namespace, so registering never collides with a
# user's registrations of unrelated classes.
NAMESPACE = "genfn"

_STATIC = "genfn_static"

T = TypeVar("T")


def static_field(default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A dataclass field that is pytree metadata (hashable, part of the treedef), not a leaf."""
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata[_STATIC] = True
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def leaf_fields(cls: type) -> tuple[str, ...]:
    return cls.__genfn_leaf_fields__


def static_fields(cls: type) -> tuple[str, ...]:
    return cls.__genfn_static_fields__


def _replace(self: T, **changes: Any) -> T:
    return dataclasses.replace(self, **changes)


def pytree_dataclass(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen dataclass and a pytree node (optree + torch pytree).

    Leaves flatten in field-declaration order; ``None`` leaves are kept as ``None`` children
    (optree treats them as empty subtrees), so optional buffers cost nothing. A
    :func:`static_field` is part of the structure, not a leaf; ``replace`` returns a new value.

    >>> import torch
    >>> @pytree_dataclass
    ... class Counter:
    ...     count: torch.Tensor
    ...     step: int = static_field(default=1)
    >>> c = Counter(torch.tensor([0, 5]))
    >>> leaves, treedef = tree_flatten(c)
    >>> leaves
    [tensor([0, 5])]
    >>> tree_unflatten(treedef, [torch.tensor([1, 6])]).count
    tensor([1, 6])
    >>> c.replace(count=c.count + c.step).count, c.count
    (tensor([1, 6]), tensor([0, 5]))
    """
    cls = dataclasses.dataclass(frozen=True, eq=False)(cls)
    fields = dataclasses.fields(cls)
    leaves = tuple(f.name for f in fields if not f.metadata.get(_STATIC, False))
    statics = tuple(f.name for f in fields if f.metadata.get(_STATIC, False))
    cls.__genfn_leaf_fields__ = leaves
    cls.__genfn_static_fields__ = statics
    cls.replace = _replace

    def flatten(obj):
        children = tuple(getattr(obj, name) for name in leaves)
        meta = tuple(getattr(obj, name) for name in statics)
        return children, meta, leaves

    def unflatten(meta, children):
        obj = object.__new__(cls)
        for name, value in zip(leaves, children):
            object.__setattr__(obj, name, value)
        for name, value in zip(statics, meta):
            object.__setattr__(obj, name, value)
        return obj

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)

    def torch_flatten(obj):
        children, meta, _ = flatten(obj)
        return list(children), meta

    def torch_flatten_with_keys(obj):
        children, meta, _ = flatten(obj)
        return [(torch_pytree.GetAttrKey(n), c) for n, c in zip(leaves, children)], meta

    torch_pytree.register_pytree_node(
        cls,
        torch_flatten,
        lambda children, meta: unflatten(meta, children),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=torch_flatten_with_keys,
    )
    return cls


def tree_flatten(tree: Any):
    """Flatten with genfn's namespace (None is a leaf so positions stay stable)."""
    return optree.tree_flatten(tree, none_is_leaf=True, namespace=NAMESPACE)


def tree_unflatten(treedef, leaves):
    return optree.tree_unflatten(treedef, leaves)


def tree_map(fn, tree: Any, *rest: Any):
    return optree.tree_map(fn, tree, *rest, none_is_leaf=False, namespace=NAMESPACE)
