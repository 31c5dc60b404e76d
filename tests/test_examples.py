"""The custom-strategy example runs through genfn's driver and is reproducible per key."""

import importlib.util
import pathlib
import sys

import torch

import genfn
from conftest import tiny_pair

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "custom_strategy.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("custom_strategy", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_custom_strategy_is_reproducible_and_respects_eos():
    example = _load_example()
    _, model = tiny_pair(eos_token_id=5)
    ids = torch.tensor([[7, 8, 9], [10, 11, 12]])
    a = example.run(model, ids, max_new_tokens=12, key=genfn.random.key(3))
    b = example.run(model, ids, max_new_tokens=12, key=genfn.random.key(3))
    c = example.run(model, ids, max_new_tokens=12, key=genfn.random.key(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape[1] <= 15 and torch.equal(a[:, :3], ids)
    for row in a[:, 3:]:
        hits = (row == 5).nonzero()
        if len(hits):
            assert (row[int(hits[0]):] == 5).all()
