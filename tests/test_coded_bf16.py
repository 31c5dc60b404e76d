"""bfloat16 weights coded in 12.2 bits (genfn.quant.coded_bf16, coded_bf16.cpp): every bit of the
matrix given back, the linear's bits those of the plain bfloat16 kernel, the native stack's those of
plain bfloat16 layers, a ``quantize="coded_bf16"`` model's tokens those of its bfloat16 model, and
bad input named."""

from __future__ import annotations

import pytest
import torch

import genfn
from conftest import smollm2_path
from genfn import kernels
from genfn.kernels import decode_layer
from genfn.models.model import from_hf_state_dict
from genfn.models.quantized import quantize_params
from genfn.quant.coded_bf16 import CodedBfloat16
from test_decode_layer import needs_bf16_dot
from test_decode_stack import _layer_by_layer, _plain_layer, _step_inputs, _table, EPS, HEAD_DIM
from test_paged_native import needs_kernel

pytestmark = [needs_kernel, needs_bf16_dot]


def _matrix(rows, cols, seed=0, kind="normal"):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.02
    if kind == "heavy":  # a Student-t's tails: more groups span more than 8 exponent pairs
        w = w / torch.rand(rows, cols, generator=gen).clamp_min(1e-3).sqrt()
    w = w.bfloat16()
    if kind == "special":  # exact zeros, both infinities, NaN, subnormals, the largest finite values
        flat = w.view(-1)
        flat[::37] = 0
        flat[5] = float("inf")
        flat[6] = float("-inf")
        flat[7] = float("nan")
        flat[70::101] = torch.tensor(1e-39).bfloat16()
        flat[9] = torch.finfo(torch.bfloat16).max
    return w


def _bits(t):
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("kind", ["normal", "heavy", "special"])
@pytest.mark.parametrize("rows, cols", [(3, 64), (40, 576), (17, 128), (5, 192)])
def test_decoding_gives_back_every_bit(kind, rows, cols):
    w = _matrix(rows, cols, kind=kind)
    coded = kernels.encode_coded_bf16(w)
    assert isinstance(coded, CodedBfloat16) and coded.shape == (rows, cols)
    assert torch.equal(_bits(coded.decode()), _bits(w))  # the tensor-op reference
    assert torch.equal(_bits(torch.ops.genfn_kernels.coded_bf16_decode(*coded.tensors())), _bits(w))
    if kind == "special":
        assert coded.raw_groups > 0  # a zero lies far below any group's base
    # 96 bytes a group of 64, a base byte, 64 bytes a raw group, 8 a row's start
    assert coded.nbytes == rows * cols // 64 * 97 + coded.raw_groups * 64 + 8 * (rows + 1)


def test_a_normal_matrix_takes_about_12_bits_a_weight():
    coded = kernels.encode_coded_bf16(_matrix(256, 2048))
    assert coded.raw_groups < 0.02 * 256 * 2048 // 64
    assert 8 * coded.nbytes / (256 * 2048) < 12.5


