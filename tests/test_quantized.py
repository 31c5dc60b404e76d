"""Quantized linears: GGUF blocks kept bit for bit, the VNNI kernel against the torch reference,
and quantized models against float references built from the same dequantized weights."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

import genfn
from conftest import smollm2_path, tiny_hf_model
from genfn import kernels
from genfn.models.model import from_hf_state_dict
from genfn.models.quantized import quantize_params
from genfn.quant import FORMATS, QuantizedWeight, dequantize, from_gguf_bytes, quantize, reference_linear
from genfn.quant.reference import quantize_activations

CAN_BUILD = kernels.decode_linear_available()
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="the native kernels need AVX-512 and a C++ compiler")


# ---------------------------------------------------------------------------------------------
# Blocks


@pytest.mark.parametrize("fmt,ggml", [("q8_0", "Q8_0"), ("q4_0", "Q4_0"), ("q4_1", "Q4_1"), ("q5_0", "Q5_0"),
                                      ("q5_1", "Q5_1")])
def test_quantizing_equals_ggml_bit_for_bit(fmt, ggml):
    torch.manual_seed(1)
    w = torch.randn(24, 96) * torch.logspace(-3, 1, 24).unsqueeze(1)
    ours = quantize(w, fmt)
    theirs = from_gguf_bytes(gguf_quantize(w.numpy(), GGMLQuantizationType[ggml]), ggml, (24, 96))
    assert torch.equal(ours.codes, theirs.codes)
    assert torch.equal(ours.scales.view(torch.int16), theirs.scales.view(torch.int16))
    assert (ours.mins is None) == (theirs.mins is None)
    if ours.mins is not None:
        assert torch.equal(ours.mins.view(torch.int16), theirs.mins.view(torch.int16))
    # And reading the blocks back gives the values ggml would.
    raw = gguf_quantize(w.numpy(), GGMLQuantizationType[ggml])
    expected = torch.from_numpy(np.asarray(gguf_dequantize(raw, GGMLQuantizationType[ggml]), dtype=np.float32))
    assert torch.equal(dequantize(ours), expected.reshape(24, 96))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantization_error_is_within_half_a_step(fmt):
    torch.manual_seed(2)
    w = torch.randn(16, 128)
    blocks = quantize(w, fmt)
    group = {"int8": 128, "int4": 64}.get(fmt, 32)
    spread = w.reshape(16, -1, group)
    amax = spread.abs().amax(-1)
    if fmt in ("q8_0", "int8"):
        bound = amax / 127 / 2
    elif fmt == "q4_0":  # symmetric: the largest magnitude maps to -8 and its opposite clips at +7
        bound = amax / 8
    else:
        bound = (spread.amax(-1) - spread.amin(-1)) / 15 / 2
    err = (dequantize(blocks) - w).abs().reshape(16, -1, group).amax(-1)
    # Plus float16 rounding of the scale (and minimum).
    assert torch.all(err <= bound * 1.01 + 2e-3 * amax), (err / bound).max()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [16, 40, 3])
def test_tiles_hold_every_code_and_scale_of_the_rows(fmt, rows):
    torch.manual_seed(3)
    blocks = quantize(torch.randn(rows, 128), fmt)
    weight = QuantizedWeight.from_rows(blocks)
    assert weight.shape == (rows, 128) and weight.codes.shape[0] == -(-rows // 16)
    back = weight.to_rows()
    assert torch.equal(back.codes, blocks.codes)
    assert torch.equal(weight.dequantize(), dequantize(blocks))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [16, 40, 3])
def test_a_lookup_reads_the_rows_of_the_tiles_exactly(fmt, rows):
    torch.manual_seed(4)
    weight = QuantizedWeight.from_rows(quantize(torch.randn(rows, 128), fmt))
    index = torch.tensor([[rows - 1, 0, rows // 2], [1 % rows, rows - 1, 0]])
    assert torch.equal(weight.lookup(index), weight.dequantize()[index])
    assert torch.equal(kernels.embedding(index, weight, torch.bfloat16), weight.dequantize()[index].to(torch.bfloat16))
    assert torch.equal(kernels.embedding(index, weight, torch.float32), weight.dequantize()[index])


@needs_kernel
def test_the_native_lookup_names_an_index_outside_the_rows_and_what_is_wrong_with_the_tiles():
    weight = QuantizedWeight.from_rows(quantize(torch.randn(40, 128), "q4_1"))  # a last tile of 8 rows
    lookup, first = torch.ops.genfn_kernels.tiles_lookup, torch.tensor([0])
    with pytest.raises(RuntimeError, match="tiles_lookup: mins are given for q4_1 and q5_1 and only for them"):
        lookup(weight.codes, weight.scales, None, 1, 40, first)
    with pytest.raises(RuntimeError, match="tiles_lookup: out_features 60 does not fill 3 tiles"):
        lookup(weight.codes, weight.scales, weight.mins, 1, 60, first)
    with pytest.raises(RuntimeError, match=r"tiles_lookup: scales must be contiguous float16 \[tiles, blocks, 16\]"):
        lookup(weight.codes, weight.scales.float(), weight.mins, 1, 40, first)
    with pytest.raises(IndexError, match="tiles_lookup: index 40 is outside the 40 rows"):
        kernels.embedding(torch.tensor([[3, 40]]), weight, torch.float32)
    with pytest.raises(IndexError, match="index -1 is outside"):
        kernels.embedding(torch.tensor([-1]), weight, torch.float32)
    args = (weight.codes, weight.scales, weight.mins, weight.kind, weight.out_features, torch.tensor([0, 39, 7]))
    torch.library.opcheck(torch.ops.genfn_kernels.tiles_lookup, args, test_utils=("test_schema", "test_faketensor"))


def test_fusing_rows_keeps_blocks_and_falls_back_to_float_for_mixed_formats():
    from genfn.quant import cat_rows

    torch.manual_seed(5)
    a, b = quantize(torch.randn(8, 64), "q4_1"), quantize(torch.randn(4, 64), "q4_1")
    fused = cat_rows([a, b])
    assert fused.format == "q4_1" and torch.equal(fused.codes, torch.cat([a.codes, b.codes]))
    assert torch.equal(dequantize(fused), torch.cat([dequantize(a), dequantize(b)]))
    mixed = cat_rows([a, quantize(torch.randn(4, 64), "q8_0")])
    assert isinstance(mixed, torch.Tensor) and mixed.shape == (12, 64)
    assert torch.equal(mixed[:8], dequantize(a))


def test_quantize_rejects_bad_arguments():
    with pytest.raises(ValueError, match="q8_0, q4_0, q4_1, q5_0, q5_1, int8, int4"):
        quantize(torch.randn(4, 32), "q5_k")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40), "q8_0")
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize(torch.randn(4, 96), "int4")
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.randn(32), "q8_0")


# ---------------------------------------------------------------------------------------------
# The kernel against the reference


def test_activation_codes_round_half_to_even_within_127():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 0.5, 1.5  # scale 1: 0.5 -> 0, 1.5 -> 2
    codes, d = quantize_activations(x)
    assert d.item() == 1.0 and codes[0, 0, :3].tolist() == [127.0, 0.0, 2.0]
    codes, d = quantize_activations(torch.zeros(2, 64))  # all-zero blocks: scale 0, codes 0
    assert torch.all(d == 0) and torch.all(codes == 0)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 20])
@pytest.mark.parametrize("out_features,in_features", [(40, 128), (960, 576), (576, 1536), (16, 64)])
def test_kernel_matches_the_float64_reference(fmt, rows, out_features, in_features):
    torch.manual_seed(rows * 7 + out_features)
    weight = QuantizedWeight.from_rows(quantize(torch.randn(out_features, in_features) * 0.05, fmt))
    x = torch.randn(2, rows, in_features) if rows > 8 else torch.randn(rows, in_features)
    y = kernels.linear(x, weight)
    assert y.shape == (*x.shape[:-1], out_features) and y.dtype == torch.float32
    expected = reference_linear(x, weight)
    # Only float32 summation order differs: the integer dots are exact.
    torch.testing.assert_close(y.double(), expected.double(), rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("narrow, wide", [("q4_0", "q5_0"), ("q4_0", "q8_0"), ("q5_0", "q8_0"), ("q4_1", "q5_1")])
@pytest.mark.parametrize("rows", [1, 5, 20])  # 20: the GEMM
def test_widened_blocks_keep_their_values_and_the_kernels_products_bit_for_bit(narrow, wide, rows):
    """A fused matrix whose parts widen into one format is kept in it (genfn.quant.blocks.widen): the
    codes move with the formats' offsets, so the integer sums and every float step are the same."""
    from genfn.quant.blocks import common_format, widen

    torch.manual_seed(rows)
    blocks = quantize(torch.randn(72, 96) * 0.05, narrow)
    wider = widen(blocks, wide)
    assert wider.format == wide and torch.equal(dequantize(wider), dequantize(blocks))
    x = torch.randn(rows, 96)
    assert torch.equal(kernels.linear(x, QuantizedWeight.from_rows(wider)),
                       kernels.linear(x, QuantizedWeight.from_rows(blocks)))
    assert common_format([narrow, wide]) == wide and common_format([narrow]) == narrow
    assert common_format(["q5_1", "q8_0"]) is None and common_format(["q4_0", "int4"]) is None
    with pytest.raises(ValueError, match="q8_0 blocks do not widen into 'q5_0'"):
        widen(quantize(torch.randn(16, 32), "q8_0"), "q5_0")


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [3, 9, 15])  # one group; 5 + 4; 8 + 7 (the GEMM takes 16)
# 1000 rows: 320-580 KB of codes, so from four rows of x the stream also runs fetched 32 KiB ahead.
@pytest.mark.parametrize("out_features", [200, 1000])
def test_rows_in_groups_get_each_rows_bits_alone_and_chain_from_init(fmt, rows, out_features):
    """A verification step's rows share the weight's stream, never its sums: each row of the product
    is bit for bit the row alone, with and without chains that start at init's values."""
    torch.manual_seed(rows)
    weight = QuantizedWeight.from_rows(quantize(torch.randn(out_features, 576) * 0.05, fmt))
    x, init = torch.randn(rows, 576), torch.randn(rows, out_features)
    for start in (None, init):
        y = kernels.quantized_linear(x, weight, start)
        alone = [kernels.quantized_linear(x[i:i + 1], weight, None if start is None else start[i:i + 1])
                 for i in range(rows)]
        assert torch.equal(y, torch.cat(alone))
    assert not torch.equal(kernels.quantized_linear(x, weight, init), kernels.quantized_linear(x, weight))


