"""The Llama-shaped families (Qwen3, SmolLM3, OLMo 2, Phi-3/Phi-4-mini, YaRN and LongRoPE scaling)
against transformers on tiny random configs: logits at every position of a padded prefill and of
each cached step, greedy and beam tokens over 32 steps, GGUF files written with llama.cpp's names,
and ``genfn.save`` directories transformers loads."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import genfn
from conftest import assert_prefill_and_cached_steps_match, finish_gguf, gguf_writer, llama_cpp_permute
from conftest import padded_prompts, prefill_logits, tiny_pair

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# head_dim 16 (64 / 4): LongRoPE takes 8 factors per list.
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
             "long_factor": [2.0 + 0.3 * i for i in range(8)]}
FAMILIES = {
    "qwen3": ("Qwen3ForCausalLM", {}),
    "qwen3_tied_mqa": ("Qwen3ForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "smollm3": ("SmolLM3ForCausalLM", dict(num_hidden_layers=4)),  # layer 3 attends without RoPE
    "olmo2": ("Olmo2ForCausalLM", {}),
    "phi3_window": ("Phi3ForCausalLM", dict(sliding_window=5)),  # prompts and runs longer than the window
    "phi4_mini": ("Phi3ForCausalLM", dict(partial_rotary_factor=0.75, tie_word_embeddings=True)),
    # original context 8: the prefill runs on the short factors, the cached steps past it on the long.
    "phi3_longrope": ("Phi3ForCausalLM", dict(max_position_embeddings=64, original_max_position_embeddings=8,
                                              rope_parameters=_LONGROPE)),
    "llama_yarn": ("LlamaForCausalLM", dict(max_position_embeddings=128, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32})),
}
# Gemma: 4 layers, sliding and global alternating, a window of 4 (prompts of 9), an attention
# scale of its own; Gemma 2 soft-caps scores and logits (small caps, so they bite), Gemma 3 has
# per-head q/k norms and its global layers' RoPE scaled linearly over their own base.
_GEMMA = dict(num_hidden_layers=4, head_dim=16, sliding_window=4, query_pre_attn_scalar=24)
FAMILIES.update({
    "gemma2": ("Gemma2ForCausalLM", dict(_GEMMA, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3ForCausalLM", dict(_GEMMA, sliding_window_pattern=2, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # As llama.cpp fixes them: attention scaled by head_dim, Gemma 3's global layer every 6th.
    "gemma2_llama_cpp": ("Gemma2ForCausalLM", dict(_GEMMA, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                                                   final_logit_softcapping=3.0)),
    "gemma3_llama_cpp": ("Gemma3ForCausalLM", dict(_GEMMA, query_pre_attn_scalar=16, num_hidden_layers=6,
                                                   rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "gemma3_untied": ("Gemma3ForCausalLM", dict(_GEMMA, tie_word_embeddings=False, num_key_value_heads=1,
                                                final_logit_softcapping=3.0)),
})
# Mixtures of experts: 4 experts, 2 chosen per token.
FAMILIES.update({
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              norm_topk_prob=True)),
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=5)),
    "olmoe": ("OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2)),
})
_PAIRS: dict = {}


def _gemma_pair(arch, overrides):
    """Gemma's tiny pair: Gemma 3's text config class, and transformers' eager attention (its SDPA
    path drops the soft-capping Gemma 2 applies)."""
    from genfn.models.model import from_hf_state_dict

    config_class = transformers.Gemma2Config if arch == "Gemma2ForCausalLM" else transformers.Gemma3TextConfig
    torch.manual_seed(0)
    settings = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = config_class(**{**settings, **overrides})
    config._attn_implementation = "eager"
    hf = getattr(transformers, arch)(config).eval()
    config_dict = config.to_dict()
    config_dict["architectures"] = [arch]
    return hf, from_hf_state_dict(config_dict, hf.state_dict())


def pair(name):
    if name not in _PAIRS:
        arch, overrides = FAMILIES[name]
        _PAIRS[name] = _gemma_pair(arch, overrides) if arch.startswith("Gemma") else tiny_pair(arch, **overrides)
    return _PAIRS[name]


@pytest.mark.parametrize("name", FAMILIES)
def test_prefill_and_every_cached_step_match_transformers(name):
    assert_prefill_and_cached_steps_match(*pair(name), *padded_prompts())


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_and_beam_tokens_equal_transformers_over_32_steps(name):
    hf, gm = pair(name)
    ids, mask = padded_prompts(seed=1)
    settings = dict(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        greedy = hf.generate(ids, attention_mask=mask, **settings)
        beams = hf.generate(ids, attention_mask=mask, num_beams=3, **settings)
    assert greedy.shape[1] == ids.shape[1] + 32
    assert torch.equal(genfn.generate(gm, ids, attention_mask=mask, disable_compile=True, **settings), greedy)
    assert torch.equal(genfn.generate(gm, ids, attention_mask=mask, num_beams=3, disable_compile=True, **settings),
                       beams)


@pytest.mark.parametrize("name", ["phi3_window", "gemma2", "qwen3_moe"])
@pytest.mark.parametrize("cache", ["dynamic", "offloaded_static"])
def test_other_caches_give_the_static_caches_tokens(name, cache):
    _, gm = pair(name)
    ids, mask = padded_prompts(seed=6)
    settings = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0, disable_compile=True)
    static = genfn.generate(gm, ids, attention_mask=mask, cache_implementation="static", **settings)
    assert torch.equal(genfn.generate(gm, ids, attention_mask=mask, cache_implementation=cache, **settings), static)


# ---- GGUF, as llama.cpp's converter writes each family ---------------------------------------

_GGUF_ARCH = {"Qwen3ForCausalLM": "qwen3", "SmolLM3ForCausalLM": "smollm3", "Olmo2ForCausalLM": "olmo2",
              "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
              "Qwen3MoeForCausalLM": "qwen3moe", "MixtralForCausalLM": "llama", "OlmoeForCausalLM": "olmoe"}
_GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_feedforward_layernorm": "post_ffw_norm", "pre_feedforward_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
}


def _gguf_name(arch: str, hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if not stem.startswith("model.layers."):
        return f"{_GGUF_NAMES[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)
    if part == "post_attention_layernorm":  # OLMo 2's and Gemma's norm after attention; the others' before the MLP
        part_name = "post_attention_norm" if arch in ("olmo2", "gemma2", "gemma3") else "ffn_norm"
    else:
        part_name = _GGUF_NAMES[part]
    return f"blk.{layer}.{part_name}.{kind}"


def expert_stack_tensor(a: np.ndarray, ggml_type: str | None):
    """``(array, raw_dtype)`` for ``GGUFWriter.add_tensor`` of a stacked expert projection
    ``[E, rows, cols]`` stored as ``ggml_type`` (None: F32; K-quants by genfn's quantizer)."""
    if ggml_type is None:
        return np.ascontiguousarray(a), None
    qtype = gguf.GGMLQuantizationType[ggml_type]
    if ggml_type.endswith("_K"):
        from genfn.quant import quantize_k

        experts, rows, cols = a.shape
        data = quantize_k(torch.from_numpy(np.ascontiguousarray(a).reshape(-1, cols)), ggml_type.lower()).data
        return data.numpy().reshape(experts, rows, -1), qtype
    return gguf.quants.quantize(np.ascontiguousarray(a), qtype), qtype


def write_family_gguf(path, hf, quantize: frozenset = frozenset(), expert_type: str | None = None,
                      vocab: bool = False):
    """``hf``'s weights and settings as llama.cpp's converter writes them (F32; ``quantize`` names
    as Q8_0; the expert stacks as ``expert_type``, see ``expert_stack_tensor``). ``vocab``: with a
    stand-in SentencePiece vocabulary (token i is ``<i>``), which llama.cpp needs to load a file."""
    cfg = hf.config
    arch = _GGUF_ARCH[type(hf).__name__]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf_writer(path, arch, cfg)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch == "phi3":
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        if cfg.sliding_window is not None:
            w.add_sliding_window(cfg.sliding_window)
        if cfg.rope_parameters.get("rope_type") == "longrope":
            w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
            w.add_tensor("rope_factors_long.weight", np.asarray(cfg.rope_parameters["long_factor"], np.float32))
            w.add_tensor("rope_factors_short.weight", np.asarray(cfg.rope_parameters["short_factor"], np.float32))
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "sliding_window", None) is not None:
            w.add_sliding_window(cfg.sliding_window)
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg.sliding_window)
        if arch == "gemma2":
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        else:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(cfg.rope_parameters["full_attention"]["factor"])
    if vocab:
        w.add_tokenizer_model("llama")
        w.add_token_list([f"<{i}>" for i in range(cfg.vocab_size)])
        w.add_token_scores([0.0] * cfg.vocab_size)
        w.add_token_types([gguf.TokenType.NORMAL] * cfg.vocab_size)
    for name, tensor in hf.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        if ".mlp.experts." in name:  # llama.cpp stacks each projection's experts: [E, rows, cols]
            layer = name.split(".")[2]
            if name.endswith("gate_up_proj"):
                gate, up = np.split(tensor.numpy().astype(np.float32), 2, axis=1)
                for part, values in (("gate", gate), ("up", up)):
                    array, raw = expert_stack_tensor(values, expert_type)
                    w.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", array, raw_dtype=raw)
            else:
                array, raw = expert_stack_tensor(tensor.numpy().astype(np.float32), expert_type)
                w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", array, raw_dtype=raw)
            continue
        g = _gguf_name(arch, name)
        a = tensor.numpy().astype(np.float32)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp stores Gemma's (1 + w) norms shifted
        if arch in ("smollm3", "llama") and ".attn_q." in g:
            a = llama_cpp_permute(a, cfg.num_attention_heads)
        elif arch in ("smollm3", "llama") and ".attn_k." in g:
            a = llama_cpp_permute(a, cfg.num_key_value_heads)
        if g in quantize:
            w.add_tensor(g, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(g, a)
    finish_gguf(w)
    return path


_GGUF_FAMILIES = ["qwen3", "qwen3_tied_mqa", "smollm3", "olmo2", "phi3_window", "phi4_mini", "phi3_longrope",
                  "gemma2_llama_cpp", "gemma3_llama_cpp", "qwen3_moe", "mixtral", "olmoe"]


@pytest.mark.parametrize("name", _GGUF_FAMILIES)
def test_gguf_with_llama_cpp_names_gives_the_safetensors_logits(name, tmp_path):
    hf, gm = pair(name)
    from_gguf = genfn.load(write_family_gguf(tmp_path / f"{name}.gguf", hf))
    switches = ("architecture", "qk_norm", "rope_layers", "post_norms", "rotary_dim", "sliding_window",
                "original_context", "tie_word_embeddings", "num_kv_heads", "head_dim", "sliding_layers",
                "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "local_rope_theta",
                "num_experts", "experts_per_token", "norm_topk_prob", "moe_intermediate_size")
    assert [getattr(from_gguf.spec, k, None) for k in switches] == [getattr(gm.spec, k, None) for k in switches]
    ids, mask = padded_prompts(seed=2)
    assert (prefill_logits(from_gguf, ids, mask) - prefill_logits(gm, ids, mask)).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["qwen3", "smollm3", "olmo2", "phi4_mini", "gemma3_llama_cpp"])
