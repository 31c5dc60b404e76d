"""Mixtures of experts whose experts stay in a GGUF file's block formats (``QuantizedExperts``):
the decode kernels read only the chosen experts (bytes counted, unchosen experts poisoned), the
loader keeps each expert's blocks, and the models give the dequantized weights' logits and tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import genfn
from conftest import padded_prompts, prefill_logits, tiny_pair
from genfn import kernels
from genfn.kernels import moe_quant
from genfn.models import moe
from genfn.quant import QuantizedExperts, quantize, quantize_k
from test_families import pair, write_family_gguf

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

TILE_FORMATS = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]
K_FORMATS = ["q4_k", "q6_k", "iq4_nl", "iq4_xs"]


def _stack(values: torch.Tensor, fmt: str) -> QuantizedExperts:
    """Float experts ``[E, out, in]`` quantized into a stack, expert by expert."""
    experts, rows, cols = values.shape
    flat = values.reshape(-1, cols)
    blocks = quantize_k(flat, fmt) if fmt in K_FORMATS else quantize(flat, fmt)
    return QuantizedExperts.from_blocks(blocks, experts)


def _poisoned(stack: QuantizedExperts, unchosen: list[int]) -> QuantizedExperts:
    """The stack with every unchosen expert's scales NaN (a K-quant's bytes all 0xFF: its float16
    scales are NaN), so any read of them poisons the output."""
    if stack.is_k_quant:
        codes = stack.codes.clone()
        codes[unchosen] = 0xFF
        return stack.replace(codes=codes)
    scales = stack.scales.clone()
    scales[unchosen] = float("nan")
    return stack.replace(scales=scales)


def _reference(x: torch.Tensor, experts, weights, gate_up: QuantizedExperts, down: QuantizedExperts) -> torch.Tensor:
    """Each row's chosen experts through the quantized linears, one expert at a time."""
    rows = []
    for t in range(x.shape[0]):
        total = torch.zeros(x.shape[1])
        for e, w in zip(experts[t].tolist(), weights[t].tolist()):
            gate, up = kernels.linear(x[t:t + 1], gate_up.expert(e)).chunk(2, dim=-1)
            total = total + w * kernels.linear(torch.nn.functional.silu(gate) * up, down.expert(e))[0]
        rows.append(total)
    return torch.stack(rows)


