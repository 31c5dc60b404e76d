"""GPT-OSS (transformers' ``GptOssForCausalLM``, llama.cpp's ``gpt-oss``) as pure functions:
``apply(spec, params, tokens, positions, cache)``.

Llama's decoder (RMSNorm before attention and MLP, grouped-query attention, rotary embeddings)
with GPT-OSS's changes:

- attention sinks: each head has a learned logit that joins every row's softmax, takes its share
  of the probability and contributes no value (``genfn.cache.paged.sink_softmax``);
- sliding-window (``sliding_window``, 128) and full-attention layers alternating (``layer_types``);
- biases on q, k, v and o; YaRN RoPE (transformers' default ``rope_parameters``);
- a mixture of experts in every layer (``genfn.models.moe.biased_moe_mlp``): a router with a bias,
  the top ``k`` logits softmaxed among themselves, experts with biases and a clamped SwiGLU.

transformers stores each layer's experts as ``gate_up_proj [E, H, 2I]`` with gate and up in
alternating columns and ``down_proj [E, I, H]`` (``x @ W``); genfn keeps them as the other MoE
families do, ``experts_gate_up [E, 2I, H]`` (gate rows, then up rows) and ``experts_down [E, H,
I]``, so the experts' linears and the quantized experts are the same code. The caches, the masks,
RoPE and the linears (float or quantized blocks) are Llama's.

Under tensor parallelism (``tensor_shard``; ``genfn.models.tensor_parallel``) a rank holds whole
key/value groups of heads with their q/k/v rows, biases and sinks, and a slice of every expert's
intermediate size; o's and the experts' down biases are added once, after the all-reduce.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar, Mapping

import torch

from genfn.cache.base import begin_forward
from genfn.cache.paged import sink_softmax
from genfn.cache.static import StaticCache
from genfn.kernels import linear
from genfn.kernels.invariant import refuse_without_invariant_forward
from genfn.models import tensor_parallel
from genfn.models.decoder_config import check_head_groups, decoder_sizes, required_field, sliding_layers
from genfn.models.llama import ModelOutput, first_layers, init_cache, tensor_getter
from genfn.models.llama import attention_mask as slot_mask
from genfn.models.llama_variants import complete_rope_scaling
from genfn.models.loaders.gguf_gpt_oss import alternate_rows
from genfn.models.moe import biased_moe_mlp
from genfn.models.rope import SUPPORTED_ROPE_TYPES, apply_rope, attention_factor, inverse_frequencies, rope_cos_sin
from genfn.quant.fuse import cat_rows

__all__ = ["GptOssSpec", "SUPPORTED_ARCHITECTURES", "spec_from_config", "params_from_state_dict", "apply",
           "init_cache", "state_dict_of", "project_qkv", "finish_layer", "final_logits", "attention_scale"]

SUPPORTED_ARCHITECTURES = ("GptOssForCausalLM",)
# transformers' GptOssConfig defaults, where a config.json leaves a field out.
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


@dataclasses.dataclass(frozen=True)
class GptOssSpec:
    """Static description of a GPT-OSS model (hashable: it keys compiled steps)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # each expert's
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_json: str | None  # JSON text: dicts are not hashable
    rope_attention_factor: float  # YaRN's scale of cos and sin
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    sliding_layers: tuple[bool, ...]  # True for a sliding-window layer
    num_experts: int
    experts_per_token: int
    swiglu_alpha: float
    swiglu_limit: float
    tensor_shard: tensor_parallel.TensorShard | None = None  # this rank's slice (genfn.models.tensor_parallel)

    # transformers' gate_up_proj [E, H, 2I] has gate and up in alternating columns (how
    # tensor_parallel.slice_plan cuts it, keeping each pair on one rank).
    experts_gate_up_interleaved: ClassVar[bool] = True

    @property
    def rope_scaling(self) -> dict | None:
        return None if self.rope_scaling_json is None else json.loads(self.rope_scaling_json)

    @property
    def num_query_groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def _rope(config: Mapping[str, Any]) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling or None)`` from transformers 5's ``rope_parameters`` or 4's fields."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", config.get("rope_theta"))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta, scaling = config.get("rope_theta"), config.get("rope_scaling")
        if scaling is None and "rope_scaling" not in config:
            scaling = dict(_DEFAULT_ROPE)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES or kind == "longrope":
            raise ValueError(f"rope_scaling type {kind!r} is not supported for GptOssForCausalLM")
        scaling = None if kind == "default" else {**scaling, "rope_type": kind}
    return float(theta if theta is not None else 150000.0), complete_rope_scaling(config, scaling)