def test_gguf_q8_0_blocks_run_through_the_quantized_kernel(name, tmp_path):
    hf, gm = pair(name)
    names = [g for g in (_gguf_name(_GGUF_ARCH[type(hf).__name__], n) for n in hf.state_dict())
             if g.endswith(".weight") and g.split(".")[-2] in ("attn_q", "attn_k", "attn_v", "attn_qkv",
                                                                "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    path = write_family_gguf(tmp_path / f"{name}.gguf", hf, quantize=frozenset(names))
    blocks = genfn.load(path, quantize="gguf")
    assert type(blocks.params["layers"][0]["wo"]).__name__ == "QuantizedWeight"
    ids, mask = padded_prompts(seed=3)
    # The same blocks dequantized: the kernel (int8 activations against the blocks) stays close.
    plain = prefill_logits(genfn.load(path), ids, mask)
    assert (prefill_logits(blocks, ids, mask) - plain).abs().max() < 0.05 * plain.abs().max()
    settings = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0, disable_compile=True)
    assert genfn.generate(blocks, ids, attention_mask=mask, **settings).shape == (3, ids.shape[1] + 8)


@pytest.mark.parametrize("name", ["qwen3", "smollm3", "olmo2", "phi3_window", "phi4_mini", "phi3_longrope",
                                  "llama_yarn", "gemma2", "gemma3", "gemma3_untied", "qwen3_moe", "mixtral", "olmoe"])
def test_saved_directory_loads_in_transformers_with_the_same_logits(name, tmp_path):
    hf, gm = pair(name)
    directory = genfn.save(gm, tmp_path / name)
    back = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    assert type(back) is type(hf)
    ids, mask = padded_prompts(seed=4)
    with torch.no_grad():
        theirs = back(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    assert (theirs - prefill_logits(gm, ids, mask)).abs().max() < 1e-4
    reloaded = genfn.load(directory)
    assert reloaded.spec == gm.spec


def test_a_family_genfn_lacks_names_the_native_ones_and_from_module():
    from genfn.models.model import from_hf_state_dict

    with pytest.raises(ValueError, match=r"GPTNeoXForCausalLM.*Qwen3ForCausalLM.*Olmo2ForCausalLM.*"
                                         r"Phi3ForCausalLM.*from_module"):
        from_hf_state_dict({"architectures": ["GPTNeoXForCausalLM"], "vocab_size": 10}, {})


def test_sliding_windows_on_some_layers_only_are_refused_clearly():
    from genfn.models import llama

    config = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
              "num_hidden_layers": 2, "num_attention_heads": 2, "use_sliding_window": True, "sliding_window": 4}
    with pytest.raises(ValueError, match="use_sliding_window.*from_module"):
        llama.spec_from_config(config)


@pytest.mark.parametrize("arch,extra", [("Qwen3ForCausalLM", {}), ("Gemma2ForCausalLM", {}),
                                        ("GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2))])
def test_every_decoder_family_refuses_a_bad_config_in_the_same_words(arch, extra):
    import importlib

    from genfn.models.registry import ARCHITECTURES

    spec_from_config = importlib.import_module(ARCHITECTURES[arch]).spec_from_config
    config = dict(architectures=[arch], vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, **extra)
    spec = spec_from_config(config)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (2, 2, 16)
    with pytest.raises(ValueError, match="config.json is missing the required field 'intermediate_size'"):
        spec_from_config({k: v for k, v in config.items() if k != "intermediate_size"})
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"):
        spec_from_config({**config, "num_key_value_heads": 3})
    if arch != "Qwen3ForCausalLM":  # the families with sliding and full layers
        assert spec.sliding_layers == (True, False)
        with pytest.raises(ValueError, match="layer_types has 1 entries for 2 layers"):
            spec_from_config({**config, "layer_types": ["full_attention"]})


@pytest.mark.parametrize("name", ["qwen3", "gemma2"])
def test_an_early_exit_past_the_models_layers_is_refused(name):
    _, gm = pair(name)
    ids, positions = torch.tensor([[5, 6]]), torch.tensor([[0, 1]])
    layers = gm.spec.num_layers
    with torch.no_grad():
        logits, _ = gm.apply(ids, positions, gm.init_cache(1, 8), num_layers=1)
        assert logits.shape == (1, 2, gm.spec.vocab_size)
        for bad in (0, layers + 1, True, 1.0):
            with pytest.raises(ValueError, match=rf"num_layers must be an int in \[1, {layers}\].*got {bad!r}"):
                gm.apply(ids, positions, gm.init_cache(1, 8), num_layers=bad)


# ---- continuous batching: the packed forward serves the variants -----------------------------

@pytest.mark.parametrize("name", ["qwen3", "smollm3", "olmo2", "phi3_window", "phi4_mini", "llama_yarn", "qwen3_moe",
                                  "mixtral"])
def test_generate_batch_equals_generate(name):
    import random

    from genfn.config import ContinuousBatchingConfig

    _, gm = pair(name)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 97) for _ in range(rng.randint(1, 14))] for _ in range(6)]
    # Small blocks and a small token budget: prompts are chunked and requests decode side by side.
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=48, max_batch_tokens=16, max_requests_per_batch=4)
    results = gm.generate_batch(prompts, max_new_tokens=10, do_sample=False, eos_token_id=None,
                                continuous_batching_config=cb)
    for out, prompt in zip(results.values(), prompts):
        alone = genfn.generate(gm, torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                               disable_compile=True)
        assert out.generated_tokens == alone[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["phi3_longrope", "gemma3"])