@pytest.mark.parametrize("fmt", TILE_FORMATS + K_FORMATS)
def test_quantized_decode_kernel_reads_only_the_chosen_experts(fmt):
    hidden, inter = (256, 256) if fmt in K_FORMATS else (64, 96)
    num_experts, top_k = 8, 2
    torch.manual_seed(0)
    gate_up = _stack(torch.randn(num_experts, 2 * inter, hidden) / 8, fmt)
    down = _stack(torch.randn(num_experts, hidden, inter) / 8, fmt)
    x = torch.randn(1, hidden)
    if not moe_quant.native_available(fmt in K_FORMATS):  # this CPU or toolchain has no such kernel
        pytest.skip(f"no native MoE kernel for {fmt} on this machine: {kernels.kernel_status()}")
    assert moe_quant.takes(x, gate_up, down)  # where the kernel exists, a decode row must take it
    experts, weights = torch.tensor([[5, 2]]), torch.tensor([[0.7, 0.3]])
    unchosen = [e for e in range(num_experts) if e not in (5, 2)]
    out, bytes_read = moe_quant.moe_decode(x, experts, weights, _poisoned(gate_up, unchosen), _poisoned(down, unchosen))
    assert torch.isfinite(out).all()
    per_expert = gate_up.expert_nbytes + down.expert_nbytes
    assert int(bytes_read) == top_k * per_expert  # batch 1: k of the 8 experts' blocks, once each
    assert per_expert * num_experts == gate_up.nbytes + down.nbytes
    torch.testing.assert_close(out, _reference(x, experts, weights, gate_up, down), rtol=1e-4, atol=1e-5)
    # Two rows choosing overlapping experts read each chosen (row, expert) pair once.
    two = torch.cat([x, torch.randn(1, hidden)])
    pairs, pair_weights = torch.tensor([[5, 2], [2, 7]]), torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    out, bytes_read = moe_quant.moe_decode(two, pairs, pair_weights, gate_up, down)
    assert int(bytes_read) == 4 * per_expert
    torch.testing.assert_close(out, _reference(two, pairs, pair_weights, gate_up, down), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_k"])
def test_moe_mlp_decode_grouped_and_dense_paths_agree(fmt):
    """The native step and the eager prefill (rows grouped by expert, also what a compiled step
    runs: ``genfn_moe::grouped``) compute the per-row reference's sums."""
    hidden, inter = 256, 256
    num_experts = 8
    torch.manual_seed(1)
    layer = {"router": torch.randn(num_experts, hidden), "experts_gate_up": _stack(torch.randn(num_experts, 2 * inter, hidden) / 8, fmt),
             "experts_down": _stack(torch.randn(num_experts, hidden, inter) / 8, fmt)}

    class Spec:
        experts_per_token, norm_topk_prob = 2, True

    x = torch.randn(12, hidden)
    with torch.no_grad():
        weights, experts = moe.route(x, layer["router"], 2, True)
        grouped = moe.moe_mlp(Spec, layer, x)  # 12 rows: more than a decode step, grouped by expert
        reference = _reference(x, experts, weights, layer["experts_gate_up"], layer["experts_down"])
        torch.testing.assert_close(grouped, reference, rtol=1e-4, atol=1e-5)
        one = moe.moe_mlp(Spec, layer, x[:1])  # a decode step's row: the native kernel where built
        torch.testing.assert_close(one, grouped[:1], rtol=1e-4, atol=1e-5)


# ---- models from GGUF files whose experts are stored quantized ------------------------------

_PAIRS_256: dict = {}


def _pair_256(arch: str):
    """A tiny pair with hidden and expert sizes of 256 (a K-quant super-block)."""
    if arch not in _PAIRS_256:
        sizes = (dict(moe_intermediate_size=256, num_experts=4) if arch == "Qwen3MoeForCausalLM"
                 else dict(intermediate_size=256, num_local_experts=4))
        _PAIRS_256[arch] = tiny_pair(arch, hidden_size=256, num_experts_per_tok=2, **sizes)
    return _PAIRS_256[arch]


CASES = [("qwen3_moe", "Q8_0"), ("qwen3_moe", "Q4_0"), ("mixtral", "Q4_1"), ("olmoe", "Q8_0"), ("qwen3_moe", "Q5_0"),
         ("mixtral", "Q5_1"), ("Qwen3MoeForCausalLM", "Q4_K"), ("MixtralForCausalLM", "Q6_K")]


def _hf(name: str):
    return _pair_256(name)[0] if name.endswith("ForCausalLM") else pair(name)[0]


@pytest.mark.parametrize("name,ggml_type", CASES)
def test_gguf_quantized_experts_stay_blocks_and_give_the_dequantized_logits(name, ggml_type, tmp_path, monkeypatch):
    hf = _hf(name)
    path = write_family_gguf(tmp_path / f"{name}-{ggml_type}.gguf", hf, expert_type=ggml_type)
    model = genfn.load(path, quantize="gguf")
    layer = model.params["layers"][0]
    for key in ("experts_gate_up", "experts_down"):
        assert isinstance(layer[key], QuantizedExperts) and layer[key].format == ggml_type.lower()
    assert layer["experts_gate_up"].shape == tuple(hf.model.layers[0].mlp.experts.gate_up_proj.shape)
    if ggml_type.endswith("_K"):  # K-quant experts are the file's bytes
        from genfn.models.loaders.gguf import read_gguf

        raw = read_gguf(str(path)).raw("blk.1.ffn_down_exps.weight")
        assert np.array_equal(model.params["layers"][1]["experts_down"].codes.numpy(), raw)
    plain = genfn.load(path)  # every weight dequantized to float32 (the gguf package's values)
    torch.testing.assert_close(layer["experts_down"].dequantize(), plain.params["layers"][0]["experts_down"])
    ids, mask = padded_prompts(seed=3)
    blocks_logits, plain_logits = prefill_logits(model, ids, mask), prefill_logits(plain, ids, mask)
    assert (blocks_logits - plain_logits).abs().max() < 0.05 * plain_logits.abs().max()
    # Greedy decoding, batch 1 (the native kernel at each step): the same tokens as the float
    # model, logits within the activations' 8-bit rounding; and the same arithmetic one expert at
    # a time through the quantized linears gives the same tokens and logits.
    prompt = ids[:1, 2:]
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True,
              disable_compile=True, pad_token_id=0)
    native = genfn.generate(model, prompt, **kw)
    plain_run = genfn.generate(plain, prompt, **kw)
    assert torch.equal(native.sequences, plain_run.sequences)
    native_logits, float_logits = torch.stack(native.logits), torch.stack(plain_run.logits)
    assert (native_logits - float_logits).abs().max() < 0.05 * float_logits.abs().max()
    monkeypatch.setattr(moe_quant, "takes", lambda *args: False)
    per_expert = genfn.generate(model, prompt, **kw)
    assert torch.equal(native.sequences, per_expert.sequences)
    torch.testing.assert_close(native_logits, torch.stack(per_expert.logits), rtol=1e-4, atol=1e-4)


