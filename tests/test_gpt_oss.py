"""GPT-OSS against transformers' ``GptOssForCausalLM`` on a tiny random ``GptOssConfig`` (no hub):
logits at every position of a padded prefill longer than the sliding window and of each cached
step, greedy and beam tokens over 32 steps, compiled equal to eager, continuous batching equal to
``generate``, GGUF files written as llama.cpp's converter writes them (float experts and MXFP4
experts) and ``genfn.save`` directories transformers loads."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

import genfn
from conftest import assert_prefill_and_cached_steps_match, finish_gguf, gguf_writer, padded_prompts, prefill_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

WINDOW = 4
LENGTH = 11  # prompts past the window
# Small clamp limit and larger weights than the default init: the clamps, the sinks and the router
# bias all change the numbers, so a mistake in any of them shows in the logits.
SETTINGS = dict(vocab_size=97, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                max_position_embeddings=256, swiglu_limit=0.5, initializer_range=0.1, bos_token_id=1,
                eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
_PAIR: list = []


def tiny_gpt_oss(**overrides):
    """transformers' GptOssForCausalLM on ``SETTINGS`` (``overrides`` on top), its sinks and biases
    (attention, router, experts: zeros as initialized) drawn large enough to matter
    (tests/tensor_parallel_ranks.py too)."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**{**SETTINGS, **overrides})
    config._attn_implementation = "eager"
    hf = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)  # sinks that take a real share of the attention
            layer.mlp.router.bias.normal_(0.0, 1.0)
            layer.mlp.experts.gate_up_proj_bias.normal_(0.0, 0.3)
            layer.mlp.experts.down_proj_bias.normal_(0.0, 0.3)
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         layer.self_attn.o_proj):
                proj.bias.normal_(0.0, 0.3)
    return hf


def _genfn_of(hf):
    from genfn.models.model import from_hf_state_dict

    config = hf.config.to_dict()
    config["architectures"] = ["GptOssForCausalLM"]
    return from_hf_state_dict(config, hf.state_dict())


def pair():
    if not _PAIR:
        hf = tiny_gpt_oss()
        _PAIR.extend([hf, _genfn_of(hf)])
    return tuple(_PAIR)


def test_the_config_picks_the_native_family_and_its_layers():
    _, gm = pair()
    assert type(gm.spec).__name__ == "GptOssSpec"
    assert gm.spec.sliding_layers == (True, False, True, False)
    assert gm.spec.sliding_window == WINDOW and gm.spec.num_experts == 4 and gm.spec.experts_per_token == 2
    assert gm.spec.rope_attention_factor == pytest.approx(0.1 * np.log(4.0) + 1.0)


def test_prefill_and_every_cached_step_match_transformers():
    reference = assert_prefill_and_cached_steps_match(*pair(), *padded_prompts(length=LENGTH))
    assert reference.std() > 0.1  # the comparison is not between near-constant logits


def test_the_sinks_and_the_clamp_change_the_logits():
    """A check on the check: without sinks or with a loose clamp the oracle's logits move."""
    hf, gm = pair()
    ids, mask = padded_prompts(length=LENGTH, seed=3)
    plain = prefill_logits(gm, ids, mask)
    loose = _genfn_of(tiny_gpt_oss(swiglu_limit=7.0))
    assert (prefill_logits(loose, ids, mask) - plain).abs().max() > 1e-3
    from genfn.models.model import Model

    no_sinks = Model(gm.spec, {**gm.params, "layers": [
        {**layer, "sinks": torch.full_like(layer["sinks"], -1e4)} for layer in gm.params["layers"]]},
        gm.apply_fn, gm.init_cache_fn)
    assert (prefill_logits(no_sinks, ids, mask) - plain).abs().max() > 1e-3


