"""Batch invariance of the native kernels that have it today (benchmarks/batch_invariance.py
measures them all): row 0 of ``f(x)`` is bitwise ``f(x[:1])`` whatever the other rows, and the
same on 1 and 2 threads. The kernels that are not invariant (F.linear/oneDNN past the decode
kernel's rows, the bfloat16 GEMM on the LM head) have no test here: see docs/guides/determinism.md."""

from __future__ import annotations

import pytest
import torch

from genfn import kernels
from genfn.quant.blocks import quantize
from genfn.quant.weight import QuantizedWeight
from test_kernels import CAN_BUILD

pytestmark = pytest.mark.skipif(not CAN_BUILD, reason="the native kernels need AVX-512 and a C++ compiler")

DTYPES = [torch.float32, torch.bfloat16]


def _assert_row_zero_invariant(f, x, rows):
    alone = f(x[:1])
    for n in rows:
        assert torch.equal(f(x[:n])[:1], alone), f"row 0 changed among {n} rows"
    before = torch.get_num_threads()
    try:
        for n in (1, *rows):
            torch.set_num_threads(1)
            one = f(x[:n])
            torch.set_num_threads(2)
            assert torch.equal(f(x[:n]), one), f"1 and 2 threads differ at {n} rows"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, n", [(576, 200), (96, 1536)])
def test_decode_linear_row_zero_is_the_same_for_every_row_count_it_takes(dtype, k, n):
    torch.manual_seed(0)
    weight = (torch.randn(n, k) / k ** 0.5).to(dtype)
    x = torch.randn(kernels.MAX_LINEAR_ROWS[dtype], k).to(dtype)
    _assert_row_zero_invariant(lambda rows: kernels.linear(rows, weight), x, range(2, len(x) + 1))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("k, n", [(576, 200), (96, 1536)])
def test_quantized_linear_row_zero_is_the_same_at_1_to_64_rows(fmt, k, n):
    torch.manual_seed(1)
    weight = QuantizedWeight.from_rows(quantize(torch.randn(n, k) / k ** 0.5, fmt))
    x = torch.randn(64, k)
    _assert_row_zero_invariant(lambda rows: kernels.linear(rows, weight), x, range(2, 65))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 100])
def test_native_rms_norm_row_zero_is_the_same_at_1_to_64_rows(dtype, hidden):
    assert kernels.decode_linear_available(), kernels.kernel_status()
    torch.manual_seed(2)
    norm = torch.randn(hidden).to(dtype)
    x = torch.randn(64, hidden).to(dtype)
    _assert_row_zero_invariant(lambda rows: torch.ops.genfn_kernels.rms_norm(rows, norm, 1e-5), x, range(2, 65))


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_decode_attention_row_zero_is_the_same_among_other_rows_of_other_lengths(dtype):
    torch.manual_seed(3)
    batch, heads, kv_heads, head_dim, length = 24, 9, 3, 64, 130
    q = torch.randn(batch, heads, 1, head_dim).to(dtype)
    keys = torch.randn(batch, kv_heads, length, head_dim).to(dtype)
    values = torch.randn(batch, kv_heads, length, head_dim).to(dtype)
    visible = torch.arange(length)[None, :] < torch.randint(1, length + 1, (batch, 1))
    visible[0] = torch.arange(length) < 97
    mask = visible[:, None, None, :]

    def attend(rows):
        n = rows.shape[0]
        out = kernels.decode_attention(rows, keys[:n], values[:n], mask[:n])
        assert out is not None, "the native decode attention did not take these arguments"
        return out

    _assert_row_zero_invariant(attend, q, range(2, batch + 1))
