"""The packed forward's native elementwise ops (genfn/kernels/token_ops.cpp) against the torch
steps they replace (genfn.models.packed._TorchLayerOps), the thread-pool release, and prompt
lookup's native scan (genfn/kernels/lookup_ops.cpp) against its tensor ops."""

from __future__ import annotations

import math
import os
import shutil
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genfn import kernels
from genfn.models.packed import _NativeLayerOps, _TorchLayerOps
from genfn.models.rope import rope_cos_sin

CAN_BUILD = (sys.platform == "linux" and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
             and shutil.which(os.environ.get("CXX") or "c++") is not None
             and os.environ.get("GENFN_KERNELS", "1") != "0")
pytestmark = pytest.mark.skipif(not CAN_BUILD, reason="the native token ops need AVX-512 and a C++ compiler")

# float32: the same maths in another order; bfloat16: rounded once where torch rounds each op,
# so within a unit or two of the last place (2^-8 relative) of the reference's values.
TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.decode_linear_available(), kernels.kernel_status()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,width", [(1, 16), (7, 37), (130, 576)])
def test_norms_equal_the_torch_steps(dtype, tokens, width):
    gen = torch.Generator().manual_seed(tokens * width)
    x = (3 * torch.randn(tokens, width, generator=gen)).to(dtype)
    delta = torch.randn(tokens, width, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(_NativeLayerOps.rms_norm(x, weight, 1e-5),
                               _TorchLayerOps.rms_norm(x.float(), weight.float(), 1e-5).to(dtype), **tol)
    total, normed = _NativeLayerOps.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta)  # the residual: one rounded sum, as torch's
    _, expected = _TorchLayerOps.add_rms_norm(x.float(), delta.float(), weight.float(), 1e-6)
    torch.testing.assert_close(normed, _TorchLayerOps.rms_norm(total, weight, 1e-6), **tol)
    if dtype == torch.float32:
        torch.testing.assert_close(normed, expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads,tokens", [(64, 9, 3, 70), (24, 2, 1, 5), (128, 4, 4, 1)])
def test_rope_qkv_equals_the_torch_steps(dtype, head_dim, heads, kv_heads, tokens):
    spec = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)  # what rope_qkv reads
    gen = torch.Generator().manual_seed(head_dim + tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    cos, sin = rope_cos_sin(inv_freq, positions, dtype)
    got = _NativeLayerOps.rope_qkv(qkv, cos, sin, spec)
    want = _TorchLayerOps.rope_qkv(qkv.float(), cos.float(), sin.float(), spec)
    for g, w, shape in zip(got, want, [(tokens, heads, head_dim)] + [(tokens, kv_heads, head_dim)] * 2):
        assert g.shape == shape and g.dtype == dtype and g.is_contiguous()
        torch.testing.assert_close(g, w.to(dtype), **TOLERANCES[dtype])
    assert torch.equal(got[2], want[2].to(dtype))  # v is copied, not rotated


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,width", [(3, 19), (40, 1536)])
def test_silu_mul_equals_the_torch_steps(dtype, tokens, width):
    gen = torch.Generator().manual_seed(width)
    gate_up = (4 * torch.randn(tokens, 2 * width, generator=gen)).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-3])  # exp's clamps and silu(0)
    got = _NativeLayerOps.silu_mul(gate_up)
    assert got.shape == (tokens, width) and got.dtype == dtype
    torch.testing.assert_close(got, _TorchLayerOps.silu_mul(gate_up.float()).to(dtype), **TOLERANCES[dtype])


