"""genfn.traced_unflatten: the generated rebuild equals torch's tree_unflatten, eagerly and traced,
and a traced rebuild guards on far fewer things than walking the treedef does."""

from __future__ import annotations

import math

import torch
import torch.utils._pytree as torch_pytree

from genfn.driver import ParamsModule
from genfn.state.base import pytree_dataclass, static_field
from genfn.traced_unflatten import unflattener


@pytree_dataclass
class _Node:
    value: torch.Tensor
    extra: torch.Tensor | None
    name: str = static_field()
    # A static that is no Python literal: the generated code must read it, not inline its repr.
    shape: torch.Size = static_field()


def _tree():
    return {
        "embed": torch.randn(4, 3),
        "layers": [
            {"w": torch.randn(2), "node": _Node(torch.ones(2), None, f"layer{i}", torch.Size([i, 2]))}
            for i in range(3)
        ],
        "pair": (torch.zeros(1), None),
        7: [torch.arange(3)],
    }


def _assert_same_tree(a, b):
    leaves_a, spec_a = torch_pytree.tree_flatten(a)
    leaves_b, spec_b = torch_pytree.tree_flatten(b)
    assert spec_a == spec_b
    assert all(x is y for x, y in zip(leaves_a, leaves_b))
    for node_a, node_b in zip(a["layers"], b["layers"]):
        assert (node_a["node"].name, node_a["node"].shape) == (node_b["node"].name, node_b["node"].shape)


def test_unflattener_rebuilds_what_tree_unflatten_rebuilds():
    tree = _tree()
    leaves, treedef = torch_pytree.tree_flatten(tree)
    _assert_same_tree(unflattener(treedef)(leaves), torch_pytree.tree_unflatten(leaves, treedef))


def test_constants_fill_their_leaf_positions_and_tensors_the_rest():
    tree = {"a": torch.ones(1), "n": 3, "b": [torch.zeros(2), "text", math.inf]}
    leaves, treedef = torch_pytree.tree_flatten(tree)
    constants = {i: leaf for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)}
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    rebuilt = unflattener(treedef, constants)(tensors)
    assert rebuilt["n"] == 3 and rebuilt["b"][1] == "text" and rebuilt["b"][2] == math.inf
    assert rebuilt["a"] is tensors[0] and rebuilt["b"][0] is tensors[1]


def test_params_module_tree_equals_the_params_it_holds():
    tree = _tree()
    _assert_same_tree(ParamsModule(tree).tree(), tree)


def test_a_traced_rebuild_equals_the_eager_one_with_fewer_guards():
    params = {"layers": [{"w": torch.randn(8), "b": torch.randn(8)} for _ in range(20)]}
    module = ParamsModule(params)

    def total(weights: ParamsModule, x):
        return sum((layer["w"] * x + layer["b"]).sum() for layer in weights.tree()["layers"])

    leaves, treedef = torch_pytree.tree_flatten(params)  # all tensors: leaf i is buffer p{i}

    def total_by_walking(weights: ParamsModule, x):
        tree = torch_pytree.tree_unflatten([getattr(weights, f"p{i}") for i in range(len(leaves))], treedef)
        return sum((layer["w"] * x + layer["b"]).sum() for layer in tree["layers"])

    x = torch.randn(8)
    guards = {}
    for name, fn in (("generated", total), ("walking", total_by_walking)):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="eager", fullgraph=True)
        with torch.no_grad():
            assert torch.allclose(compiled(module, x), fn(module, x))
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__)
        assert len(entries) == 1
        guards[name] = _count_guards(entries[0].guard_manager.root)
    torch._dynamo.reset()
    assert guards["generated"] < guards["walking"] / 2, guards


def _count_guards(manager) -> int:
    """Leaf guards in a guard-manager tree (dict managers hold their children as key/value pairs)."""
    if manager is None:
        return 0
    if hasattr(manager, "get_key_value_managers"):
        return len(manager.get_leaf_guards()) + sum(_count_guards(k) + _count_guards(v)
                                                    for k, v in manager.get_key_value_managers().values())
    return len(manager.get_leaf_guards()) + sum(_count_guards(child) for child in manager.get_child_managers())
