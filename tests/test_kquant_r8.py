"""Q4_K, Q5_K, Q6_K and IQ4_XS rows interleaved 8 to a group (``q4_k_r8``, ``q5_k_r8``, ``q6_k_r8``,
``iq4_xs_r8``): the repack, its inverse, the decode kernels over it (``kquant_r8.cpp``,
``kquant_q6k.cpp``) and a GGUF model loaded with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

import genfn
from conftest import tiny_hf_model
from genfn import kernels
from genfn.kernels import kquant, native
from genfn.quant import KQuantWeight, quantize_k, reference_linear_k
from genfn.quant.kquants import repack_r8, unpack_r8
from test_kquants import greedy_with_logits, isa, write_kquant_gguf  # noqa: F401 (isa: a fixture)

NATIVE = kquant.kquant_available()
needs_native = pytest.mark.skipif(not NATIVE, reason=f"the K-quant kernels are {kquant.kquant_status()}")


FORMATS = ("q4_k", "q5_k", "q6_k", "iq4_xs")
FORMAT_ID = {"q4_k_r8": 5, "q5_k_r8": 6, "q6_k_r8": 7, "iq4_xs_r8": 8}
BLOCK = {"q4_k": 144, "q5_k": 176, "q6_k": 210, "iq4_xs": 136}


def _random_k(fmt: str, rows: int, blocks: int, seed: int) -> KQuantWeight:
    """Any bytes at all (every code, fifth bit, high pair, scale and minimum; Q6_K's int8 scales of
    either sign), with finite float16 d and dmin (Q6_K: d, its last two bytes; IQ4_XS: d, then any
    scale bits)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (rows, blocks, BLOCK[fmt]), dtype=torch.uint8, generator=g)
    if fmt == "q6_k":
        d = (torch.rand(rows, blocks, 1, generator=g) * 4e-3 + 1e-4).to(torch.float16)
        data[..., 208:] = d.view(torch.uint8).reshape(rows, blocks, 2)
    else:
        scales = (torch.rand(rows, blocks, 2, generator=g) * 4e-3 + 1e-4).to(torch.float16)
        data[..., :4] = scales.view(torch.uint8).reshape(rows, blocks, 4)
    return KQuantWeight(data.reshape(rows, -1), fmt, rows, 256 * blocks)


def _sorted_units(data: torch.Tensor, fmt: str) -> torch.Tensor:
    """The bytes, sorted; IQ4_XS's as nibbles, which its interleaving pairs anew."""
    units = torch.cat([data & 0x0F, data >> 4]) if fmt == "iq4_xs" else data
    return units.flatten().sort().values


@pytest.mark.parametrize("fmt", FORMATS)
def test_repack_is_a_permutation_of_the_bytes_and_dequantizes_as_the_gguf_package(fmt):
    weight = _random_k(fmt, 24, 3, seed=0)
    packed = repack_r8(weight)
    assert packed.format == f"{fmt}_r8" and packed.data.shape == weight.data.shape
    assert torch.equal(_sorted_units(packed.data, fmt), _sorted_units(weight.data, fmt))
    assert not torch.equal(packed.data, weight.data)
    assert torch.equal(unpack_r8(packed).data, weight.data)
    theirs = gguf_dequantize(weight.data.numpy(), GGMLQuantizationType[fmt.upper()])
    assert torch.equal(packed.dequantize(), torch.from_numpy(np.asarray(theirs, dtype=np.float32)))
    # Row operations put the rows back first (the loader's Q/K unpermutation).
    flipped = packed.map_rows(lambda a: a.flip(0))
    assert flipped.format == packed.format and torch.equal(flipped.dequantize(), weight.dequantize().flip(0))


def test_repack_refuses_what_it_cannot_interleave():
    with pytest.raises(ValueError, match="multiple of 8"):
        repack_r8(quantize_k(torch.randn(12, 256), "q4_k"))
    with pytest.raises(ValueError, match="q4_k, q5_k, q6_k or iq4_xs weight"):
        repack_r8(quantize_k(torch.randn(8, 256), "iq4_nl"))
    with pytest.raises(ValueError, match="needs a q4_k_r8, q5_k_r8, q6_k_r8 or iq4_xs_r8 weight"):
        unpack_r8(quantize_k(torch.randn(8, 256), "q6_k"))
    with pytest.raises(ValueError, match="q4_k_r8 needs out_features to be a multiple of 8"):
        KQuantWeight(torch.zeros(4, 144, dtype=torch.uint8), "q4_k_r8", 4, 256)


