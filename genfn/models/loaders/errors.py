"""Errors and integrity checks shared by the checkpoint loaders.

A checkpoint that is missing, truncated or inconsistent must fail at load time with a message that
names the file and the problem, not later as a shape error deep inside a forward pass. Both
loaders therefore finish by checking the state dict against the names the llama-family model code
expects (`expected_tensor_names`).
"""

from __future__ import annotations

__all__ = ["CheckpointError", "LLAMA_FAMILY", "expected_tensor_names", "check_state_dict", "check_dtype"]


class CheckpointError(ValueError):
    """A checkpoint exists but cannot be used: corrupt, truncated, inconsistent or unsupported.

    A subclass of ValueError so that callers who only know "bad input" can catch it as such.
    """


# model_type values whose parameter names follow LlamaForCausalLM (Qwen3 adds q_norm/k_norm,
# which are extra names and do not break the check).
LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo2", "phi3"})


def expected_tensor_names(config: dict) -> list[str] | None:
    """The parameter names a llama-family checkpoint must contain, or None for other families.

    qkv biases are required when `attention_bias` is set; `lm_head.weight` when embeddings are
    not tied.
    """
    if config.get("model_type") not in LLAMA_FAMILY:
        return None
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.get("tie_word_embeddings"):
        names.append("lm_head.weight")
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        fused = config.get("model_type") == "phi3"  # q/k/v and gate/up stored as one matrix each
        projections = ("qkv_proj", "o_proj") if fused else ("q_proj", "k_proj", "v_proj", "o_proj")
        names += [f"{p}self_attn.{proj}.weight" for proj in projections]
        if config.get("attention_bias"):
            names += [f"{p}self_attn.{proj}.bias" for proj in ("q_proj", "k_proj", "v_proj")]
        mlp = ("gate_up_proj", "down_proj") if fused else ("gate_proj", "up_proj", "down_proj")
        names += [f"{p}mlp.{proj}.weight" for proj in mlp]
        names += _norm_names(config.get("model_type"), p)
    return names


def _norm_names(model_type: str | None, p: str) -> list[str]:
    if model_type == "olmo2":  # norms after attention and MLP, over the whole q/k projections
        return [f"{p}post_attention_layernorm.weight", f"{p}post_feedforward_layernorm.weight",
                f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
    names = [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
    if model_type == "qwen3":
        names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
    return names


def check_state_dict(state_dict: dict, config: dict, source: str) -> None:
    """Raise CheckpointError naming the missing tensors, if any."""
    expected = expected_tensor_names(config)
    if expected is None:
        return
    missing = [name for name in expected if name not in state_dict]
    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise CheckpointError(f"{source}: checkpoint is missing tensors: {shown}")


def check_dtype(dtype) -> None:
    """Weights are loaded as floating point; an integer dtype would silently truncate them."""
    import torch

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype (e.g. torch.float32), got {dtype!r}")