def test_greedy_and_beam_tokens_equal_transformers_over_32_steps():
    hf, gm = pair()
    ids, mask = padded_prompts(length=LENGTH, seed=1)
    settings = dict(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        greedy = hf.generate(ids, attention_mask=mask, **settings)
        beams = hf.generate(ids, attention_mask=mask, num_beams=3, **settings)
    assert greedy.shape[1] == ids.shape[1] + 32
    assert len(set(greedy[0, ids.shape[1]:].tolist())) > 2  # not one token repeated
    assert torch.equal(genfn.generate(gm, ids, attention_mask=mask, disable_compile=True, **settings), greedy)
    assert torch.equal(genfn.generate(gm, ids, attention_mask=mask, num_beams=3, disable_compile=True, **settings),
                       beams)


def test_bfloat16_runs_as_close_to_float32_as_transformers_does():
    """bfloat16 weights and activations (transformers' own bfloat16 attention takes the sink softmax
    in bfloat16, genfn in float32: close, not equal)."""
    _, gm = pair()
    ids, mask = padded_prompts(length=LENGTH, seed=1)
    reference = prefill_logits(gm, ids, mask)
    ours = prefill_logits(gm.to(torch.bfloat16), ids, mask)
    with torch.no_grad():  # a fresh copy: casting the shared oracle back and forth would round its weights
        theirs = tiny_gpt_oss().to(torch.bfloat16)(input_ids=ids, attention_mask=mask).logits[mask.bool()].float()
    assert (ours - reference).abs().max() < 2 * (theirs - reference).abs().max() + 1e-3


@pytest.mark.slow
def test_compiled_decode_equals_eager():
    """Batch 1: the compiled step gathers its row's 2 chosen experts of 4 (the padded batches above
    run every expert weighted zero when traced, which test_the_moe_paths_agree checks eagerly)."""
    _, gm = pair()
    ids = padded_prompts(length=LENGTH, seed=5)[0][:1]
    settings = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                    cache_implementation="static", max_cache_len=32)
    eager = genfn.generate(gm, ids, disable_compile=True, **settings)
    compiled = genfn.generate(gm, ids, **settings)
    assert torch.equal(compiled, eager)
    assert len(gm.compiled_steps) == 1


def test_the_moe_paths_agree():
    """Eager (each chosen expert on its rows), gathered (a compiled step's few rows) and dense
    (every expert, weighted zero where unchosen) give the same values."""
    from genfn.models import moe

    _, gm = pair()
    layer = gm.params["layers"][1]
    x = torch.randn(5, 64)
    weights, experts = moe.route_top_k_softmax(x, layer["router"], layer["router_bias"], 2)
    alpha, limit = gm.spec.swiglu_alpha, gm.spec.swiglu_limit
    with torch.no_grad():
        grouped = moe.biased_moe_mlp(gm.spec, layer, x)
        gathered = moe._biased_gathered(x, layer, weights, experts, alpha, limit)
        dense = sum(moe._biased_expert(x, layer, e, alpha, limit) * (weights * (experts == e)).sum(-1, keepdim=True)
                    for e in range(4))
    torch.testing.assert_close(gathered, grouped, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dense, grouped, rtol=1e-5, atol=1e-6)


def test_decode_paths_read_only_the_chosen_experts():
    """One row: every expert it did not choose holds NaN (a read of it would poison the output), and
    the eager path and the compiled step's gathered path give the clean stacks' values."""
    from genfn.models import moe

    _, gm = pair()
    layer = gm.params["layers"][2]
    x = torch.randn(1, 64)
    weights, experts = moe.route_top_k_softmax(x, layer["router"], layer["router_bias"], 2)
    unchosen = [e for e in range(4) if e not in experts[0].tolist()]
    poisoned = dict(layer)
    for name in ("experts_gate_up", "experts_gate_up_bias", "experts_down", "experts_down_bias"):
        poisoned[name] = layer[name].clone()
        poisoned[name][unchosen] = float("nan")
    alpha, limit = gm.spec.swiglu_alpha, gm.spec.swiglu_limit
    with torch.no_grad():
        clean = moe.biased_moe_mlp(gm.spec, layer, x)
        eager = moe.biased_moe_mlp(gm.spec, poisoned, x)
        gathered = moe._biased_gathered(x, poisoned, weights, experts, alpha, limit)
    assert torch.isfinite(eager).all() and torch.isfinite(gathered).all()
    torch.testing.assert_close(eager, clean)
    torch.testing.assert_close(gathered, clean, rtol=1e-5, atol=1e-6)