@needs_kernel
def test_kernel_takes_bfloat16_activations_and_adds_the_bias():
    torch.manual_seed(4)
    weight = QuantizedWeight.from_rows(quantize(torch.randn(48, 64), "q4_1"))
    x, bias = torch.randn(3, 64).bfloat16(), torch.randn(48).bfloat16()
    y = kernels.linear(x, weight, bias)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), reference_linear(x.float(), weight) + bias.float(), rtol=2e-2, atol=5e-2)


@needs_kernel
def test_quant_op_registration_passes_torch_opcheck():
    weight = QuantizedWeight.from_rows(quantize(torch.randn(40, 64), "q4_1"))
    args = (torch.randn(3, 64), weight.codes, weight.scales, weight.mins, weight.kind, weight.out_features)
    torch.library.opcheck(torch.ops.genfn_kernels.quant_linear, args, test_utils=("test_schema", "test_faketensor"))


@needs_kernel
def test_quant_op_rejects_mismatched_inputs():
    weight = QuantizedWeight.from_rows(quantize(torch.randn(40, 64), "q4_1"))
    with pytest.raises(ValueError, match="features"):
        kernels.linear(torch.randn(1, 96), weight)
    with pytest.raises(RuntimeError, match="minimums"):
        torch.ops.genfn_kernels.quant_linear(torch.randn(1, 64), weight.codes, weight.scales, None, 1, 40)
    with pytest.raises(RuntimeError, match="kind"):
        torch.ops.genfn_kernels.quant_linear(torch.randn(1, 64), weight.codes, weight.scales, None, 2, 40)


