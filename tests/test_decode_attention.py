"""The dense cache's native decode attention (genfn/kernels/decode_attention.cpp,
``genfn.kernels.decode_attention``): one query per row against a static cache's visible slots, equal
to ``scaled_dot_product_attention`` with the same boolean mask, and the model's decode step on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from genfn import kernels
from test_paged_native import CAN_BUILD, needs_kernel


def _case(dtype, batch, heads, kv_heads, slots, span, head_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, head_dim, generator=gen).to(dtype)
    # A static cache layer is [B, Hkv, max_cache_len, D]; attention reads a prefix slice of it.
    keys = torch.randn(batch, kv_heads, slots, head_dim, generator=gen).to(dtype)[:, :, :span]
    values = torch.randn(batch, kv_heads, slots, head_dim, generator=gen).to(dtype)[:, :, :span]
    mask = torch.rand(batch, 1, 1, span, generator=gen) < 0.5
    mask[..., -1] = True  # the query's own slot, which the model's mask always sets
    return q, keys, values, mask


def test_the_dense_op_loads_wherever_the_kernels_build():
    assert kernels.portable_ops_available() == CAN_BUILD, kernels.kernel_status()
    if CAN_BUILD:
        assert hasattr(torch.ops.genfn_kernels, "dense_decode_attention")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 9, 3, 256, 256, 64), (4, 9, 3, 300, 137, 64), (2, 4, 4, 64, 64, 128),
                                   (3, 8, 1, 40, 33, 16), (2, 16, 1, 50, 50, 32), (2, 24, 2, 40, 37, 48)])
def test_dense_decode_attention_equals_sdpa(dtype, shape):
    """Grouped and plain heads (up to 12 and 16 query heads a kv head, more than the walk's registers
    hold at once), head_dim 16..128, a mask with holes, the cache sliced to the attended span: the op
    equals SDPA (float32 to rounding; bfloat16 within its last bit)."""
    q, keys, values, mask = _case(dtype, *shape)
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=shape[1] != shape[2])
    out = kernels.decode_attention(q, keys, values, mask)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    tol = {torch.float32: 2e-6, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    if dtype == torch.bfloat16:
        # The flash kernel's order of rounding is followed: most outputs are bit-equal.
        assert (out == expected).float().mean() > 0.8


@needs_kernel
def test_a_row_that_sees_nothing_gets_zeros_not_nan():
    q, keys, values, mask = _case(torch.float32, 2, 9, 3, 32, 32, 64)
    mask[0] = False
    out = kernels.decode_attention(q, keys, values, mask)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    expected = F.scaled_dot_product_attention(q[1:], keys[1:], values[1:], attn_mask=mask[1:], enable_gqa=True)
    torch.testing.assert_close(out[1:], expected, atol=2e-6, rtol=2e-6)


@needs_kernel
def test_what_the_kernel_does_not_take_falls_back_to_the_caller():
    q, keys, values, mask = _case(torch.float32, 2, 9, 3, 32, 32, 64)
    two_queries = torch.cat([q, q], dim=2)
    assert kernels.decode_attention(two_queries, keys, values, mask.expand(2, 1, 2, 32)) is None
    assert kernels.decode_attention(q.half(), keys.half(), values.half(), mask) is None
    assert kernels.decode_attention(q, keys, values, mask.float()) is None  # an additive mask
    with torch.enable_grad():
        assert kernels.decode_attention(q.requires_grad_(), keys, values, mask) is None


@needs_kernel
def test_bad_arguments_get_a_clear_error():
    q, keys, values, mask = _case(torch.float32, 2, 9, 3, 32, 32, 64)
    op = torch.ops.genfn_kernels.dense_decode_attention
    with pytest.raises(RuntimeError, match="visible must be a bool"):
        op(q[:, :, 0], keys, values, mask.reshape(2, 32).float(), 0.125)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        op(q[:, :8, 0], keys[:, :3], values[:, :3], mask.reshape(2, 32), 0.125)
    with pytest.raises(RuntimeError, match="visible must be a bool"):
        op(q[:, :, 0], keys, values, torch.ones(2, 40, dtype=torch.bool), 0.125)


@needs_kernel
def test_compiled_the_op_is_one_graph_node():
    """Inside ``torch.compile`` (the static-cache decode step) the op traces through its fake
    implementation with no graph break and returns SDPA's values."""
    q, keys, values, mask = _case(torch.float32, 2, 9, 3, 64, 40, 64)

    def attend(q, keys, values, mask):
        return kernels.decode_attention(q, keys, values, mask) * 2

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True) * 2
    torch.testing.assert_close(compiled(q, keys, values, mask), expected, atol=4e-6, rtol=4e-6)


# Lane swaps under which the tree that sums a score's 16 lanes (_mm512_reduce_add_ps's: lane i with
# i + 8, then those sums 4 lanes apart, 2, 1) gives the same bits: a swap inside a pair of any level.
_TREE_SWAPS = [[(3, 11)], [(1, 5), (9, 13)], [(0, 2), (8, 10), (4, 6), (12, 14)], [(i, i + 1) for i in range(0, 16, 2)]]


def _swapped(t, swaps):
    """``t`` with its last dimension's 16-wide slices' lanes swapped as ``swaps`` says."""
    order = list(range(16))
    for a, b in swaps:
        order[a], order[b] = b, a
    return t.unflatten(-1, (-1, 16))[..., order].flatten(-2)


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 64), (9, 3, 64), (2, 1, 128)])
@pytest.mark.parametrize("swaps", _TREE_SWAPS)
def test_a_score_sums_its_lanes_as_one_vector_reduction(heads, kv_heads, head_dim, swaps):
    """Each score is q . k's 16 lanes summed by one fixed tree (the kernel sums 16 scores at once in
    shuffles that keep it): a key whose lanes are swapped within a pair of that tree, against a
    query symmetric under the swap, scores the same bits as the key itself, so the two slots share
    the softmax evenly and the output is exactly the mean of their values. A sum in another order
    rounds the two scores apart (in about half of the heads, so four rows of several heads each). Between them, at other lanes of a 16-slot group and in other
    groups, slots whose scores are far below (weights ~1e-38: nothing at float32's precision)."""
    gen = torch.Generator().manual_seed(heads + len(swaps))
    rows, span, pair = 4, 50, (7, 38)
    groups = heads // kv_heads
    base = torch.randn(rows, kv_heads, 1, 1, head_dim, generator=gen) * 2
    q = base + 0.3 * torch.randn(rows, kv_heads, groups, 1, head_dim, generator=gen)
    q = ((q + _swapped(q, swaps)) / 2).reshape(rows, heads, 1, head_dim)  # the same bits in each swapped pair
    keys = -16 * ((base + _swapped(base, swaps)) / 2).squeeze(2).expand(rows, kv_heads, span, head_dim).clone()
    keys[:, :, pair[0]] = torch.randn(rows, kv_heads, head_dim, generator=gen)
    keys[:, :, pair[1]] = _swapped(keys[:, :, pair[0]], swaps)
    values = torch.randn(rows, kv_heads, span, head_dim, generator=gen)
    mask = torch.ones(rows, 1, 1, span, dtype=torch.bool)
    out = kernels.decode_attention(q, keys, values, mask)
    mean = ((values[:, :, pair[0]] + values[:, :, pair[1]]) * 0.5).repeat_interleave(groups, dim=1)
    assert torch.equal(out[:, :, 0], mean)