def test_quantize_q8_0_runs_the_experts_as_blocks():
    """The expert stacks become ``QuantizedExperts`` and compute what their dequantized floats do
    (up to the kernel's 8-bit activations); the whole quantized model generates. (Against the float
    model a quantized one can route a token to another expert: a jump, not an error.)"""
    from genfn.models.model import Model
    from genfn.models.quantized import quantize_params
    from genfn.quant.experts import QuantizedExperts

    _, gm = pair()
    quantized = quantize_params(gm.params, "q8_0")
    experts = ("experts_gate_up", "experts_down")
    assert all(isinstance(layer[k], QuantizedExperts) for layer in quantized["layers"] for k in experts)

    def with_experts(make):
        layers = [{**layer, **{k: make(q[k], layer[k]) for k in experts}}
                  for layer, q in zip(gm.params["layers"], quantized["layers"])]
        return Model(gm.spec, {**gm.params, "layers": layers}, gm.apply_fn, gm.init_cache_fn)

    blocks = with_experts(lambda q, _: q)
    floats = with_experts(lambda q, plain: q.dequantize().reshape(plain.shape))
    ids, mask = padded_prompts(length=LENGTH, seed=6)
    reference = prefill_logits(floats, ids, mask)
    assert (prefill_logits(blocks, ids, mask) - reference).abs().max() < 0.01 * reference.abs().max()
    whole = Model(gm.spec, quantized, gm.apply_fn, gm.init_cache_fn)
    settings = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0, disable_compile=True)
    assert genfn.generate(whole, ids, attention_mask=mask, **settings).shape == (3, ids.shape[1] + 6)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_generate_batch_equals_generate(compiled):
    import random

    from genfn.config import ContinuousBatchingConfig

    _, gm = pair()
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 97) for _ in range(rng.randint(1, 14))] for _ in range(6)]
    # Small blocks and a small token budget: prompts are chunked and requests decode side by side,
    # past the window; compiled: the packed forward under torch.compile(fullgraph=True).
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=48, max_batch_tokens=16, max_requests_per_batch=4,
                                  default_compile_level=int(compiled))
    results = gm.generate_batch(prompts, max_new_tokens=10, do_sample=False, eos_token_id=None,
                                continuous_batching_config=cb)
    for out, prompt in zip(results.values(), prompts):
        alone = genfn.generate(gm, torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                               disable_compile=True)
        assert out.generated_tokens == alone[0, len(prompt):].tolist()


def test_a_compiled_batching_forward_after_another_models_compiles_its_own():
    """Each engine compiles its forward under a code object of its own (``genfn.driver.own_code``):
    sharing one, GPT-OSS's frame was checked against an earlier Llama graph's guards, and dynamo
    failed evaluating them on GPT-OSS's weights (``KeyError: 'w_down'``)."""
    from batching_support import WAIT_S
    from conftest import tiny_pair
    from genfn.batching import ContinuousBatchingManager
    from genfn.config import ContinuousBatchingConfig
    from test_batching_beams import BEAMS, OTHERS

    cb = ContinuousBatchingConfig(page_size=4, num_blocks=48, max_batch_tokens=16, max_requests_per_batch=8,
                                  max_blocks_per_request=16, default_compile_level=1)
    # Llama's compiled forward over beams, greedy and sampled rows (the guards GPT-OSS's frame then met)
    manager = ContinuousBatchingManager(tiny_pair(seed=6)[1], None, cb)
    manager.start()
    try:
        for rid, (prompt, limit, settings) in {**BEAMS, **OTHERS}.items():
            manager.add_sequences(prompt, rid, max_new_tokens=limit, **settings)
        for _ in range(sum(settings.get("num_return_sequences", 1) for _, _, settings in BEAMS.values()) + len(OTHERS)):
            assert manager.get_result(timeout=20 * WAIT_S) is not None, "no result came"
    finally:
        manager.stop(timeout=WAIT_S)
    _, gm = pair()
    prompts = [[5, 17, 3, 88, 41, 9], [12, 7, 60]]
    results = gm.generate_batch(prompts, max_new_tokens=4, do_sample=False, eos_token_id=None,
                                continuous_batching_config=cb)
    for out, prompt in zip(results.values(), prompts):
        alone = genfn.generate(gm, torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                               disable_compile=True)
        assert out.generated_tokens == alone[0, len(prompt):].tolist(), out.error