def test_continuous_batching_runs_longrope_and_gemma(name):
    """Once refused; tests/test_batching_gemma.py checks their tokens against generate."""
    _, gm = pair(name)
    out = gm.generate_batch([[5, 6, 7]], max_new_tokens=2, do_sample=False, eos_token_id=None)
    assert len(next(iter(out.values())).generated_tokens) == 2


# ---- compiled equals eager, across the families ----------------------------------------------

@pytest.mark.slow
def test_compiled_decode_equals_eager_across_families():
    """One compiled static-cache run per family (a few minutes in all on a shared 2-core machine):
    greedy tokens of the compiled step equal the eager ones over a window-crossing run."""
    ids, mask = padded_prompts(seed=5)
    settings = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                    cache_implementation="static", max_cache_len=32)
    for name in ("qwen3", "smollm3", "olmo2", "phi3_window", "phi4_mini", "gemma2", "gemma3", "qwen3_moe"):
        _, gm = pair(name)
        eager = genfn.generate(gm, ids, attention_mask=mask, disable_compile=True, **settings)
        compiled = genfn.generate(gm, ids, attention_mask=mask, **settings)
        assert torch.equal(compiled, eager), name
        assert len(gm.compiled_steps) == 1, name


# ---- mixture of experts: the decode kernel reads only the chosen experts ---------------------

