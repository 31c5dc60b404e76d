"""Batch invariance of the native kernels that have it today (benchmarks/batch_invariance.py
measures them all): row 0 of ``f(x)`` is bitwise ``f(x[:1])`` whatever the other rows, and the
same on 1 and 2 threads. The kernels that are not invariant (F.linear/oneDNN past the decode
kernel's rows, the bfloat16 GEMM on the LM head) have no test here: see docs/guides/determinism.md."""

from __future__ import annotations

import pytest
import torch

from genfn import kernels
from genfn.kernels import native
from genfn.kernels import kquant
from genfn.quant.blocks import quantize
from genfn.quant.kquants import quantize_k
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


# Every bfloat16 path of decode_linear this CPU has: the widening one everywhere the kernels load,
# vdpbf16ps where the CPU has AVX512_BF16.
BF16_PATHS = ("dot", "widen") if native.cpu_has("avx512_bf16") else ("widen",)


@pytest.mark.parametrize("dtype, path", [(torch.float32, None), *((torch.bfloat16, p) for p in BF16_PATHS)])
@pytest.mark.parametrize("k, n", [(2048, 300), (8192, 70), (1000, 37)])
def test_every_row_keeps_its_one_row_bits_at_any_row_count(dtype, path, k, n):
    """Each row of x[:m] through decode_linear is bitwise that row alone, within the decode kernel's
    8 rows and past them (tiles of rows over panels of the weight, a decode step of 9-33 rows), on
    1 and 2 threads: 1B-model widths (8192 inputs: bfloat16 tiles bigger than L1, float32 rows in
    several groups), panels cut short at N, and a K with a masked tail. The second half of each
    product nearly cancels the first, so that the sums pass through values ~100x their result and
    any other order of summing changes ~1 % of the bfloat16 outputs (F.linear's, or the other path's)."""
    assert kernels.decode_linear_available(), kernels.kernel_status()
    torch.manual_seed(4)
    half = k // 2
    weight = torch.randn(n, k)
    weight[:, half:2 * half] = 0.01 * torch.randn(n, half) - weight[:, :half]
    weight = weight.to(dtype)
    x = torch.randn(33, k)
    x[:, half:2 * half] = x[:, :half]
    x = x.to(dtype)
    op = torch.ops.genfn_kernels.decode_linear
    before = torch.get_num_threads()
    try:
        if path is not None:
            assert kernels.force_bf16_linear_path(path) == path
        alone = torch.cat([op(x[i:i + 1], weight) for i in range(len(x))])
        for rows in (1, 2, 7, 8, 9, 16, 32, 33):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                assert torch.equal(op(x[:rows], weight), alone[:rows]), f"{threads} thread(s), {rows} rows"
            torch.set_num_threads(before)
    finally:
        torch.set_num_threads(before)
        kernels.force_bf16_linear_path(None)


def test_force_bf16_linear_path_names_its_argument():
    with pytest.raises(ValueError, match="path"):
        kernels.force_bf16_linear_path("avx2")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
@pytest.mark.parametrize("k, n", [(576, 200), (96, 1536)])
def test_quantized_linear_row_zero_is_the_same_at_1_to_64_rows(fmt, k, n):
    torch.manual_seed(1)
    weight = QuantizedWeight.from_rows(quantize(torch.randn(n, k) / k ** 0.5, fmt))
    x = torch.randn(64, k)
    _assert_row_zero_invariant(lambda rows: kernels.linear(rows, weight), x, range(2, 65))


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs", "q4_k_r8", "q5_k_r8", "q6_k_r8",
                                 "iq4_xs_r8"])
def test_k_quant_linear_row_zero_is_the_same_at_1_to_33_rows(fmt):
    """The K-quant row kernels (and past them the GEMM) give a row its one-row bits among any other
    rows. IQ4_XS on AVX-512 VNNI takes one row of x through its sign-fixing kernel and 2-8 rows through
    vpdpbusd (iq4_linear.cpp), whose lanes must hold the same integers for this to hold."""
    assert kquant.kquant_available(), kquant.kquant_status()
    torch.manual_seed(5)
    weight = quantize_k(torch.randn(48, 1024) / 32, fmt)
    x = torch.randn(33, 1024)
    _assert_row_zero_invariant(lambda rows: kernels.linear(rows, weight), x, range(2, 34))


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