def spec_from_config(config: Mapping[str, Any]) -> GptOssSpec:
    """A ``GptOssSpec`` from a Hugging Face ``config.json`` dict, with transformers' defaults."""
    archs = config.get("architectures") or []
    if not (set(archs) & set(SUPPORTED_ARCHITECTURES) or (not archs and config.get("model_type") == "gpt_oss")):
        raise ValueError(f"unsupported architecture {archs or [config.get('model_type')]}; supported architectures: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    sizes = decoder_sizes(config)
    experts = int(config.get("num_local_experts") or required_field(config, "num_experts"))
    top_k = int(required_field(config, "num_experts_per_tok"))
    theta, scaling = _rope(config)
    max_positions = int(config.get("max_position_embeddings") or 131072)
    window = config.get("sliding_window")
    spec = GptOssSpec(
        architecture="GptOssForCausalLM", **sizes, rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=theta, rope_scaling_json=None if scaling is None else json.dumps(scaling, sort_keys=True),
        rope_attention_factor=attention_factor(scaling, max_positions), max_position_embeddings=max_positions,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", True)),
        sliding_window=None if window is None else int(window),
        sliding_layers=sliding_layers(config, sizes["num_layers"], 2),
        num_experts=experts, experts_per_token=top_k,
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)), swiglu_limit=float(config.get("swiglu_limit", 7.0)),
    )
    check_head_groups(spec)
    if not 1 <= spec.experts_per_token <= spec.num_experts:
        raise ValueError(f"num_experts_per_tok ({spec.experts_per_token}) must be in [1, num_local_experts "
                         f"({spec.num_experts})]")
    return spec


def _expected_shapes(spec: GptOssSpec, prefix: str) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape, for one layer's tensors (``prefix``: ``model.layers.{i}.``)."""
    hidden, inter, experts = spec.hidden_size, spec.intermediate_size, spec.num_experts
    q_rows, kv_rows = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    a, m = prefix + "self_attn.", prefix + "mlp."
    return {a + "q_proj.weight": (q_rows, hidden), a + "k_proj.weight": (kv_rows, hidden),
            a + "v_proj.weight": (kv_rows, hidden), a + "o_proj.weight": (hidden, q_rows),
            a + "q_proj.bias": (q_rows,), a + "k_proj.bias": (kv_rows,), a + "v_proj.bias": (kv_rows,),
            a + "o_proj.bias": (hidden,), a + "sinks": (spec.num_heads,),
            m + "router.weight": (experts, hidden), m + "router.bias": (experts,),
            m + "experts.gate_up_proj": (experts, hidden, 2 * inter), m + "experts.gate_up_proj_bias": (experts, 2 * inter),
            m + "experts.down_proj": (experts, inter, hidden), m + "experts.down_proj_bias": (experts, hidden),
            prefix + "input_layernorm.weight": (hidden,), prefix + "post_attention_layernorm.weight": (hidden,)}


def _checked(get, spec: GptOssSpec, prefix: str):
    shapes = _expected_shapes(spec, prefix)

    def checked(name: str):
        value = get(name)
        if tuple(value.shape) != shapes[name]:
            raise ValueError(f"tensor {name} has shape {list(value.shape)}, but the config implies {list(shapes[name])}")
        return value
    return checked