@needs_native
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_native_repack_and_unpack_equal_the_torch_ones(fmt):
    weight = _random_k(fmt, 40, 2, seed=1)
    format_id = FORMAT_ID[f"{fmt}_r8"]
    out = torch.empty_like(weight.data)
    torch.ops.genfn_kquant.kquant_repack_r8(weight.data, None, out, format_id)
    assert torch.equal(out, repack_r8(weight).data)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(2))
    torch.ops.genfn_kquant.kquant_repack_r8(weight.data, order, out, format_id)
    assert torch.equal(out, repack_r8(weight.map_rows(lambda a: a[order])).data)
    back = torch.empty_like(out)
    torch.ops.genfn_kquant.kquant_unpack_r8(out, back, format_id)
    assert torch.equal(back, weight.data[order])
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.genfn_kquant.kquant_repack_r8(weight.data[:12], None, torch.empty_like(weight.data[:12]), format_id)
    with pytest.raises(RuntimeError, match="format must be 5"):
        torch.ops.genfn_kquant.kquant_repack_r8(weight.data, None, out, 1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernels_match_the_reference_and_the_stored_rows_at_every_row_count(isa, fmt):
    weight = _random_k(fmt, 48, 4, seed=3)
    packed = repack_r8(weight)
    x = torch.randn(33, 1024) * 4
    x[1, :256] = 0  # a block of zeros has scale 0
    reference = reference_linear_k(x, weight)
    for rows in (1, 2, 3, 8, 9, 16, 33):  # the row kernels up to 15 rows, the GEMM from 16
        y = kernels.linear(x[:rows], packed)
        torch.testing.assert_close(y, reference[:rows], rtol=1e-5, atol=1e-5 * reference.abs().max().item())
        # The same integer sums as the stored rows' kernels and GEMM, the float32 sums in one order.
        assert torch.equal(y, kernels.linear(x[:rows], weight))


@needs_native
@pytest.mark.parametrize("fmt", FORMATS)
def test_both_paths_give_the_same_bits_and_rows_never_depend_on_their_batch(fmt):
    # Every path this CPU has (AVX2 everywhere the kernels load; AVX-512 where it exists) keeps a
    # row's bits at any count of rows, and where both exist they agree bit for bit.
    paths = ("avx512", "avx2") if torch.ops.genfn_kquant.kquant_isa() >= 2 else ("avx2",)
    packed = repack_r8(_random_k(fmt, 64, 8, seed=4))
    x = torch.randn(9, 2048)
    try:
        results = {}
        for isa in paths:
            kquant.force_isa(isa)
            results[isa] = [kernels.linear(x[:rows], packed) for rows in range(1, 10)]
    finally:
        kquant.force_isa(None)
    for isa in paths:
        for rows, y in enumerate(results[isa], start=1):  # one row's result at any count of rows
            assert torch.equal(y, results[isa][-1][:rows])
    if "avx512" in results:
        for a, b in zip(results["avx512"], results["avx2"]):
            assert torch.equal(a, b)


@needs_native
def test_q6_k_r8_and_iq4_xs_r8_run_where_the_library_takes_their_group_kernels():
    vnni = kquant.kquant_isa() == "avx512" and native.cpu_has("avx512_vnni")
    try:
        assert kquant.group_kernel_runs("q6_k_r8") == vnni and kquant.group_kernel_runs("iq4_xs_r8") == vnni
        assert kquant.group_kernel_runs("q4_k_r8")
        kquant.force_isa("avx2")  # the AVX2 path takes their groups a row at a time
        assert not kquant.group_kernel_runs("q6_k_r8") and not kquant.group_kernel_runs("iq4_xs_r8")
    finally:
        kquant.force_isa(None)
    with pytest.raises(ValueError, match="group_kernel_runs: fmt must be one of"):
        kquant.group_kernel_runs("q6_k")
    with pytest.raises(RuntimeError, match="unknown format"):
        torch.ops.genfn_kquant.kquant_own_kernel_runs(99)


@needs_native
def test_a_gguf_models_layers_load_interleaved_and_decode_q4_ks_tokens(tmp_path, monkeypatch):
    hf, _ = tiny_hf_model(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    path = tmp_path / "tiny-q4_k_m.gguf"
    write_kquant_gguf(path, hf)
    packed = genfn.load(path, quantize="gguf")
    monkeypatch.setenv("GENFN_Q4K_R8", "0")
    stored = genfn.load(path, quantize="gguf")
    layer, plain = packed.params["layers"][1], stored.params["layers"][1]
    assert layer["w_gate_up"].format == "q4_k_r8" and plain["w_gate_up"].format == "q4_k"
    assert layer["wo"].format == "q5_k_r8" and plain["wo"].format == "q5_k"
    # Q6_K where q6_k_r8's kernel runs (AVX-512 VNNI); as stored elsewhere.
    assert layer["w_down"].format == ("q6_k_r8" if kquant.group_kernel_runs("q6_k_r8") else "q6_k") and plain["w_down"].format == "q6_k"
    for name in ("w_gate_up", "wo", "w_down"):
        assert torch.equal(layer[name].dequantize(), plain[name].dequantize())
    assert torch.equal(layer["wqkv"].dequantize(), plain["wqkv"].dequantize())  # q/k unpermuted alike
    assert packed.params["embed"].format == "q4_k"  # a lookup reads the table's rows as stored
    ours, theirs = greedy_with_logits(packed, 12), greedy_with_logits(stored, 12)
    assert torch.equal(ours.sequences, theirs.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(theirs.logits), rtol=1e-4, atol=1e-4)


@needs_native
@pytest.mark.parametrize("tied", [True, False])
def test_a_gguf_models_head_loads_interleaved_and_a_tied_tables_lookup_reads_its_groups(tmp_path, monkeypatch, tied):
    # The LM head is read whole every step, so it is interleaved too; a tied embedding is that head,
    # and its lookup puts each token's group of 8 rows back. An untied embedding keeps its rows.
    hf, _ = tiny_hf_model(vocab_size=296, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    path = tmp_path / "tiny.gguf"
    types = {"attn_q": "q4_k", "attn_k": "q4_k", "attn_v": "q4_k", "attn_output": "q4_k", "ffn_gate": "q4_k",
             "ffn_up": "q4_k", "ffn_down": "q4_k", "output": "q5_k", "token_embd": "q4_k"}
    write_kquant_gguf(path, hf, types)
    packed = genfn.load(path, quantize="gguf")
    monkeypatch.setenv("GENFN_Q4K_R8", "0")
    stored = genfn.load(path, quantize="gguf")
    head, plain_head = packed.params["lm_head"], stored.params["lm_head"]
    assert head.format == ("q4_k_r8" if tied else "q5_k_r8") and plain_head.format == ("q4_k" if tied else "q5_k")
    assert torch.equal(head.dequantize(), plain_head.dequantize())
    assert packed.params["embed"].format == ("q4_k_r8" if tied else "q4_k")
    tokens = torch.tensor([[0, 7, 8, 15, 100, 295], [3, 3, 201, 9, 64, 1]])  # first and last of groups, repeats
    looked_up = kernels.embedding(tokens, packed.params["embed"], torch.float32)
    assert torch.equal(looked_up, kernels.embedding(tokens, stored.params["embed"], torch.float32))
    assert torch.equal(looked_up, stored.params["embed"].dequantize()[tokens])
    ours, theirs = greedy_with_logits(packed, 12), greedy_with_logits(stored, 12)
    assert torch.equal(ours.sequences, theirs.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(theirs.logits), rtol=1e-4, atol=1e-4)


@needs_native
def test_a_gguf_models_iq4_xs_layers_load_interleaved_where_their_kernel_runs_and_decode_the_same(tmp_path,
                                                                                                    monkeypatch):
    # llama.cpp's IQ4_XS files keep most layer matrices in IQ4_XS: interleaved where iq4_xs_r8's group
    # kernel runs (AVX-512 VNNI), as stored elsewhere; either way the same values, tokens and logits.
    hf, _ = tiny_hf_model(vocab_size=296, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    path = tmp_path / "tiny-iq4_xs.gguf"
    types = {"attn_q": "iq4_xs", "attn_k": "iq4_xs", "attn_v": "q5_k", "attn_output": "iq4_xs", "ffn_gate": "iq4_xs",
             "ffn_up": "iq4_xs", "ffn_down": "iq4_xs", "token_embd": "iq4_xs"}
    write_kquant_gguf(path, hf, types)
    packed = genfn.load(path, quantize="gguf")
    monkeypatch.setenv("GENFN_Q4K_R8", "0")
    stored = genfn.load(path, quantize="gguf")
    r8 = kquant.group_kernel_runs("iq4_xs_r8")
    layer, plain = packed.params["layers"][1], stored.params["layers"][1]
    for name in ("w_gate_up", "wo", "w_down"):
        assert layer[name].format == ("iq4_xs_r8" if r8 else "iq4_xs") and plain[name].format == "iq4_xs"
        assert torch.equal(layer[name].dequantize(), plain[name].dequantize())
    assert torch.equal(layer["wqkv"].dequantize(), plain["wqkv"].dequantize())  # q/k unpermuted alike
    # The tied table is the head: interleaved with it, a token's lookup puts its group's rows back.
    assert packed.params["embed"].format == ("iq4_xs_r8" if r8 else "iq4_xs")
    tokens = torch.tensor([[0, 7, 8, 15, 100, 295]])
    assert torch.equal(kernels.embedding(tokens, packed.params["embed"], torch.float32),
                       kernels.embedding(tokens, stored.params["embed"], torch.float32))
    ours, theirs = greedy_with_logits(packed, 12), greedy_with_logits(stored, 12)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert torch.equal(torch.stack(ours.logits), torch.stack(theirs.logits))  # the same bits, row kernels and GEMM