def test_sink_softmax_is_the_softmax_with_each_heads_sink_appended():
    from genfn.cache.paged import sink_softmax

    scores = torch.randn(3, 2, 2, 7)
    scores[0, :, :, 3:] = float("-inf")
    sinks = torch.randn(4).view(1, 2, 2, 1)
    full = torch.softmax(torch.cat([scores, sinks.expand(3, 2, 2, 1)], -1), -1)
    torch.testing.assert_close(sink_softmax(scores, sinks), full[..., :-1])
    assert torch.isfinite(sink_softmax(torch.full((1, 2, 2, 3), float("-inf")), sinks)).all()


# ---- GGUF, as llama.cpp's converter writes GPT-OSS --------------------------------------------

_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}


def write_gpt_oss_gguf(path, hf, mxfp4: bool = False):
    """``hf`` as llama.cpp writes it: gate and up split out of their alternating columns, down
    transposed, the sinks as ``attn_sinks.weight``; the expert stacks F32 or MXFP4."""
    cfg = hf.config
    w = gguf_writer(path, "gpt-oss", cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(cfg.rope_parameters["factor"])
    w.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])

    def stack(name, a):
        a = np.ascontiguousarray(a, dtype=np.float32)
        if mxfp4:
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.MXFP4),
                         raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            w.add_tensor(name, a)

    for name, tensor in hf.state_dict().items():
        a = tensor.numpy().astype(np.float32)
        if name in _NAMES:
            w.add_tensor(_NAMES[name], a)
            continue
        _, _, layer, part = name.split(".", 3)
        blk = f"blk.{layer}."
        if part == "self_attn.sinks":
            w.add_tensor(blk + "attn_sinks.weight", a)
        elif part == "mlp.experts.gate_up_proj":  # [E, H, 2I] alternating -> gate, up [E, I, H]
            stack(blk + "ffn_gate_exps.weight", a[:, :, 0::2].transpose(0, 2, 1))
            stack(blk + "ffn_up_exps.weight", a[:, :, 1::2].transpose(0, 2, 1))
        elif part == "mlp.experts.gate_up_proj_bias":
            w.add_tensor(blk + "ffn_gate_exps.bias", np.ascontiguousarray(a[:, 0::2]))
            w.add_tensor(blk + "ffn_up_exps.bias", np.ascontiguousarray(a[:, 1::2]))
        elif part == "mlp.experts.down_proj":  # [E, I, H] -> [E, H, I]
            stack(blk + "ffn_down_exps.weight", a.transpose(0, 2, 1))
        elif part == "mlp.experts.down_proj_bias":
            w.add_tensor(blk + "ffn_down_exps.bias", a)
        else:
            stem, kind = part.rsplit(".", 1)
            w.add_tensor(blk + f"{_BLOCK[stem]}.{kind}", a)
    finish_gguf(w)
    return path


def _same_spec(from_gguf, gm) -> bool:
    """Equal specs but for the norm's epsilon, which GGUF stores as float32."""
    assert from_gguf.spec.rms_norm_eps == pytest.approx(gm.spec.rms_norm_eps)
    return dataclasses.replace(from_gguf.spec, rms_norm_eps=gm.spec.rms_norm_eps) == gm.spec