@pytest.mark.parametrize("rows_of_x", [1, 2, 3, 5, 8, 9, 16, 32, 40])
@pytest.mark.parametrize("rows, cols", [(40, 576), (100, 128)])
def test_the_linear_gives_the_plain_kernels_bits(rows_of_x, rows, cols):
    w = _matrix(rows, cols, seed=1, kind="special" if rows_of_x == 3 else "normal")
    w = torch.nan_to_num(w)  # NaN outputs compare unequal: keep the raw groups' zeros and subnormals
    coded = kernels.encode_coded_bf16(w)
    x = torch.randn(rows_of_x, cols, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        assert torch.equal(kernels.linear(x, coded), kernels.linear(x, w))
        assert torch.equal(kernels.linear(x.view(1, rows_of_x, cols), coded), kernels.linear(x.view(1, rows_of_x, cols), w))


def test_a_lookup_decodes_only_the_rows_it_is_given():
    w = _matrix(50, 192, seed=3, kind="special")
    coded = kernels.encode_coded_bf16(w)
    tokens = torch.tensor([[3, 49, 0], [7, 7, 21]])
    assert torch.equal(_bits(kernels.embedding(tokens, coded, torch.bfloat16)), _bits(w[tokens]))
    with pytest.raises(RuntimeError, match="outside the 50 rows"):
        kernels.embedding(torch.tensor([50]), coded, torch.bfloat16)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="multiple of 64"):
        kernels.encode_coded_bf16(torch.zeros(4, 96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.encode_coded_bf16(torch.zeros(4, 64))
    coded = kernels.encode_coded_bf16(_matrix(4, 128))
    with pytest.raises(ValueError, match="128"):
        kernels.linear(torch.zeros(1, 64, dtype=torch.bfloat16), coded)
    with pytest.raises(TypeError, match="bfloat16 x"):
        kernels.linear(torch.zeros(1, 128), coded)
    with pytest.raises(RuntimeError, match="raw_start"):
        torch.ops.genfn_kernels.coded_bf16_linear(torch.zeros(1, 128, dtype=torch.bfloat16), coded.records,
                                                   coded.bases, coded.raw, coded.raw_start[:-1])


def _coded_layer(layer):
    return {name: kernels.encode_coded_bf16(w) if name in decode_layer._LINEARS else w for name, w in layer.items()}


@pytest.mark.parametrize("batch, seq", [(1, 1), (3, 1), (1, 8), (2, 8)])
def test_a_coded_stack_gives_the_plain_bfloat16_stacks_bits_and_cache(batch, seq):
    plain = [{name: w.bfloat16() for name, w in _plain_layer(i).items()} for i in range(2)]
    coded = [_coded_layer(layer) for layer in plain]
    assert decode_layer.layer_kind(coded[0], torch.bfloat16) == decode_layer._CODED
    assert decode_layer.layer_kind(coded[0], torch.float32) is None
    x, cos, sin, keys, values, slots, visible = (t.bfloat16() if t.is_floating_point() else t
                                                 for t in _step_inputs(batch, seq, 3))
    outputs = []
    for layers in (plain, coded):
        stacked_keys, stacked_values = keys.clone(), values.clone()
        outputs.append((decode_layer.run_stack(x, _table(layers, torch.bfloat16), 2, cos, sin, stacked_keys,
                                               stacked_values, slots, visible, EPS), stacked_keys, stacked_values))
    for got, expected in zip(outputs[1], outputs[0]):
        assert torch.equal(got, expected)
    # and both the layer ops' bits
    assert torch.equal(outputs[1][0], _layer_by_layer(plain, x, cos, sin, keys.clone(), values.clone(), slots, visible))


def test_a_coded_table_is_refused_for_float32_x():
    coded = [_coded_layer({name: w.bfloat16() for name, w in _plain_layer(0).items()})]
    assert _table(coded, torch.float32) is None


def _tiny_bf16(seed=0):
    from genfn.bench.tiny_models import tiny_hf_model

    hf, config = tiny_hf_model(seed=seed, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM,
                               tie_word_embeddings=True)
    model = from_hf_state_dict(config, hf.state_dict(), dtype=torch.bfloat16)
    return model


@pytest.mark.slow
# 9 prompt tokens: the decode kernels' rows; 45: a prefill past 32 rows (the bfloat16 GEMM's, on the
# decoded matrix)
@pytest.mark.parametrize("prompt_len", [9, 45])
def test_a_coded_models_tokens_and_logits_are_its_bfloat16_models(prompt_len):
    plain = _tiny_bf16()
    coded = _tiny_bf16()
    coded.params = quantize_params(coded.params, "coded_bf16")
    assert isinstance(coded.params["layers"][0]["wqkv"], CodedBfloat16)
    assert isinstance(coded.params["lm_head"], CodedBfloat16)
    assert coded.params["embed"] is coded.params["lm_head"]  # tied: one coded table
    ids = torch.randint(3, 90, (2, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    ids[1, :2] = 0  # a left-padded row
    kw = dict(attention_mask=(ids != 0).long(), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    for settings in (dict(disable_compile=True), dict(cache_implementation="static", max_cache_len=64)):
        expected = genfn.generate(plain, ids, **kw, **settings)
        got = genfn.generate(coded, ids, **kw, **settings)
        assert torch.equal(got.sequences, expected.sequences)
        assert torch.equal(torch.stack(got.logits), torch.stack(expected.logits))


def test_load_refuses_coded_bf16_without_bfloat16():
    with pytest.raises(ValueError, match="dtype=torch.bfloat16"):
        genfn.load(smollm2_path(), quantize="coded_bf16")


def test_continuous_batching_gives_a_coded_model_its_bfloat16_models_tokens():
    from genfn.batching.api import generate_batch

    plain, coded = _tiny_bf16(seed=2), _tiny_bf16(seed=2)
    coded.params = quantize_params(coded.params, "coded_bf16")
    prompts = [[5, 17, 3, 88, 41], [9, 60, 2, 33], [12, 7, 1, 1, 4, 50, 8]]
    expected, got = (generate_batch(m, prompts, genfn.GenerationConfig(max_new_tokens=6, do_sample=False))
                     for m in (plain, coded))
    for request, output in got.items():
        assert output.generated_tokens == expected[request].generated_tokens
        assert output.logprobs == expected[request].logprobs


def test_the_command_lines_offer_what_load_takes():
    from genfn.default_model import COMMAND_QUANTIZE
    from genfn.models.quantized import QUANTIZE_CHOICES

    assert set(COMMAND_QUANTIZE) == {*QUANTIZE_CHOICES, "none"}


def test_released_file_pages_read_back_the_same_and_anonymous_memory_is_left_alone(tmp_path):
    import mmap
    import sys

    from genfn.models.weight_arena import release_file_pages

    values = torch.arange(4 * mmap.PAGESIZE, dtype=torch.int32)
    path = tmp_path / "weights.bin"
    path.write_bytes(values.numpy().tobytes())
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # read-only, as the GGUF loader maps
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.frombuffer warns that the buffer is not writable
        in_file = torch.frombuffer(mapping, dtype=torch.int32)
    assert int(in_file.sum()) == int(values.sum())  # resident now
    released = release_file_pages(in_file)
    assert released == (sys.platform == "linux")
    assert torch.equal(in_file, values)  # read again from the page cache
    anonymous = values.clone()
    assert not release_file_pages(anonymous)
    assert torch.equal(anonymous, values)
