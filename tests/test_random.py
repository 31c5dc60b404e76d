"""Keys and counter-based noise: deterministic, independent, identical eager and compiled."""

import math

import pytest
import torch

from genfn import random as R


def test_key_is_deterministic_and_seed_sensitive():
    assert torch.equal(R.key(0), R.key(0))
    assert not torch.equal(R.key(0), R.key(1))
    assert not torch.equal(R.key(1), R.key(1 << 32))  # the high word of the seed counts
    with pytest.raises(TypeError, match="seed"):
        R.key(1.5)


def test_split_and_fold_in_give_distinct_keys():
    keys = R.split(R.key(3), 64)
    assert keys.shape == (64, 2)
    assert len({tuple(k.tolist()) for k in keys}) == 64
    assert torch.equal(R.fold_in(R.key(3), 5), R.fold_in(R.key(3), 5))
    assert not torch.equal(R.fold_in(R.key(3), 5), R.fold_in(R.key(3), 6))
    assert ((keys >= 0) & (keys < 2**32)).all()


def test_row_noise_depends_only_on_its_key_and_counter():
    keys = R.as_row_keys(R.key(7), 4)
    counters = torch.tensor([0, 3, 3, 9])
    batch = R.uniform(keys, counters, 1000)
    for row in range(4):
        alone = R.uniform(keys[row:row + 1], counters[row:row + 1], 1000)
        assert torch.equal(alone[0], batch[row])


def test_uniform_is_uniform():
    u = R.uniform(R.as_row_keys(R.key(11), 4), torch.arange(4), 50_000).flatten()
    assert 0 < float(u.min()) and float(u.max()) < 1
    counts = torch.histc(u, bins=20, min=0, max=1)
    expected = u.numel() / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 45  # 19 degrees of freedom: p ~ 1e-3


def test_gumbel_moments():
    g = R.gumbel(R.as_row_keys(R.key(5), 2), torch.tensor([1, 2]), 100_000).double()
    assert abs(float(g.mean()) - 0.5772) < 0.02
    assert abs(float(g.var()) - math.pi**2 / 6) < 0.05


def test_bad_keys_are_rejected():
    with pytest.raises(TypeError, match="key"):
        R.as_row_keys(torch.zeros(2), 3)
    with pytest.raises(ValueError, match="shape"):
        R.as_row_keys(torch.zeros(2, 2, dtype=torch.int64), 3)


def test_compiled_noise_is_bit_identical_to_eager():
    keys = R.as_row_keys(R.key(0), 3)
    counters = torch.tensor([0, 17, 2**31 + 5])
    compiled = torch.compile(lambda k, c: (R.random_bits(k, c, 4099), R.gumbel(k, c, 4099)), fullgraph=True)
    bits, noise = compiled(keys, counters)
    assert torch.equal(bits, R.random_bits(keys, counters, 4099))
    assert torch.equal(noise, R.gumbel(keys, counters, 4099))


def test_host_fast_path_draws_the_traced_paths_bits(monkeypatch):
    # Eager CPU noise takes numpy uint32 lanes; the int64 path is what traces and other devices
    # run. They must agree bit for bit, including counters past 2**32 and all-ones keys.
    keys = torch.cat([R.as_row_keys(R.key(2024), 3), torch.tensor([[0xFFFFFFFF, 0xFFFFFFFF]])])
    counter = torch.tensor([0, 7, 2**40 + 3, 2**32 - 1])
    fast = (R.random_bits(keys, counter, 4099), R.uniform(keys, counter, 4099), R.gumbel(keys, counter, 4099))
    monkeypatch.setattr(R, "_eager_on_host", lambda *tensors: False)
    traced = (R.random_bits(keys, counter, 4099), R.uniform(keys, counter, 4099), R.gumbel(keys, counter, 4099))
    for a, b in zip(fast, traced):
        assert a.dtype == b.dtype and torch.equal(a, b)