def test_gguf_with_llama_cpp_names_gives_the_safetensors_logits(tmp_path):
    hf = tiny_gpt_oss(swiglu_limit=7.0)  # llama.cpp fixes the clamp at 7 (no key in the file)
    gm = _genfn_of(hf)
    from_gguf = genfn.load(write_gpt_oss_gguf(tmp_path / "gpt_oss.gguf", hf))
    assert _same_spec(from_gguf, gm)
    ids, mask = padded_prompts(length=LENGTH, seed=2)
    assert (prefill_logits(from_gguf, ids, mask) - prefill_logits(gm, ids, mask)).abs().max() < 1e-5


def _mxfp4_round_trip(a: np.ndarray) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType.MXFP4
    return gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), qtype), qtype)


def test_gguf_mxfp4_experts_dequantize_bit_exactly_and_give_the_safetensors_logits(tmp_path):
    hf = tiny_gpt_oss(swiglu_limit=7.0)
    path = write_gpt_oss_gguf(tmp_path / "gpt_oss_mxfp4.gguf", hf, mxfp4=True)
    # The safetensors copy: the same weights, the experts rounded through MXFP4 as the file holds them.
    with torch.no_grad():
        for layer in hf.model.layers:
            gate_up = layer.mlp.experts.gate_up_proj.numpy().transpose(0, 2, 1)  # [E, 2I, H] alternating rows
            rows = np.empty_like(gate_up)
            rows[:, 0::2], rows[:, 1::2] = _mxfp4_round_trip(gate_up[:, 0::2]), _mxfp4_round_trip(gate_up[:, 1::2])
            layer.mlp.experts.gate_up_proj.copy_(torch.from_numpy(rows.transpose(0, 2, 1).copy()))
            down = layer.mlp.experts.down_proj.numpy().transpose(0, 2, 1)
            layer.mlp.experts.down_proj.copy_(torch.from_numpy(_mxfp4_round_trip(down).transpose(0, 2, 1).copy()))
    gm = _genfn_of(hf)
    from_gguf = genfn.load(path)
    assert _same_spec(from_gguf, gm)
    reader = gguf.GGUFReader(str(path))
    stored = {t.name: t for t in reader.tensors}
    for i, layer in enumerate(from_gguf.params["layers"]):
        info = stored[f"blk.{i}.ffn_down_exps.weight"]
        assert info.tensor_type == gguf.GGMLQuantizationType.MXFP4
        expected = gguf.quants.dequantize(info.data, info.tensor_type).reshape(layer["experts_down"].shape)
        assert torch.equal(layer["experts_down"], torch.from_numpy(expected))  # bit for bit
        assert torch.equal(layer["experts_gate_up"], gm.params["layers"][i]["experts_gate_up"])
    ids, mask = padded_prompts(length=LENGTH, seed=2)
    assert (prefill_logits(from_gguf, ids, mask) - prefill_logits(gm, ids, mask)).abs().max() < 1e-5
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    assert (theirs - prefill_logits(from_gguf, ids, mask)).abs().max() < 1e-4


def test_saved_directory_loads_in_transformers_with_the_same_logits(tmp_path):
    hf, gm = pair()
    directory = genfn.save(gm, tmp_path / "gpt_oss")
    back = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    assert type(back) is type(hf)
    ids, mask = padded_prompts(length=LENGTH, seed=4)
    with torch.no_grad():
        theirs = back(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    assert (theirs - prefill_logits(gm, ids, mask)).abs().max() < 1e-4
    assert genfn.load(directory).spec == gm.spec


def test_bad_settings_are_refused_clearly():
    from genfn.models import gpt_oss

    config = {**transformers.GptOssConfig(**SETTINGS).to_dict(), "num_experts_per_tok": 5}
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        gpt_oss.spec_from_config(config)