def test_the_ops_refuse_what_they_do_not_take():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.genfn_kernels.rms_norm(x.double(), torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.genfn_kernels.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.genfn_kernels.silu_mul(x.t())
    with pytest.raises(RuntimeError, match="heads"):
        torch.ops.genfn_kernels.rope_qkv(torch.randn(2, 10), torch.randn(2, 2), torch.randn(2, 2), 2, 2)


def test_a_thread_lets_its_pool_go_and_torch_still_runs_after():
    x = torch.randn(256, 256)
    expected = x @ x
    released = []

    def work():
        torch.ones(1 << 20).sum()  # a parallel region: this thread now holds a pool
        released.append(kernels.release_thread_pool())
        released.append(torch.equal(x @ x, expected))  # the pool comes back on demand

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert released == [True, True]
    assert kernels.release_thread_pool() is True
    assert torch.equal(x @ x, expected)


def test_max_logsumexp_is_torch_argmax_and_logsumexp():
    gen = torch.Generator().manual_seed(5)
    logits = 8 * torch.randn(7, 49157, generator=gen)
    logits[1, 10] = logits[1, 20] = logits[1].max() + 1  # a tie: the first maximum
    logits[2, 3000:] = -math.inf                          # -inf entries
    logits[3] = -math.inf                                 # a row of -inf only
    logits[4, 77] = math.nan                              # a NaN wins, as in torch.argmax
    logits[5, 9] = math.inf
    logits[6, -1] = logits[6].max() + 3                   # the maximum in the last, partial lane block
    ids, lse = torch.ops.genfn_kernels.max_logsumexp(logits)
    assert torch.equal(ids, torch.argmax(logits, dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5, equal_nan=True)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.genfn_kernels.max_logsumexp(logits.double())


def test_argmax_is_torch_argmax_for_every_shape_and_edge():
    """The native greedy pick (``token_choice.argmax``: ``argmax_rows``) gives torch.argmax's index
    in every case its first-maximum and NaN rules decide, at any row length (partial lane
    blocks), and for the [B, k, V] blocks speculative verification reads."""
    from genfn.strategies.token_choice import argmax

    gen = torch.Generator().manual_seed(6)
    logits = 8 * torch.randn(9, 49157, generator=gen)
    logits[1, 10] = logits[1, 20] = logits[1].max() + 1  # a tie: the first maximum
    logits[2, 3000:] = -math.inf
    logits[3] = -math.inf                                 # a row of -inf only: index 0
    logits[4, 77] = logits[4, 33] = math.nan              # the first NaN wins
    logits[5, 9] = logits[5, 12] = math.inf
    logits[6, -1] = logits[6].max() + 3                   # the last, partial lane block
    logits[7] = 0.0
    logits[7, 5] = -0.0                                   # -0 and +0 tie: the first
    logits[8, 40000] = logits[8].max() + 1
    logits[8, 40001] = math.nan                           # a NaN after the maximum still wins
    expected = torch.argmax(logits, dim=-1)
    assert torch.equal(torch.ops.genfn_kernels.argmax_rows(logits), expected)
    assert torch.equal(argmax(logits), expected)
    for vocab in (1, 15, 16, 17, 33):
        short = torch.randn(4, vocab, generator=gen)
        assert torch.equal(argmax(short), torch.argmax(short, dim=-1))
    block = torch.randn(3, 8, 1000, generator=gen)        # verification's [B, k + 1, V]
    assert torch.equal(argmax(block), torch.argmax(block, dim=-1))
    assert torch.equal(argmax(block[:, :5]), torch.argmax(block[:, :5], dim=-1))
    assert torch.equal(argmax(block.double()), torch.argmax(block.double(), dim=-1))  # torch's
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.genfn_kernels.argmax_rows(logits.double())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), batch=st.integers(1, 4), width=st.integers(2, 24), vocab=st.integers(2, 5),
       k=st.integers(1, 6), max_ngram=st.integers(1, 4), occurrence=st.sampled_from(["latest", "earliest"]),
       eos=st.sampled_from([(), (1,), (0, 2)]), padded=st.booleans(), limited=st.booleans())
def test_prompt_lookup_scan_is_the_tensor_ops(data, batch, width, vocab, k, max_ngram, occurrence, eos, padded,
                                               limited):
    """The native scan returns the tensor ops' draft and num_valid tensor for tensor, the garbage
    columns past num_valid included (the target is fed them), for any padding, length and budget."""
    from genfn.strategies.assisted.prompt_lookup import _propose_with_tensor_ops, propose_prompt_lookup

    tokens = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=width, max_size=width),
                                             min_size=batch, max_size=batch)))
    cur_len = torch.tensor([data.draw(st.integers(1, width)) for _ in range(batch)])
    first = torch.tensor([data.draw(st.integers(0, int(n) - 1)) for n in cur_len]) if padded else None
    max_length = cur_len + torch.tensor([data.draw(st.integers(0, 4)) for _ in range(batch)]) if limited else None
    native = propose_prompt_lookup(tokens, cur_len, k, max_ngram, occurrence=occurrence, eos_token_ids=eos,
                                   max_length=max_length, first_column=first)
    expected = _propose_with_tensor_ops(tokens, cur_len, k, max_ngram, occurrence, eos, max_length, first)
    assert torch.equal(native[0], expected[0]) and torch.equal(native[1], expected[1])


def test_prompt_lookup_scan_refuses_what_it_does_not_take():
    tokens = torch.zeros(2, 8, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="cur_len"):
        torch.ops.genfn_kernels.propose_prompt_lookup(tokens, torch.zeros(3, dtype=torch.int64), None, None, [], 2,
                                                      2, True)
    with pytest.raises(RuntimeError, match="tokens"):
        torch.ops.genfn_kernels.propose_prompt_lookup(tokens.int(), torch.zeros(2, dtype=torch.int64), None, None, [],
                                                      2, 2, True)
