"""The native Llama-family model computes transformers' logits, at prefill and at each cached step."""

import pytest
import torch

from conftest import assert_prefill_and_cached_steps_match, padded_prompts, tiny_pair
from genfn.models import llama

ARCHS = [
    ("LlamaForCausalLM", dict(tie_word_embeddings=True)),
    ("LlamaForCausalLM", dict(tie_word_embeddings=False, num_key_value_heads=4)),
    ("LlamaForCausalLM", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    ("LlamaForCausalLM", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, num_key_value_heads=1)),
    ("MistralForCausalLM", dict(sliding_window=6)),
    ("MistralForCausalLM", dict(tie_word_embeddings=True)),
    ("Qwen2ForCausalLM", dict()),
    ("Qwen2ForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=1)),
]


@pytest.mark.parametrize("arch,overrides", ARCHS)
def test_prefill_and_decode_logits_match_transformers(arch, overrides):
    hf, gm = tiny_pair(arch, **overrides)
    assert_prefill_and_cached_steps_match(hf, gm, *padded_prompts(), steps=6)


def test_attend_len_limits_attention_without_changing_results():
    hf, gm = tiny_pair()
    ids = torch.randint(3, 97, (2, 5))
    pos = torch.arange(5).expand(2, 5)
    full, _ = gm.apply(ids, pos, gm.init_cache(2, 64))
    short, _ = gm.apply(ids, pos, gm.init_cache(2, 64), attend_len=8)
    assert torch.allclose(full, short, atol=1e-6)


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match="LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM"):
        llama.spec_from_config({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10})


def test_missing_config_field_is_named():
    with pytest.raises(ValueError, match="hidden_size"):
        llama.spec_from_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 10})


def test_missing_tensor_is_named():
    hf, gm = tiny_pair()
    spec = gm.spec
    state = dict(hf.state_dict())
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        llama.params_from_state_dict(spec, state)


def test_bfloat16_model_runs_close_to_float32():
    from genfn.models.model import from_hf_state_dict
    from conftest import tiny_hf_model

    hf, config = tiny_hf_model()
    f32 = from_hf_state_dict(config, hf.state_dict())
    bf16 = from_hf_state_dict(config, hf.state_dict(), dtype=torch.bfloat16)
    ids = torch.randint(3, 97, (1, 6))
    pos = torch.arange(6)[None]
    a, _ = f32.apply(ids, pos, f32.init_cache(1, 16))
    b, _ = bf16.apply(ids, pos, bf16.init_cache(1, 16))
    assert b.dtype == torch.float32 and bf16.params["embed"].dtype == torch.bfloat16
    assert (a - b).abs().max() < 0.1
    with pytest.raises(ValueError, match="dtype"):
        from_hf_state_dict(config, hf.state_dict(), dtype=torch.int8)
