"""IQ4_NL and IQ4_XS kept as the file stores them (``KQuantWeight`` formats ``iq4_nl``, ``iq4_xs``):
the non-linear table and the block layouts, the kernels on rows that are not a multiple of 128
(IQ4_NL's tail path), and a tiny Llama GGUF laid out as llama.cpp writes an IQ4_XS file of a
576-wide model (IQ4_NL where a row is not a multiple of 256) against the same file dequantized to
float. The K-quants' tests run these formats too: dequantization bit for bit against the gguf
package, the kernels for 1..33 rows on both ISA paths (``test_kquants.py``), the MoE decode kernel
(``test_moe_quant.py``)."""

from __future__ import annotations

import pytest
import torch

import genfn
from conftest import tiny_hf_model
from genfn import kernels
from genfn.kernels import kquant
from genfn.quant import KQuantWeight, dequantize_k, quantize_k, reference_linear_k
from genfn.quant.iq4 import KVALUES
from test_kquants import assert_the_files_blocks_are_kept, greedy_with_logits, native_and_reference
from test_kquants import isa, write_kquant_gguf  # noqa: F401  (isa: the ISA-path fixture)

TABLE = torch.tensor(KVALUES, dtype=torch.float32)


def _half_bytes(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float16).view(torch.uint8)


def test_iq4_nl_block_indexes_the_table():
    # d = 0.5; byte j holds index j (input j) and 15 - j (input j + 16).
    index = torch.arange(16, dtype=torch.uint8)
    block = torch.cat([_half_bytes(0.5), index | ((15 - index) << 4)])
    assert torch.equal(dequantize_k(block, "iq4_nl"), 0.5 * torch.cat([TABLE, TABLE.flip(0)]))


def test_iq4_xs_super_block_scales_its_sub_blocks():
    # d = 2; sub-block i has the 6-bit scale code[i] (units code - 32): low 4 bits at bit 4i of
    # scales_l, high 2 bits at bit 2i of scales_h; every sub-block's indices as in the test above.
    code = [0, 63, 32, 33, 17, 48, 5, 40]
    low = sum((c & 0x0F) << (4 * i) for i, c in enumerate(code))
    high = sum((c >> 4) << (2 * i) for i, c in enumerate(code))
    index = torch.arange(16, dtype=torch.uint8)
    indices = (index | ((15 - index) << 4)).repeat(8)
    block = torch.cat([_half_bytes(2.0), torch.tensor([high], dtype=torch.int32).view(torch.uint8)[:2],
                       torch.tensor([low], dtype=torch.int64).view(torch.uint8)[:4], indices])
    assert block.numel() == 136
    sub_block = torch.cat([TABLE, TABLE.flip(0)])
    expected = torch.cat([2.0 * (c - 32) * sub_block for c in code])
    assert torch.equal(dequantize_k(block, "iq4_xs"), expected)


def test_rows_must_be_whole_blocks():
    assert quantize_k(torch.randn(3, 576), "iq4_nl").shape == (3, 576)  # 18 blocks of 32
    with pytest.raises(ValueError, match="multiple of 256 for iq4_xs"):
        quantize_k(torch.randn(3, 576), "iq4_xs")
    with pytest.raises(ValueError, match="multiple of 32"):
        KQuantWeight(torch.zeros(3, 18, dtype=torch.uint8), "iq4_nl", 3, 40)
    with pytest.raises(ValueError, match=r"iq4_xs data must be uint8 \[3, 136\]"):
        KQuantWeight(torch.zeros(3, 144, dtype=torch.uint8), "iq4_xs", 3, 256)


@pytest.mark.parametrize("in_features", [32, 96, 160, 576])
def test_iq4_nl_kernel_on_rows_not_a_multiple_of_128(isa, in_features):
    """The AVX-512 path takes four blocks per register and the last one to three one by one."""
    torch.manual_seed(4)
    weight = quantize_k(torch.randn(19, in_features), "iq4_nl")
    x = torch.randn(11, in_features) * 3
    x[:, 32:64] = 0  # a block of zeros has scale 0
    full = reference_linear_k(x, weight)
    for rows in (1, 2, 5, 8, 9, 11):
        torch.testing.assert_close(kernels.linear(x[:rows], weight), full[:rows], rtol=1e-5,
                                   atol=1e-5 * full.abs().max().item())