def params_from_state_dict(spec: GptOssSpec, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None):
    """genfn's params pytree from Hugging Face parameter names: q/k/v fused (as Llama's), the experts
    in genfn's layout (gate and up de-interleaved into row halves, both stacks transposed)."""
    get = tensor_getter(state_dict, dtype)
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        t = _checked(get, spec, p)
        gate_up = t(p + "mlp.experts.gate_up_proj").transpose(1, 2)  # [E, 2I, H], gate and up rows alternating
        gate_up_bias = t(p + "mlp.experts.gate_up_proj_bias")
        layer = {
            "wqkv": cat_rows([t(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
            "wo": cat_rows([t(p + "self_attn.o_proj.weight")]),
            "sinks": t(p + "self_attn.sinks"),
            "router": t(p + "mlp.router.weight"), "router_bias": t(p + "mlp.router.bias"),
            "experts_gate_up": torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1).contiguous(),
            "experts_gate_up_bias": torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], dim=1).contiguous(),
            "experts_down": t(p + "mlp.experts.down_proj").transpose(1, 2).contiguous(),
            "experts_down_bias": t(p + "mlp.experts.down_proj_bias"),
            "attn_norm": t(p + "input_layernorm.weight"), "mlp_norm": t(p + "post_attention_layernorm.weight"),
        }
        if spec.attention_bias:
            layer["bqkv"] = torch.cat([t(p + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0)
            layer["bo"] = t(p + "self_attn.o_proj.bias")
        layers.append(layer)
    embed = get("model.embed_tokens.weight")
    if tuple(embed.shape) != (spec.vocab_size, spec.hidden_size):
        raise ValueError(f"tensor model.embed_tokens.weight has shape {list(embed.shape)}, but the config implies "
                         f"{[spec.vocab_size, spec.hidden_size]}")
    return {"embed": embed, "layers": layers, "norm": get("model.norm.weight"),
            "lm_head": embed if spec.tie_word_embeddings else get("lm_head.weight"),
            "inv_freq": inverse_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling)}


def state_dict_of(spec: GptOssSpec, params, plain) -> dict[str, torch.Tensor]:
    """Hugging Face names -> tensors (the inverse of ``params_from_state_dict``); ``plain`` turns a
    weight into a dense tensor."""
    q_rows, kv_rows, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size

    def interleaved(halves: torch.Tensor) -> torch.Tensor:  # [E, 2I, ...] gate rows, then up -> alternating
        return alternate_rows(*halves.split([inter, inter], dim=1))

    state = {"model.embed_tokens.weight": plain(params["embed"]), "model.norm.weight": plain(params["norm"])}
    for i, layer in enumerate(params["layers"]):
        p = f"model.layers.{i}."
        q, k, v = plain(layer["wqkv"]).split([q_rows, kv_rows, kv_rows], dim=0)
        state.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                      p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": plain(layer["wo"]),
                      p + "self_attn.sinks": layer["sinks"], p + "mlp.router.weight": plain(layer["router"]),
                      p + "mlp.router.bias": layer["router_bias"],
                      p + "mlp.experts.gate_up_proj": interleaved(plain(layer["experts_gate_up"])).transpose(1, 2),
                      p + "mlp.experts.gate_up_proj_bias": interleaved(layer["experts_gate_up_bias"]),
                      p + "mlp.experts.down_proj": plain(layer["experts_down"]).transpose(1, 2),
                      p + "mlp.experts.down_proj_bias": layer["experts_down_bias"],
                      p + "input_layernorm.weight": layer["attn_norm"],
                      p + "post_attention_layernorm.weight": layer["mlp_norm"]})
        if spec.attention_bias:
            qb, kb, vb = layer["bqkv"].split([q_rows, kv_rows, kv_rows], dim=0)
            state.update({p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb,
                          p + "self_attn.v_proj.bias": vb, p + "self_attn.o_proj.bias": layer["bo"]})
    if not spec.tie_word_embeddings:
        state["lm_head.weight"] = plain(params["lm_head"])
    return state


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # GPT-OSS's order: scale by the weight in float32, then cast back (Llama casts first).
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def attention_scale(spec: GptOssSpec) -> float:
    return spec.head_dim ** -0.5


def project_qkv(spec: GptOssSpec, layer, x: torch.Tensor):
    """The layer's q ``[..., H, D]``, k, v ``[..., Hkv, D]`` of ``x [..., hidden]``, before RoPE."""
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    h = _norm(x, layer["attn_norm"], spec.rms_norm_eps)
    q, k, v = linear(h, layer["wqkv"], layer.get("bqkv")).split([q_size, kv_size, kv_size], dim=-1)
    lead = x.shape[:-1]
    return (q.reshape(*lead, spec.num_heads, spec.head_dim), k.reshape(*lead, spec.num_kv_heads, spec.head_dim),
            v.reshape(*lead, spec.num_kv_heads, spec.head_dim))


