"""The tiles formats' AVX2 product (``tiles_avx2.cpp``): what a CPU without AVX-512, which cannot load
the decode library, runs for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 weights in place of the torch reference. It has
the decode library's bits (``quant_linear.cpp``'s VNNI kernel and GEMM), and a model on that path
decodes the tokens it decodes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import genfn
from conftest import tiny_hf_model
from genfn import kernels
from genfn.kernels import kquant, native
from genfn.models.model import from_hf_state_dict
from genfn.models.quantized import quantize_params
from genfn.quant import FORMATS, QuantizedWeight, quantize, reference_linear

needs_avx2 = pytest.mark.skipif(not kquant.tiles_kernel_runs(),
                                reason="the AVX2 kernel needs the K-quant library on a CPU with AVX2")
needs_vnni = pytest.mark.skipif(not (kernels.decode_linear_available() and native.cpu_has("avx512_vnni")),
                                reason="compares with the decode library's VNNI kernel")


def _weight(fmt: str, out_features: int, in_features: int, seed: int) -> QuantizedWeight:
    torch.manual_seed(seed)
    return QuantizedWeight.from_rows(quantize(torch.randn(out_features, in_features) * 0.05, fmt))


@needs_avx2
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("out_features,in_features", [(40, 128), (16, 64), (200, 576)])
def test_matches_the_float64_reference(fmt, rows, out_features, in_features):
    weight = _weight(fmt, out_features, in_features, rows * 7 + out_features)
    x = torch.randn(rows, in_features)
    y = kquant.tiles_linear(x, weight)
    assert y.shape == (rows, out_features) and y.dtype == torch.float32
    expected = reference_linear(x, weight)
    # Only float32 summation order differs: the integer dots are exact.
    torch.testing.assert_close(y.double(), expected.double(), rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@needs_avx2
@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
# One row (decode), groups of four and a partial one, the VNNI side's grouped rows (9) and its GEMM (33);
# a partial last tile (40, 200 rows) and a whole one.
@pytest.mark.parametrize("rows", [1, 2, 4, 7, 9, 33])
@pytest.mark.parametrize("out_features,in_features", [(40, 128), (64, 64), (200, 576)])
def test_has_the_vnni_kernels_bits(fmt, rows, out_features, in_features):
    weight = _weight(fmt, out_features, in_features, rows + out_features)
    x = torch.randn(rows, in_features)
    assert torch.equal(kquant.tiles_linear(x, weight), kernels.quantized_linear(x, weight))
    init = torch.randn(rows, out_features)
    assert torch.equal(kquant.tiles_linear(x, weight, init=init), kernels.quantized_linear(x, weight, init=init))
    x16 = x.to(torch.bfloat16)
    assert torch.equal(kquant.tiles_linear(x16, weight), kernels.quantized_linear(x16, weight))


@needs_avx2
@pytest.mark.parametrize("fmt", ["q4_0", "q5_1", "q8_0"])
def test_each_row_gets_its_own_bits_whatever_rows_come_with_it(fmt):
    weight = _weight(fmt, 72, 256, 5)
    x = torch.randn(2, 11, 256)
    y = kquant.tiles_linear(x, weight)
    assert y.shape == (2, 11, 72)
    alone = torch.stack([torch.cat([kquant.tiles_linear(x[b, i:i + 1], weight) for i in range(11)]) for b in range(2)])
    assert torch.equal(y, alone)


@needs_avx2
def test_rejects_what_does_not_fit_naming_the_argument():
    weight = _weight("q4_1", 40, 64, 0)
    op = torch.ops.genfn_kquant.tiles_linear
    with pytest.raises(ValueError, match="x has 96 features"):
        kquant.tiles_linear(torch.randn(1, 96), weight)
    with pytest.raises(RuntimeError, match="kind must be"):
        op(torch.randn(1, 64), weight.codes, weight.scales, weight.mins, 7, 40)
    with pytest.raises(RuntimeError, match="minimums"):
        op(torch.randn(1, 64), weight.codes, weight.scales, None, 1, 40)
    with pytest.raises(RuntimeError, match="do not match kind"):
        op(torch.randn(1, 64), weight.codes, weight.scales, weight.mins, 2, 40)
    with pytest.raises(RuntimeError, match="do not fit"):
        op(torch.randn(1, 64), weight.codes, weight.scales, weight.mins, 1, 80)
    with pytest.raises(RuntimeError, match="init must hold"):
        op(torch.randn(2, 64), weight.codes, weight.scales, weight.mins, 1, 40, torch.zeros(40))


def build_case_model():
    """A tiny model whose layers take three tile kinds, its LM head a fourth."""
    hf, config = tiny_hf_model(seed=4, intermediate_size=128, num_hidden_layers=3)
    model = from_hf_state_dict(config, hf.state_dict())
    layers = [quantize_params({**model.params, "layers": [layer]}, fmt)["layers"][0]
              for layer, fmt in zip(model.params["layers"], ("q4_0", "q5_1", "q8_0"))]
    model.params = {**quantize_params(model.params, "q4_1"), "layers": layers}
    return model


def decode_case(model):
    ids = torch.tensor([[5, 17, 3, 88, 41, 9], [1, 2, 3, 4, 5, 6]])
    return genfn.generate(model, ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
                          disable_compile=True, return_dict_in_generate=True, output_logits=True)


# A CPU without AVX-512 (genfn.bench.avx2): the decode library refuses to load, the K-quant library
# runs its AVX2 path.
_WITHOUT_AVX512 = """
import torch
from genfn.bench.avx2 import run_as_avx2_cpu
run_as_avx2_cpu()
from genfn import kernels
from genfn.kernels import kquant
from test_tiles_avx2 import build_case_model, decode_case
model = build_case_model()
weight = model.params["layers"][0]["w_gate_up"]
x = torch.randn(3, weight.in_features)
routed = torch.equal(kernels.quantized_linear(x, weight), kquant.tiles_linear(x, weight))
out = decode_case(model)
torch.save({"available": kernels.quant_linear_available(), "routed": routed, "sequences": out.sequences,
            "logits": torch.stack(out.logits)}, PATH)
"""


@needs_avx2
def test_a_cpu_without_avx512_decodes_a_quantized_model_on_the_avx2_kernel(tmp_path):
    result = tmp_path / "out.pt"
    here = Path(__file__).resolve().parent
    # torch's own kernels on their AVX2 forms too, as on such a CPU
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent), str(here)]), ATEN_CPU_CAPABILITY="avx2")
    script = _WITHOUT_AVX512.replace("PATH", repr(str(result)))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    got = torch.load(result)
    assert got["available"] is False  # the decode library did not load
    assert got["routed"]  # its quant_linear op ran the AVX2 kernel, not the torch reference
    here_out = decode_case(build_case_model())
    # The linears' bits are the same; the rest of the step (norms, attention) runs in torch there and
    # in the decode library here, so the logits agree to float32 rounding and the tokens exactly.
    assert torch.equal(got["sequences"], here_out.sequences)
    torch.testing.assert_close(got["logits"], torch.stack(here_out.logits), rtol=1e-4, atol=1e-4)


def test_running_as_an_avx2_cpu_must_come_before_the_decode_library_loads():
    from genfn.bench.avx2 import run_as_avx2_cpu

    kernels.decode_linear_available()  # this process has tried to load it (a fixture or test did already)
    with pytest.raises(RuntimeError, match="already loaded"):
        run_as_avx2_cpu()