def test_a_quantized_moe_decode_step_calls_the_kernel_once_per_layer(tmp_path):
    hf = pair("qwen3_moe")[0]
    model = genfn.load(write_family_gguf(tmp_path / "q4_0.gguf", hf, expert_type="Q4_0"), quantize="gguf")
    gate_up = model.params["layers"][0]["experts_gate_up"]
    if not moe_quant.native_available(k_quant=False):  # no AVX512_VNNI or no compiler here
        pytest.skip(f"no native MoE kernel for Q4_0 on this machine: {kernels.kernel_status()}")
    assert moe_quant.takes(torch.zeros(1, hf.config.hidden_size), gate_up, model.params["layers"][0]["experts_down"])
    ids = torch.randint(3, 97, (1, 5))
    with torch.no_grad():
        _, cache = model.apply(ids, torch.arange(5)[None], model.init_cache(1, 16))
        with torch.profiler.profile() as profile:
            model.apply(torch.tensor([[7]]), torch.tensor([[5]]), cache)
    calls = sum(e.count for e in profile.key_averages() if e.key == "genfn_kernels::moe_decode_quant")
    assert calls == model.spec.num_layers


def test_quantize_on_load_stacks_float_experts_per_expert(tmp_path):
    hf = pair("qwen3_moe")[0]
    path = write_family_gguf(tmp_path / "f32.gguf", hf)
    plain = genfn.load(path)
    model = genfn.load(path, quantize="q8_0")
    gate_up = model.params["layers"][0]["experts_gate_up"]
    assert isinstance(gate_up, QuantizedExperts) and gate_up.format == "q8_0"
    # Expert 3's blocks are its own matrix quantized alone.
    expected = quantize(plain.params["layers"][0]["experts_gate_up"][3], "q8_0")
    assert torch.equal(gate_up.expert(3).dequantize(), QuantizedExperts.from_blocks(expected, 1).expert(0).dequantize())
    # A file's F32 experts with quantize="gguf" stay float.
    assert isinstance(genfn.load(path, quantize="gguf").params["layers"][0]["experts_gate_up"], torch.Tensor)


@pytest.mark.slow
@pytest.mark.parametrize("name,ggml_type", [("qwen3_moe", "Q4_0"), ("Qwen3MoeForCausalLM", "Q4_K")])
def test_compiled_quantized_moe_step_equals_eager(name, ggml_type, tmp_path):
    hf = _hf(name)
    model = genfn.load(write_family_gguf(tmp_path / "m.gguf", hf, expert_type=ggml_type), quantize="gguf")
    ids, mask = padded_prompts(seed=5)
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True,
              pad_token_id=0, cache_implementation="static", max_cache_len=32)
    eager = genfn.generate(model, ids, attention_mask=mask, disable_compile=True, **kw)
    compiled = genfn.generate(model, ids, attention_mask=mask, **kw)
    assert torch.equal(compiled.sequences, eager.sequences)
    # Inductor fuses the float32 elementwise ops in another order than eager (logits ~2e-7 apart);
    # where that moves one of the experts' 8-bit activation codes (Q8_K for Q4_K experts) a step's
    # logits move ~1.6e-4 (this prompt's 6th step, since the prefill's linears run on the decode
    # kernel's panels). A wrong expert, scale or row moves them by their own size (std ~0.34).
    gap = (torch.stack(compiled.logits) - torch.stack(eager.logits)).abs()
    assert gap.max() < 1e-3 and gap.median() < 1e-6, (gap.max(), gap.median())
    assert len(model.compiled_steps) == 1
