"""oneDNN's GEMM on weights packed once (genfn.kernels.packed_gemm): the same values as F.linear
at every row count (few rows take the decode kernel on the plain weight), and packing replaces
only the named weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from genfn.kernels import packed_gemm
from genfn.kernels.packed_gemm import (PackedWeight, bf16_gemm_available, pack_linear_weights, packed_linear,
                                       packing_available)

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN packed linear")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 32, 77])
def test_packed_linear_equals_f_linear(dtype, tol, rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(40, 24, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype)
    x = torch.randn(rows, 24, generator=gen).to(dtype)
    packed = PackedWeight(weight)
    assert packed.shape == weight.shape and packed.dtype == dtype
    torch.testing.assert_close(packed_linear(x, packed).float(), F.linear(x, weight).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(packed_linear(x, packed, bias).float(), F.linear(x, weight, bias).float(),
                               atol=tol, rtol=tol)
    # A plain weight goes through genfn.kernels.linear unchanged.
    torch.testing.assert_close(packed_linear(x, weight).float(), F.linear(x, weight).float(), atol=tol, rtol=tol)


def test_pack_linear_weights_replaces_only_the_named_weights():
    layer = {"wqkv": torch.randn(6, 4), "norm": torch.ones(4), "bias": torch.zeros(6),
             "ints": torch.ones(3, 3, dtype=torch.int64)}
    params = {"lm_head": torch.randn(5, 4), "embed": torch.randn(5, 4), "layers": [layer, dict(layer)]}
    out = pack_linear_weights(params, ("lm_head", "missing"), ("wqkv", "ints", "norm"))
    assert isinstance(out["lm_head"], PackedWeight) and out["embed"] is params["embed"]
    for packed_layer in out["layers"]:
        assert isinstance(packed_layer["wqkv"], PackedWeight) and packed_layer["wqkv"].weight is layer["wqkv"]
        # 1-d and integer tensors are not GEMM weights: left as they are.
        assert packed_layer["norm"] is layer["norm"] and packed_layer["ints"] is layer["ints"]
    assert isinstance(params["lm_head"], torch.Tensor) and isinstance(params["layers"][0]["wqkv"], torch.Tensor)


needs_bf16_gemm = pytest.mark.skipif(not bf16_gemm_available(), reason="genfn's bfloat16 GEMM needs AVX512_BF16")


@needs_bf16_gemm
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 17, 64])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (50, 37), (1, 2)])
def test_genfn_bf16_gemm_sums_in_float32_and_rounds_once(rows, out_features, in_features):
    """Odd inner sizes, a partial last panel of 48 columns and row counts around the blocks of 8:
    the float32 result equals a float64 reference to float32 rounding, the bfloat16 one is it rounded."""
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    packed = torch.ops.genfn_kernels.pack_bf16_gemm_weight(weight)
    exact = x.double() @ weight.double().t()
    got = torch.ops.genfn_kernels.bf16_gemm(x, packed, out_features, None, True)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
    with_bias = torch.ops.genfn_kernels.bf16_gemm(x, packed, out_features, bias, False)
    assert with_bias.dtype == torch.bfloat16
    torch.testing.assert_close(with_bias.float(), (exact + bias.double()).float().bfloat16().float(),
                               rtol=2 ** -7, atol=1e-5)


@needs_bf16_gemm
def test_bfloat16_weights_pack_for_genfn_s_gemm_and_refuse_a_wrong_packing(monkeypatch):
    monkeypatch.setattr(packed_gemm, "_ONEDNN_AMX_BF16", False)  # as on a CPU without AMX
    weight = torch.randn(100, 64).bfloat16()
    packed = PackedWeight(weight)
    assert packed.kind == "genfn"
    x = torch.randn(20, 64).bfloat16()
    out = packed_linear(x, packed, out_float32=True)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x.float(), weight.float()), rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="packing"):
        torch.ops.genfn_kernels.bf16_gemm(torch.randn(4, 62).bfloat16(), packed.packed, 100, None, True)
    assert PackedWeight(torch.randn(5, 4)).kind == "onednn"


def test_bfloat16_weights_pack_for_onednn_where_it_has_amx_tiles(monkeypatch):
    """On a CPU with AMX-BF16 oneDNN's GEMM runs on the tiles and outruns genfn's ``vdpbf16ps`` one:
    bfloat16 weights pack for oneDNN there, and many rows give F.linear's values."""
    monkeypatch.setattr(packed_gemm, "_ONEDNN_AMX_BF16", True)
    assert not packed_gemm.bf16_gemm_preferred()
    weight = torch.randn(100, 64).bfloat16()
    packed = PackedWeight(weight)
    assert packed.kind == "onednn"
    x = torch.randn(40, 64).bfloat16()
    torch.testing.assert_close(packed_linear(x, packed).float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)
    assert packed_linear(x, packed, out_float32=True).dtype == torch.float32


