"""The Llama-shaped families that differ from Llama in a few switches: Qwen3, SmolLM3, OLMo 2, Phi-3.

Each is Llama's decoder with some of these changed (the ``LlamaSpec`` fields that switch them):

- Qwen3: an RMSNorm over each query and key head before RoPE (``qk_norm="head"``).
- SmolLM3: every ``no_rope_layer_interval``-th layer attends without RoPE (``rope_layers``).
- OLMo 2: no norms before attention and MLP, one after each instead (``post_norms``), and an
  RMSNorm over the whole query and key projections (``qk_norm="projection"``).
- Phi-3 / Phi-4-mini: q/k/v and gate/up stored fused (``qkv_proj``, ``gate_up_proj``, which is
  genfn's own layout), LongRoPE, partial rotary (``rotary_dim``), a sliding window on every layer.

This module reads a config's variant fields and the variants' extra parameters; ``llama.py``
runs them. Nothing here imports ``llama.py``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from genfn.models.rope import attention_factor
from genfn.quant.fuse import cat_rows

__all__ = ["VARIANT_MODEL_TYPES", "variant_fields", "norm_params", "fused", "norm_state", "FUSED_ARCHITECTURES",
           "mlp_params"]

# config.json model_type -> architecture, for the variants.
VARIANT_MODEL_TYPES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# Architectures whose checkpoints store q/k/v and gate/up fused.
FUSED_ARCHITECTURES = frozenset({"Phi3ForCausalLM"})


def _rope_parameters(config: Mapping[str, Any]) -> Mapping[str, Any]:
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:
        params = params["full_attention"]
    return params if isinstance(params, Mapping) else {}


def _refuse_sliding_layers(arch: str, config: Mapping[str, Any]) -> None:
    if config.get("use_sliding_window") and config.get("sliding_window") is not None:
        raise ValueError(f"{arch} with use_sliding_window=True (sliding windows on some layers only) is not "
                         "supported natively; load it through transformers with genfn.from_module(module)")


def variant_fields(arch: str, config: Mapping[str, Any], head_dim: int, num_layers: int,
                   rope_scaling: dict | None) -> dict[str, Any]:
    """The ``LlamaSpec`` fields ``arch`` sets beyond Llama's (may include ``sliding_window``)."""
    fields: dict[str, Any] = {}
    if rope_scaling is not None:
        max_positions = int(config.get("max_position_embeddings") or 2048)
        original = rope_scaling.get("original_max_position_embeddings",
                                    config.get("original_max_position_embeddings"))
        if rope_scaling.get("rope_type") in ("yarn", "longrope") and original is None:
            raise ValueError(f"rope_scaling type {rope_scaling['rope_type']!r} needs "
                             "original_max_position_embeddings in the config")
        scaling = {**rope_scaling, "original_max_position_embeddings": original} if original is not None \
            else rope_scaling
        fields["rope_attention_factor"] = attention_factor(scaling, max_positions)
        if scaling.get("rope_type") == "longrope":
            fields["original_context"] = int(original)
    if arch == "Qwen3ForCausalLM":
        _refuse_sliding_layers(arch, config)
        fields.update(qk_norm="head", sliding_window=None)
    elif arch == "SmolLM3ForCausalLM":
        _refuse_sliding_layers(arch, config)
        flags = config.get("no_rope_layers")
        if flags is None:
            interval = int(config.get("no_rope_layer_interval", 4))
            flags = [(i + 1) % interval != 0 for i in range(num_layers)]
        if len(flags) != num_layers:
            raise ValueError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
        fields.update(rope_layers=tuple(bool(f) for f in flags), sliding_window=None)
        if all(fields["rope_layers"]):
            fields["rope_layers"] = None
    elif arch == "Olmo2ForCausalLM":
        fields.update(qk_norm="projection", post_norms=True, sliding_window=None)
    elif arch == "Qwen3MoeForCausalLM":
        _refuse_sliding_layers(arch, config)
        if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
            raise ValueError(f"{arch} with dense layers among the experts (mlp_only_layers, decoder_sparse_step) "
                             "is not supported natively; load it through transformers with genfn.from_module(module)")
        fields.update(qk_norm="head", sliding_window=None, **_experts(config, "num_experts", config.get(
            "norm_topk_prob", False), config.get("moe_intermediate_size")))
    elif arch == "MixtralForCausalLM":
        fields.update(_experts(config, "num_local_experts", True, config.get("intermediate_size")))
    elif arch == "OlmoeForCausalLM":
        if config.get("clip_qkv") is not None:
            raise ValueError(f"{arch} with clip_qkv is not supported natively; load it through transformers with "
                             "genfn.from_module(module)")
        fields.update(qk_norm="projection", sliding_window=None, **_experts(
            config, "num_experts", config.get("norm_topk_prob", False), config.get("intermediate_size")))
    elif arch == "Phi3ForCausalLM":
        partial = config.get("partial_rotary_factor", _rope_parameters(config).get("partial_rotary_factor", 1.0))
        if partial is not None and float(partial) != 1.0:
            fields["rotary_dim"] = int(head_dim * float(partial))
    return fields