def test_moe_decode_kernel_reads_only_the_chosen_experts():
    """Unchosen experts hold NaN (any read of them would poison the output); the kernel's byte count
    is k experts' three projections per row; the values are the dense formulation's."""
    from genfn import kernels
    from genfn.models.moe import moe_mlp, native_moe_takes

    if not kernels.decode_linear_available():
        pytest.skip(f"native kernels unavailable: {kernels.kernel_status()}")
    torch.manual_seed(0)
    hidden, inter, num_experts, top_k = 64, 48, 8, 2
    gate_up = torch.randn(num_experts, 2 * inter, hidden) / 8
    down = torch.randn(num_experts, hidden, inter) / 8
    x = torch.randn(1, hidden)
    experts = torch.tensor([[5, 2]])
    weights = torch.tensor([[0.7, 0.3]])
    poisoned_gate_up, poisoned_down = gate_up.clone(), down.clone()
    unchosen = [e for e in range(num_experts) if e not in (5, 2)]
    poisoned_gate_up[unchosen] = float("nan")
    poisoned_down[unchosen] = float("nan")
    out, bytes_read = torch.ops.genfn_kernels.moe_decode(x, experts, weights, poisoned_gate_up, poisoned_down)
    assert torch.isfinite(out).all()
    assert int(bytes_read) == top_k * 3 * inter * hidden * 4  # batch 1: k of the 8 experts, once each
    expected = sum(w * F_silu_mlp(x[0], gate_up[e], down[e]) for e, w in ((5, 0.7), (2, 0.3)))
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)
    # Two rows choosing overlapping experts read each chosen (row, expert) pair once.
    _, two_rows = torch.ops.genfn_kernels.moe_decode(x.repeat(2, 1), torch.tensor([[5, 2], [2, 7]]),
                                                     weights.repeat(2, 1), gate_up, down)
    assert int(two_rows) == 4 * 3 * inter * hidden * 4
    assert native_moe_takes(x, gate_up)

    class Spec:
        experts_per_token, norm_topk_prob = top_k, True

    layer = {"router": torch.randn(num_experts, hidden), "experts_gate_up": gate_up, "experts_down": down}
    with torch.no_grad():
        native = moe_mlp(Spec, layer, x.view(1, 1, hidden))
        dense = moe_mlp(Spec, layer, x.repeat(16, 1).view(1, 16, hidden))[:, :1]  # 16 rows: torch's linears
    torch.testing.assert_close(native, dense, rtol=1e-5, atol=1e-5)


def F_silu_mlp(x, gate_up, down):
    gate, up = (gate_up @ x).chunk(2)
    return down @ (torch.nn.functional.silu(gate) * up)


def test_a_moe_decode_step_at_batch_1_calls_the_kernel_once_per_layer():
    from genfn import kernels

    if not kernels.decode_linear_available():
        pytest.skip(f"native kernels unavailable: {kernels.kernel_status()}")
    _, gm = pair("qwen3_moe")
    ids = torch.randint(3, 97, (1, 5))
    with torch.no_grad():
        _, cache = gm.apply(ids, torch.arange(5)[None], gm.init_cache(1, 16))
        with torch.profiler.profile() as profile:
            gm.apply(torch.tensor([[7]]), torch.tensor([[5]]), cache)
    calls = sum(e.count for e in profile.key_averages() if e.key == "genfn_kernels::moe_decode")
    assert calls == gm.spec.num_layers
