"""oneDNN's GEMM on weights packed once (genfn.kernels.packed_gemm): the same values as F.linear
at every row count (few rows take the decode kernel on the plain weight), and packing replaces
only the named weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from genfn.kernels.packed_gemm import PackedWeight, pack_linear_weights, packed_linear, packing_available

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