def _experts(config: Mapping[str, Any], count_key: str, normalize: bool, intermediate) -> dict[str, Any]:
    # transformers 5 writes every family's expert count as num_local_experts; checkpoints say num_experts.
    count = config.get(count_key, config.get("num_local_experts", config.get("num_experts")))
    try:
        return dict(num_experts=int(count), experts_per_token=int(config["num_experts_per_tok"]),
                    norm_topk_prob=bool(normalize), moe_intermediate_size=int(intermediate))
    except (KeyError, TypeError):
        raise ValueError(f"a mixture-of-experts config needs {count_key}, num_experts_per_tok and the experts' "
                         "intermediate size") from None


def mlp_params(spec: Any, prefix: str, state_dict: Mapping[str, Any], get: Callable[[str], Any]) -> dict[str, Any]:
    """A layer's MLP weights: ``w_gate_up``/``w_down``, or a mixture of experts' router and stacked experts."""
    if spec.num_experts:
        return {"router": get(prefix + "mlp.gate.weight"),
                "experts_gate_up": get(prefix + "mlp.experts.gate_up_proj"),
                "experts_down": get(prefix + "mlp.experts.down_proj")}
    return {"w_gate_up": fused(state_dict, prefix + "mlp.gate_up_proj.weight", get,
                               lambda: cat_rows([get(prefix + f"mlp.{n}_proj.weight") for n in ("gate", "up")])),
            "w_down": cat_rows([get(prefix + "mlp.down_proj.weight")])}


def complete_rope_scaling(config: Mapping[str, Any], rope_scaling: dict | None) -> dict | None:
    """``rope_scaling`` with the config's top-level ``original_max_position_embeddings`` (where Phi-3
    keeps it) filled in, for the rope types that read it."""
    if rope_scaling is None or rope_scaling.get("rope_type") not in ("yarn", "longrope"):
        return rope_scaling
    if rope_scaling.get("original_max_position_embeddings") is None \
            and config.get("original_max_position_embeddings") is not None:
        return {**rope_scaling, "original_max_position_embeddings": int(config["original_max_position_embeddings"])}
    return rope_scaling


def norm_params(spec: Any, prefix: str, get: Callable[[str], Any]) -> dict[str, Any]:
    """A layer's norm weights under genfn's names (``prefix``: ``model.layers.{i}.``)."""
    if spec.post_norms:
        out = {"post_attn_norm": get(prefix + "post_attention_layernorm.weight"),
               "post_mlp_norm": get(prefix + "post_feedforward_layernorm.weight")}
    else:
        out = {"attn_norm": get(prefix + "input_layernorm.weight"),
               "mlp_norm": get(prefix + "post_attention_layernorm.weight")}
    if spec.qk_norm is not None:
        out.update(q_norm=get(prefix + "self_attn.q_norm.weight"), k_norm=get(prefix + "self_attn.k_norm.weight"))
    return out


def norm_state(spec: Any, layer: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The inverse of :func:`norm_params`: Hugging Face names -> a layer's norm weights."""
    if spec.post_norms:
        out = {prefix + "post_attention_layernorm.weight": layer["post_attn_norm"],
               prefix + "post_feedforward_layernorm.weight": layer["post_mlp_norm"]}
    else:
        out = {prefix + "input_layernorm.weight": layer["attn_norm"],
               prefix + "post_attention_layernorm.weight": layer["mlp_norm"]}
    if spec.qk_norm is not None:
        out.update({prefix + "self_attn.q_norm.weight": layer["q_norm"],
                    prefix + "self_attn.k_norm.weight": layer["k_norm"]})
    return out


def fused(state_dict: Mapping[str, Any], name: str, get: Callable[[str], Any], parts: Callable[[], Any]):
    """The checkpoint's fused matrix ``name`` when it has one (Phi-3), else ``parts()`` concatenated."""
    return cat_rows([get(name)]) if name in state_dict else parts()
