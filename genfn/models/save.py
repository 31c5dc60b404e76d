"""``genfn.save(model, directory)``: a directory transformers' ``from_pretrained`` loads.

It writes ``config.json``, ``model.safetensors`` under Hugging Face tensor names,
``generation_config.json`` and, when the model has one, the tokenizer (``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``). A native model's fused projections are split
back (q/k/v from ``wqkv``, gate/up from ``w_gate_up``) and tied embeddings are stored once, as
transformers does, so a model loaded from GGUF becomes an ordinary transformers checkpoint. A
wrapped module (``genfn.from_module``) is saved by its own ``save_pretrained`` with the params.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from genfn.models import gemma, gpt_oss, llama_variants, registry
from genfn.models.adapter import ModuleSpec
from genfn.models.llama import LlamaSpec

__all__ = ["save", "llama_state_dict"]

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _plain(weight) -> torch.Tensor:
    """A weight as a dense tensor (a quantized weight is expanded: checkpoints hold dense ones)."""
    if isinstance(weight, torch.Tensor):
        return weight
    if hasattr(weight, "dequantize"):
        return weight.dequantize()
    raise TypeError(f"cannot export a weight of type {type(weight).__name__}: it is neither a tensor nor dequantizable")


def llama_state_dict(spec: LlamaSpec, params) -> dict[str, torch.Tensor]:
    """Hugging Face names -> tensors for a Llama-family params pytree (the inverse of
    ``llama.params_from_state_dict``)."""
    q_rows = spec.num_heads * spec.head_dim
    kv_rows = spec.num_kv_heads * spec.head_dim
    state: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _plain(params["embed"])}
    fused = spec.architecture in llama_variants.FUSED_ARCHITECTURES  # Phi-3 keeps genfn's fused layout
    for i, layer in enumerate(params["layers"]):
        p = f"model.layers.{i}."
        if fused:
            state.update({p + "self_attn.qkv_proj.weight": _plain(layer["wqkv"]),
                          p + "mlp.gate_up_proj.weight": _plain(layer["w_gate_up"]),
                          p + "mlp.down_proj.weight": _plain(layer["w_down"])})
        else:
            q, k, v = _plain(layer["wqkv"]).split([q_rows, kv_rows, kv_rows], dim=0)
            state.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                          p + "self_attn.v_proj.weight": v})
        if spec.num_experts:
            state.update({p + "mlp.gate.weight": _plain(layer["router"]),
                          p + "mlp.experts.gate_up_proj": _plain(layer["experts_gate_up"]),
                          p + "mlp.experts.down_proj": _plain(layer["experts_down"])})
        elif not fused:
            gate, up = _plain(layer["w_gate_up"]).split([spec.intermediate_size, spec.intermediate_size], dim=0)
            state.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                          p + "mlp.down_proj.weight": _plain(layer["w_down"])})
        state[p + "self_attn.o_proj.weight"] = _plain(layer["wo"])
        state.update({name: _plain(t) for name, t in llama_variants.norm_state(spec, layer, p).items()})
        if spec.attention_bias:
            qb, kb, vb = _plain(layer["bqkv"]).split([q_rows, kv_rows, kv_rows], dim=0)
            state.update({p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb,
                          p + "self_attn.v_proj.bias": vb})
    state["model.norm.weight"] = _plain(params["norm"])
    if not spec.tie_word_embeddings:
        state["lm_head.weight"] = _plain(params["lm_head"])
    # safetensors stores each tensor's own bytes: no views into a fused buffer.
    return {name: t.detach().contiguous().clone() for name, t in state.items()}


def _llama_config(spec: LlamaSpec, config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    model_types = {arch: kind for kind, arch in registry.MODEL_TYPES.items()}
    out = {k: v for k, v in config.items() if v is not None or k in ("rope_scaling",)}
    out.update({
        "architectures": [spec.architecture],
        "model_type": config.get("model_type") or model_types.get(spec.architecture, "llama"),
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings, "attention_bias": spec.attention_bias,
        "hidden_act": config.get("hidden_act", "silu"), "dtype": _DTYPE_NAMES.get(dtype, "float32"),
    })
    out["rope_parameters"] = {"rope_theta": spec.rope_theta, **(spec.rope_scaling or {"rope_type": "default"})}
    out["rope_scaling"] = spec.rope_scaling
    if spec.rotary_dim is not None:  # Phi-4-mini: transformers 5 reads it from rope_parameters
        out["partial_rotary_factor"] = out["rope_parameters"]["partial_rotary_factor"] = spec.rotary_dim / spec.head_dim
    if spec.rope_layers is not None:
        out["no_rope_layers"] = [int(flag) for flag in spec.rope_layers]
    if spec.original_context:
        out["original_max_position_embeddings"] = spec.original_context
    if spec.num_experts:
        count = "num_local_experts" if spec.architecture == "MixtralForCausalLM" else "num_experts"
        out.update({count: spec.num_experts, "num_experts_per_tok": spec.experts_per_token,
                    "norm_topk_prob": spec.norm_topk_prob})
        if spec.architecture == "Qwen3MoeForCausalLM":
            out["moe_intermediate_size"] = spec.moe_intermediate_size
    if spec.sliding_window is not None:
        out["sliding_window"] = spec.sliding_window
        if spec.architecture == "Qwen2ForCausalLM":
            out["use_sliding_window"] = True
    return out


def _gemma_config(spec: gemma.GemmaSpec, config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    gemma3 = spec.architecture == "Gemma3ForCausalLM"
    out = {k: v for k, v in config.items() if v is not None and k not in ("rope_scaling", "rope_theta")}
    global_rope = {"rope_theta": spec.rope_theta, **(spec.rope_scaling or {"rope_type": "default"})}
    out.update({
        "architectures": [spec.architecture], "model_type": "gemma3_text" if gemma3 else "gemma2",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position_embeddings, "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.attention_bias, "sliding_window": spec.sliding_window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in spec.sliding_layers],
        "query_pre_attn_scalar": int(spec.query_pre_attn_scalar) if spec.query_pre_attn_scalar.is_integer()
        else spec.query_pre_attn_scalar,
        "attn_logit_softcapping": spec.attn_logit_softcapping,
        "final_logit_softcapping": spec.final_logit_softcapping,
        "hidden_activation": "gelu_pytorch_tanh", "dtype": _DTYPE_NAMES.get(dtype, "float32"),
        "rope_parameters": {"full_attention": global_rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": spec.local_rope_theta}} if gemma3 else global_rope,
    })
    return out


def _gpt_oss_config(spec: gpt_oss.GptOssSpec, config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    out = {k: v for k, v in config.items() if v is not None and k not in ("rope_scaling", "rope_theta", "num_experts")}
    out.update({
        "architectures": [spec.architecture], "model_type": "gpt_oss", "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position_embeddings, "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.attention_bias, "sliding_window": spec.sliding_window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in spec.sliding_layers],
        "num_local_experts": spec.num_experts, "num_experts_per_tok": spec.experts_per_token,
        "swiglu_alpha": spec.swiglu_alpha, "swiglu_limit": spec.swiglu_limit,
        "rope_parameters": {"rope_theta": spec.rope_theta, **(spec.rope_scaling or {"rope_type": "default"})},
        "dtype": _DTYPE_NAMES.get(dtype, "float32"),
    })
    return out


def _save_tokenizer(tokenizer, directory: str) -> None:
    tokenizer.backend.save(os.path.join(directory, "tokenizer.json"))
    settings: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            settings[name] = value
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(settings, f, indent=2, ensure_ascii=False)
    if getattr(tokenizer, "chat_template", None):
        with open(os.path.join(directory, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(tokenizer.chat_template)


def save(model, directory: str | os.PathLike) -> str:
    """Write ``model`` to ``directory`` (created if needed) as a transformers-loadable checkpoint;
    returns the directory."""
    from safetensors.torch import save_file

    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"directory must be a directory path; {directory!r} is a file")
    os.makedirs(directory, exist_ok=True)
    spec = model.spec
    if isinstance(spec, ModuleSpec):
        keep = set(spec.module.state_dict())
        state = {name: t for name, t in model.params.items() if name in keep}
        spec.module.save_pretrained(directory, state_dict=state)
    elif isinstance(spec, LlamaSpec):
        save_file(llama_state_dict(spec, model.params), os.path.join(directory, "model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
            json.dump(_llama_config(spec, dict(model.config), model.dtype), f, indent=2, sort_keys=True)
    elif isinstance(spec, (gemma.GemmaSpec, gpt_oss.GptOssSpec)):
        family, config_of = (gemma, _gemma_config) if isinstance(spec, gemma.GemmaSpec) else (gpt_oss, _gpt_oss_config)
        state = family.state_dict_of(spec, model.params, _plain)
        save_file({name: t.detach().contiguous().clone() for name, t in state.items()},
                  os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config_of(spec, dict(model.config), model.dtype), f, indent=2, sort_keys=True)
    else:
        raise TypeError(f"genfn.save supports native Llama-family models and wrapped modules; got a model with "
                        f"spec {type(spec).__name__}")
    if model.generation_config is not None:
        model.generation_config.save_pretrained(directory)
    if model.tokenizer is not None:
        _save_tokenizer(model.tokenizer, directory)
    return directory