def finish_layer(spec: GptOssSpec, layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """The rest of the layer from the attention's heads ``attn [..., H * D]``: the output projection
    added to ``x``, then the experts on the normed sum, added."""
    x = x + tensor_parallel.row_parallel(spec, attn, layer["wo"], bias=layer.get("bo"))
    return x + biased_moe_mlp(spec, layer, _norm(x, layer["mlp_norm"], spec.rms_norm_eps))


def final_logits(spec: GptOssSpec, params, x: torch.Tensor) -> torch.Tensor:
    """float32 logits ``[N, V]`` of the last layer's ``x [N, hidden]``."""
    logits = linear(_norm(x, params["norm"], spec.rms_norm_eps), params["lm_head"]).to(torch.float32)
    return tensor_parallel.gathered_logits(spec, logits)


def _attention(spec: GptOssSpec, q, keys, values, mask, sinks):
    """``q [B, H, S, D]`` over ``keys, values [B, Hkv, A, D]`` under ``mask [B, 1, S, A]``, each
    head's sink in its softmax: ``(out [B, H, S, D], weights [B, H, S, A])``. A query group's heads
    share their kv head as rows of one matmul (no repeated keys)."""
    batch, heads, seq, dim = q.shape
    kv_heads, attend = keys.shape[1], keys.shape[2]
    qg = q.reshape(batch, kv_heads, heads // kv_heads * seq, dim)
    scores = (qg @ keys.transpose(-1, -2)).view(batch, heads, seq, attend) * attention_scale(spec)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = sink_softmax(scores.float(), sinks.view(1, heads, 1, 1)).to(q.dtype)
    out = weights.view(batch, kv_heads, heads // kv_heads * seq, attend) @ values
    return out.view(batch, heads, seq, dim), weights


def apply(spec: GptOssSpec, params: Mapping[str, Any], tokens: torch.Tensor, positions: torch.Tensor,
          cache: StaticCache, attention_mask: torch.Tensor | None = None, *, logits_to_keep: int = 0,
          attend_len: int | None = None, output_hidden_states: bool = False, output_attentions: bool = False,
          num_layers: int | None = None):
    """As ``genfn.models.llama.apply`` (same arguments and results), for GPT-OSS."""
    refuse_without_invariant_forward("GPT-OSS")
    layers = first_layers(params["layers"], num_layers)
    cache, slots, attend_len = begin_forward(cache, tokens, attention_mask, attend_len)
    masks = {False: slot_mask(cache, slots, attend_len, None),
             True: slot_mask(cache, slots, attend_len, spec.sliding_window)}
    x = tensor_parallel.embedding(spec, tokens, params["embed"], params["norm"].dtype)
    cos, sin = rope_cos_sin(params["inv_freq"], positions, x.dtype, spec.rope_attention_factor)
    hidden_states = [x] if output_hidden_states else None
    attentions = [] if output_attentions else None
    batch, seq = tokens.shape
    for i, layer in enumerate(layers):
        q, k, v = project_qkv(spec, layer, x)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        keys, values = cache.write_layer(i, slots, k, v.transpose(1, 2))
        attn, weights = _attention(spec, q, keys[:, :, :attend_len], values[:, :, :attend_len],
                                   masks[spec.sliding_layers[i]], layer["sinks"])
        if output_attentions:
            attentions.append(weights)
        x = finish_layer(spec, layer, x, attn.transpose(1, 2).reshape(batch, seq, spec.num_heads * spec.head_dim))
        if output_hidden_states:
            hidden_states.append(x)
    if logits_to_keep and not output_hidden_states:
        x = x[:, -logits_to_keep:]
    if output_hidden_states:
        hidden_states[-1] = _norm(x, params["norm"], spec.rms_norm_eps)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
    kept = x.shape[1]
    logits = final_logits(spec, params, x.reshape(batch * kept, x.shape[-1])).reshape(batch, kept, -1)
    if output_hidden_states or output_attentions:
        return ModelOutput(logits, cache, tuple(hidden_states) if hidden_states is not None else None,
                           tuple(attentions) if attentions is not None else None)
    return logits, cache
