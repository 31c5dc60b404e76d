"""The many-row GEMM for Q8_0/Q4_0/Q4_1 tiles (``quant_gemm.cpp``): every output has the bits of the
row kernels (``quant_linear.cpp``), whatever the number of rows, and chains from ``init`` as they do."""

from __future__ import annotations

import pytest
import torch

import genfn
from conftest import tiny_hf_model
from genfn import kernels
from genfn.kernels import native
from genfn.models.model import from_hf_state_dict
from genfn.models.quantized import quantize_params
from genfn.quant import FORMATS, QuantizedWeight, quantize, reference_linear

pytestmark = pytest.mark.skipif(not kernels.decode_linear_available() or not native.cpu_has("avx512_vnni"),
                                reason="the GEMM needs the native kernels and AVX512_VNNI; the row kernels' "
                                       "tests cover CPUs without it")


@pytest.fixture
def row_kernels_only():
    """Runs the body with every row count on the row kernels, then restores the default."""
    assert kernels.quant_gemm_min_rows(10**9) == 10**9
    yield
    kernels.quant_gemm_min_rows(None)


def _weight(fmt: str, out_features: int, in_features: int, seed: int) -> QuantizedWeight:
    torch.manual_seed(seed)
    return QuantizedWeight.from_rows(quantize(torch.randn(out_features, in_features) * 0.05, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
# 3 tiles (a pair and a single), a partial last tile, rows not a multiple of the GEMM's 8.
@pytest.mark.parametrize("rows,out_features,in_features", [(37, 40, 128), (16, 64, 64), (70, 200, 576)])
def test_gemm_has_the_row_kernels_bits(fmt, rows, out_features, in_features):
    weight = _weight(fmt, out_features, in_features, rows)
    x = torch.randn(rows, in_features)
    y = kernels.quantized_linear(x, weight)
    one_at_a_time = torch.cat([kernels.quantized_linear(x[i:i + 1], weight) for i in range(rows)])
    assert torch.equal(y, one_at_a_time)
    init = torch.randn(rows, out_features)
    chained = kernels.quantized_linear(x, weight, init=init)
    assert torch.equal(chained, torch.cat([kernels.quantized_linear(x[i:i + 1], weight, init=init[i:i + 1])
                                           for i in range(rows)]))
    expected = reference_linear(x, weight)
    torch.testing.assert_close(y.double(), expected.double(), rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_and_grouped_row_kernels_agree_on_one_product(fmt, row_kernels_only):
    weight = _weight(fmt, 96, 128, 3)
    x = torch.randn(3, 11, 128)  # 33 rows
    grouped = kernels.quantized_linear(x, weight)
    kernels.quant_gemm_min_rows(None)
    assert torch.equal(kernels.quantized_linear(x, weight), grouped)


def test_a_prompt_prefilled_by_the_gemm_decodes_the_row_kernels_tokens_and_logits(row_kernels_only):
    hf, config = tiny_hf_model(seed=2, intermediate_size=128, num_hidden_layers=3)
    model = from_hf_state_dict(config, hf.state_dict())
    # One layer per kernel kind; the LM head int8.
    layers = [quantize_params({**model.params, "layers": [layer]}, fmt)["layers"][0]
              for layer, fmt in zip(model.params["layers"], ("q4_0", "q4_1", "q8_0"))]
    model.params = {**quantize_params(model.params, "int8"), "layers": layers}
    ids = torch.randint(3, model.spec.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, disable_compile=True,
              return_dict_in_generate=True, output_logits=True)
    rows = genfn.generate(model, ids, **kw)
    kernels.quant_gemm_min_rows(None)  # the 40 prompt rows of each linear now go to the GEMM
    gemm = genfn.generate(model, ids, **kw)
    assert torch.equal(gemm.sequences, rows.sequences)
    assert torch.equal(torch.stack(gemm.logits), torch.stack(rows.logits))


def test_min_rows_rejects_what_is_not_a_positive_int():
    for bad in (0, -3, 2.5, True, "16"):
        with pytest.raises(ValueError, match="rows must be None or a positive int"):
            kernels.quant_gemm_min_rows(bad)
    assert kernels.quant_gemm_min_rows(None) == 16