def test_the_amx_reading_follows_the_cpu_flags():
    from genfn.kernels.native import cpu_has

    assert packed_gemm.onednn_has_amx_bf16() == (cpu_has("amx_bf16") and torch.backends.mkldnn.is_available())
    assert packed_gemm.bf16_gemm_preferred() == (bf16_gemm_available() and not packed_gemm.onednn_has_amx_bf16())


# Row counts around the blocks of 8; column counts around the panels of 48 (and the SwiGLU
# panels' 24 features); inner sizes with and without whole 16 x 16 blocks of k-pairs, and odd.
_PLAIN_SHAPES = [(1, 50, 7), (9, 48, 32), (17, 100, 64), (64, 96, 70), (33, 130, 576), (8, 16, 33)]


@needs_bf16_gemm
@pytest.mark.parametrize("rows,out_features,in_features", _PLAIN_SHAPES)
def test_the_gemm_on_a_plain_weight_gives_the_packed_weight_s_bits(rows, out_features, in_features):
    """bf16_gemm_plain packs each panel as it goes: the same words as pack_bf16_gemm_weight, so the
    same sums, bit for bit, with and without a bias, in float32 and in bfloat16."""
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    ops = torch.ops.genfn_kernels
    packed = ops.pack_bf16_gemm_weight(weight)
    for b in (None, bias):
        for out_float32 in (True, False):
            assert torch.equal(ops.bf16_gemm_plain(x, weight, b, out_float32),
                               ops.bf16_gemm(x, packed, out_features, b, out_float32))
    # A non-contiguous weight is read as its values.
    wide = torch.randn(out_features, in_features + 3, generator=gen).bfloat16()
    assert torch.equal(ops.bf16_gemm_plain(x, wide[:, :in_features], None, True),
                       ops.bf16_gemm_plain(x, wide[:, :in_features].contiguous(), None, True))


@needs_bf16_gemm
@pytest.mark.parametrize("rows,features,in_features", [(1, 24, 32), (9, 50, 7), (17, 48, 64), (64, 200, 576),
                                                     (5, 7, 33)])
def test_the_fused_swiglu_gemm_is_silu_mul_of_the_float32_gemm_rounded_once(rows, features, in_features):
    """bf16_gemm_swiglu: genfn's silu_mul on the float32 gate/up sums, rounded to bfloat16 once,
    bit for bit (the lanes it moves the up half through hold the same float32 sums)."""
    gen = torch.Generator().manual_seed(rows * features + in_features)
    gate_up = torch.randn(2 * features, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    ops = torch.ops.genfn_kernels
    sums = ops.bf16_gemm_plain(x, gate_up, None, True)
    got = ops.bf16_gemm_swiglu(x, gate_up)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, features)
    assert torch.equal(got, ops.silu_mul(sums).bfloat16())
    # and so within bfloat16 rounding of the unfused path, which rounds gate and up first
    unfused = ops.silu_mul(ops.bf16_gemm_plain(x, gate_up, None, False)).float()
    torch.testing.assert_close(got.float(), unfused, rtol=2 ** -6, atol=2 ** -6)


@needs_bf16_gemm
def test_the_plain_weight_gemms_refuse_bad_arguments_by_name():
    ops = torch.ops.genfn_kernels
    x = torch.randn(4, 32).bfloat16()
    with pytest.raises(RuntimeError, match="`weight` has 30 columns, `x` has 32"):
        ops.bf16_gemm_plain(x, torch.randn(8, 30).bfloat16(), None, False)
    with pytest.raises(RuntimeError, match="`weight` must be a 2-D bfloat16"):
        ops.bf16_gemm_plain(x, torch.randn(8, 32), None, False)
    with pytest.raises(RuntimeError, match="`x` must be a 2-D bfloat16"):
        ops.bf16_gemm_plain(x.float(), torch.randn(8, 32).bfloat16(), None, False)
    with pytest.raises(RuntimeError, match="`bias` must be \\[8\\]"):
        ops.bf16_gemm_plain(x, torch.randn(8, 32).bfloat16(), torch.randn(7), False)
    with pytest.raises(RuntimeError, match="`gate_up` must have an even number of rows"):
        ops.bf16_gemm_swiglu(x, torch.randn(7, 32).bfloat16())