def test_without_the_native_library_the_reference_op_runs(tmp_path):
    script = textwrap.dedent("""
        import torch
        from genfn import kernels
        from genfn.quant import QuantizedWeight, quantize, reference_linear
        w = QuantizedWeight.from_rows(quantize(torch.randn(40, 64), "q4_0"))
        x = torch.randn(2, 64)
        y = kernels.linear(x, w)
        torch.testing.assert_close(y, reference_linear(x, w), rtol=1e-5, atol=1e-5)
        print(kernels.quant_linear_available())
    """)
    env = dict(os.environ, GENFN_KERNELS="0", PYTHONPATH=os.getcwd())
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------
# Models


def _tiny(seed=0):
    hf, config = tiny_hf_model(seed=seed, intermediate_size=128, num_hidden_layers=3)
    return from_hf_state_dict(config, hf.state_dict())


def _logits(model, tokens):
    cache = model.init_cache(tokens.shape[0], 32)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        logits, _ = model.apply(tokens, positions, cache)
    return logits


def _float(value):
    return value.dequantize() if isinstance(value, QuantizedWeight) else value


def _dequantized(params):
    """The same params with every quantized matrix replaced by its float32 values."""
    layers = [{k: _float(v) for k, v in layer.items()} for layer in params["layers"]]
    return {**params, "lm_head": _float(params["lm_head"]), "layers": layers}


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_model_logits_equal_the_reference_on_the_same_weights(fmt, monkeypatch):
    model = _tiny()
    model.params = quantize_params(model.params, fmt)
    assert all(isinstance(model.params["layers"][0][k], QuantizedWeight) for k in ("wqkv", "wo", "w_gate_up", "w_down"))
    tokens = torch.tensor([[5, 17, 3, 88, 41, 9], [1, 2, 3, 4, 5, 6]])
    native = _logits(model, tokens)
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "quantized_linear", reference_linear)
        reference = _logits(model, tokens)
    torch.testing.assert_close(native, reference, rtol=1e-4, atol=1e-4)
    # Against plain float linears on the dequantized weights, the only difference left is the
    # activation's 8-bit rounding: small, and the same argmax nearly everywhere.
    float_model = _tiny()
    float_model.params = _dequantized(model.params)
    plain = _logits(float_model, tokens)
    assert (native - plain).abs().max() < 0.05 * plain.abs().max()
    assert (native.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.9


@needs_kernel
@pytest.mark.slow
def test_compiled_step_runs_the_quantized_kernel_with_the_reference_logits(monkeypatch):
    # One tiny model whose linears use all three kernel kinds, compiled once.
    model = _tiny(seed=1)
    params = model.params
    formats = ["q4_0", "q4_1", "q8_0"]
    layers = [quantize_params({**params, "layers": [layer]}, fmt)["layers"][0]
              for layer, fmt in zip(params["layers"], formats)]
    model.params = {**quantize_params(params, "int8"), "layers": layers}
    ids = torch.tensor([[5, 17, 3, 88], [0, 0, 12, 7]])
    mask = (ids != 0).long()
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    compiled = genfn.generate(model, ids, cache_implementation="static", max_cache_len=32, **kw)
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "quantized_linear", reference_linear)
        reference = genfn.generate(model, ids, disable_compile=True, **kw)
    assert torch.equal(compiled.sequences, reference.sequences)
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(reference.logits), rtol=1e-4, atol=1e-4)


