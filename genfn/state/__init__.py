"""State pytrees."""

from genfn.state.base import pytree_dataclass, static_field, tree_flatten, tree_map, tree_unflatten

__all__ = ["pytree_dataclass", "static_field", "tree_flatten", "tree_map", "tree_unflatten"]