def test_iq4_nl_activations_are_quantized_per_block_of_32():
    """One large input does not flatten the other blocks' activations (one scale per 256 would
    round them all to zero)."""
    torch.manual_seed(5)
    w = torch.randn(4, 256)
    w[:, :32] = 0  # the large input's block meets zero weights: only the small inputs count
    weight = quantize_k(w, "iq4_nl")
    x = torch.randn(2, 256) * 0.01
    x[:, 0] = 100.0
    exact = x.double() @ weight.dequantize().double().T
    error = (kernels.linear(x, weight).double() - exact).abs().max()
    assert exact.abs().max() > 0.05 and error < 0.02 * exact.abs().max()


# ---------------------------------------------------------------------------------------------
# A model written as GGUF with IQ4 tensors

# llama.cpp's IQ4_XS mix for a 576-wide model: matrices whose rows hold 576 inputs are IQ4_NL,
# the down projection (rows of 1536) IQ4_XS.
_IQ4_TYPES = {"attn_q": "iq4_nl", "attn_k": "iq4_nl", "attn_v": "iq4_nl", "attn_output": "iq4_nl",
              "ffn_gate": "iq4_nl", "ffn_up": "iq4_nl", "ffn_down": "iq4_xs", "output": "iq4_nl",
              "token_embd": "iq4_nl"}


@pytest.fixture(scope="module")
def iq4_file(tmp_path_factory):
    hf, _ = tiny_hf_model(vocab_size=300, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                          num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("iq4") / "tiny-iq4_xs.gguf"
    write_kquant_gguf(path, hf, _IQ4_TYPES)
    return path


def test_gguf_iq4_model_keeps_the_files_blocks_and_decodes_as_the_dequantized_model(iq4_file, monkeypatch):
    model = genfn.load(iq4_file, quantize="gguf")
    layer = model.params["layers"][0]
    # IQ4_XS interleaved 8 rows to a group where its group kernel runs (AVX-512 VNNI), as stored elsewhere.
    down = "iq4_xs_r8" if kquant.group_kernel_runs("iq4_xs_r8") else "iq4_xs"
    assert [layer[k].format for k in ("wqkv", "wo", "w_gate_up", "w_down")] == ["iq4_nl"] * 3 + [down]
    assert isinstance(model.params["lm_head"], KQuantWeight) and model.params["lm_head"].format == "iq4_nl"
    assert_the_files_blocks_are_kept(model, iq4_file, "iq4_nl")
    # Against the same arithmetic in torch the kernels add only float32 summation order, which can
    # move an activation across a rounding boundary of its 8-bit code now and then (one of these 12
    # steps here, by 1e-3; the others agree to 3e-7).
    native, reference = native_and_reference(model, monkeypatch, steps=12)
    native_logits, reference_logits = torch.stack(native.logits), torch.stack(reference.logits)
    per_step = (native_logits - reference_logits).abs().amax((1, 2))
    assert per_step.max() < 2e-3 * reference_logits.abs().max()
    assert (per_step < 1e-5).sum() >= len(per_step) // 2
    # The file loaded without quantize=: every tensor dequantized to float32 by the gguf package,
    # float linears. The logits differ by the activations' 8-bit rounding only.
    dense = genfn.load(iq4_file)
    assert isinstance(dense.params["layers"][0]["w_down"], torch.Tensor)
    plain = greedy_with_logits(dense, steps=12)
    plain_logits = torch.stack(plain.logits)
    assert torch.equal(native.sequences, plain.sequences)
    assert (native_logits - plain_logits).abs().max() < 0.05 * plain_logits.abs().max()