def test_load_rejects_an_unknown_quantize():
    with pytest.raises(ValueError, match="quantize must be None or one of 'gguf', 'q8_0'"):
        genfn.load(smollm2_path(), quantize="q3_k")


def test_gguf_quantize_needs_a_gguf_file(tmp_path):
    hf, config = tiny_hf_model()
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GGUF"):
        genfn.load(tmp_path, quantize="gguf")


@pytest.mark.slow
def test_gguf_load_keeps_the_files_blocks_bit_for_bit(smollm2):
    from genfn.models.loaders.gguf import read_gguf, unpermute_qk

    model = genfn.load(smollm2_path(), quantize="gguf")
    gguf = read_gguf(smollm2_path())
    layer = model.params["layers"][4]
    assert layer["wqkv"].format == "q4_1" and model.params["lm_head"].format == "q8_0"

    def stored(name):
        info = gguf.tensors[name]
        return from_gguf_bytes(gguf.raw(name), GGMLQuantizationType(info.ggml_type).name, info.shape)

    q, k, v = stored("blk.4.attn_q.weight"), stored("blk.4.attn_k.weight"), stored("blk.4.attn_v.weight")
    rows = layer["wqkv"].to_rows()
    # q and k rows are un-permuted as whole rows (blocks intact), v as stored.
    expected_q = q.map_rows(lambda t: unpermute_qk(t, 9))
    expected_k = k.map_rows(lambda t: unpermute_qk(t, 3))
    assert torch.equal(rows.codes, torch.cat([expected_q.codes, expected_k.codes, v.codes]))
    assert torch.equal(rows.scales.view(torch.int16),
                       torch.cat([expected_q.scales, expected_k.scales, v.scales]).view(torch.int16))
    assert torch.equal(rows.mins.view(torch.int16),
                       torch.cat([expected_q.mins, expected_k.mins, v.mins]).view(torch.int16))
    # Their values are exactly what the float loader dequantizes (same permutation and fusion).
    assert torch.equal(layer["wqkv"].dequantize(), smollm2.params["layers"][4]["wqkv"])
    assert torch.equal(model.params["lm_head"].dequantize(), smollm2.params["lm_head"])
    # The embedding stays the tied head's Q8_0 blocks (the same tensors, no float32 copy of the
    # table), and a lookup reads exactly the float loader's rows.
    embed = model.params["embed"]
    assert isinstance(embed, QuantizedWeight) and embed.codes.data_ptr() == model.params["lm_head"].codes.data_ptr()
    tokens = torch.tensor([[0, 1, 4000, smollm2.vocab_size - 1]])
    assert torch.equal(kernels.embedding(tokens, embed, torch.float32), smollm2.params["embed"][tokens])
    assert model.dtype == torch.float32
    # Greedy text stays close to the float model's (activation rounding only).
    ids = smollm2.tokenizer.encode("The capital of France is")
    out = genfn.generate(model, torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    ref = genfn.generate(smollm2, torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert out[0, len(ids):len(ids) + 3].tolist() == ref[0, len(ids):len(ids) + 3].tolist()
