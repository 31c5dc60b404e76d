"""Tiny random transformers models and genfn's copy of their weights: the oracle pairs of the tests
and of ``benchmarks/shape_sweep.py``. transformers is imported only when a model is built."""

from __future__ import annotations

import torch

__all__ = ["tiny_hf_model", "tiny_pair"]


def tiny_hf_model(arch: str = "LlamaForCausalLM", seed: int = 0, **overrides):
    """A tiny random transformers model and the config dict genfn loads it from (97-token vocabulary,
    hidden 64, 2 layers of 4/2 heads unless ``overrides`` say otherwise)."""
    import transformers

    # LlamaConfig, Qwen3Config, ...; Gemma 3's text model has a config class of its own
    config_cls = getattr(transformers, {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(
        arch, arch.replace("ForCausalLM", "Config")))
    settings = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
    settings.update(overrides)
    torch.manual_seed(seed)
    config = config_cls(**settings)
    model = getattr(transformers, arch)(config).eval()
    config_dict = config.to_dict()
    config_dict["architectures"] = [arch]
    return model, config_dict


def tiny_pair(arch: str = "LlamaForCausalLM", seed: int = 0, **overrides):
    """(transformers model, genfn model) with the same random weights."""
    from genfn.models.model import from_hf_state_dict

    hf_model, config_dict = tiny_hf_model(arch, seed, **overrides)
    return hf_model, from_hf_state_dict(config_dict, hf_model.state_dict())
