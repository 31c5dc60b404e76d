"""Gemma 2 and Gemma 3 (text) as pure functions: ``apply(spec, params, tokens, positions, cache)``.

Llama's decoder with Gemma's changes: the embedding scaled by ``sqrt(hidden_size)``; RMSNorm that
multiplies by ``1 + weight`` in float32 before casting back; a norm before and after both the
attention and the MLP; a GeGLU MLP (tanh-approximated GELU); attention scaled by
``query_pre_attn_scalar ** -0.5``; sliding-window and global layers interleaved
(``layer_types``), Gemma 3's with their own RoPE bases; tanh soft-capping of the attention scores
and of the final logits where the config sets it (Gemma 2); per-head q/k norms (Gemma 3).

The caches, the masks, RoPE, the linears (float or quantized blocks) and the LM head are Llama's
(``genfn.models.llama``, ``genfn.models.rope``); only the layer differs. Parameters use the
same names as Llama's where they mean the same thing (``wqkv``, ``wo``, ``w_gate_up``,
``w_down``), so quantization and the weight arena treat them alike. Split over tensor-parallel
ranks (``tensor_shard``) as the Llama family is (``genfn.models.tensor_parallel``): the embedding's
rows are assembled before the scale, the post-norms take the all-reduced o and down outputs, and
the final soft-cap takes the gathered logits.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from genfn.cache.base import begin_forward
from genfn.cache.static import StaticCache
from genfn.kernels import invariant, linear
from genfn.models import gemma_invariant, tensor_parallel
from genfn.models.decoder_config import check_head_groups, decoder_sizes, sliding_layers
from genfn.models.llama import ModelOutput, first_layers, init_cache, tensor_getter
from genfn.models.llama import attention_mask as slot_mask
from genfn.models.rope import SUPPORTED_ROPE_TYPES, apply_rope, inverse_frequencies, rope_cos_sin
from genfn.quant.blocks import RowBlocks, dequantize
from genfn.quant.fuse import cat_rows
from genfn.quant.kquants import KQuantWeight
from genfn.quant.weight import QuantizedWeight

__all__ = ["GemmaSpec", "SUPPORTED_ARCHITECTURES", "spec_from_config", "params_from_state_dict", "apply",
           "init_cache", "state_dict_of"]

SUPPORTED_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


@dataclasses.dataclass(frozen=True)
class GemmaSpec:
    """Static description of a Gemma 2 / Gemma 3 text model (hashable: it keys compiled steps)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float  # the global layers'
    rope_scaling_json: str | None  # the global layers' scaling, JSON text
    local_rope_theta: float  # the sliding layers' base
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    sliding_layers: tuple[bool, ...]  # True for a sliding-window layer
    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    qk_norm: bool  # Gemma 3
    tensor_shard: tensor_parallel.TensorShard | None = None  # this rank's slice (genfn.models.tensor_parallel)

    @property
    def rope_scaling(self) -> dict | None:
        return None if self.rope_scaling_json is None else json.loads(self.rope_scaling_json)

    @property
    def num_query_groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def _layer_rope(config: Mapping[str, Any], layer_type: str) -> Mapping[str, Any]:
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and layer_type in params:
        return params[layer_type]
    return {}


def spec_from_config(config: Mapping[str, Any]) -> GemmaSpec:
    """A ``GemmaSpec`` from a Hugging Face ``config.json`` dict, with transformers' defaults."""
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        arch = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}.get(config.get("model_type"))
    if arch is None:
        raise ValueError(f"unsupported architecture {archs or [config.get('model_type')]}; supported architectures: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    gemma3 = arch == "Gemma3ForCausalLM"
    sizes = decoder_sizes(config)
    full_every = int(config.get("sliding_window_pattern", 6 if gemma3 else 2))
    sliding = sliding_layers(config, sizes["num_layers"], full_every)
    full, local = _layer_rope(config, "full_attention"), _layer_rope(config, "sliding_attention")
    rope_theta = float(full.get("rope_theta", config.get("rope_theta") or (1e6 if gemma3 else 10000.0)))
    scaling = dict(full) if full else config.get("rope_scaling")
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES or kind == "longrope":
            raise ValueError(f"rope_scaling type {kind!r} is not supported for {arch}")
        scaling = None if kind == "default" else {**scaling, "rope_type": kind}
    local_theta = local.get("rope_theta", config.get("rope_local_base_freq", 10000.0 if gemma3 else rope_theta))
    spec = GemmaSpec(
        architecture=arch, **sizes, rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
        rope_scaling_json=None if scaling is None else json.dumps(scaling, sort_keys=True),
        local_rope_theta=float(local_theta),
        max_position_embeddings=int(config.get("max_position_embeddings") or 8192),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        attention_bias=bool(config.get("attention_bias", False)),
        sliding_window=None if config.get("sliding_window") is None else int(config["sliding_window"]),
        sliding_layers=sliding,
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or 256),
        # transformers' Gemma 3 attention never applies the config's attn_logit_softcapping (Gemma 3
        # checkpoints set none): genfn follows the oracle.
        attn_logit_softcapping=None if gemma3 else _optional_float(config.get("attn_logit_softcapping")),
        final_logit_softcapping=_optional_float(config.get("final_logit_softcapping")),
        qk_norm=gemma3,
    )
    check_head_groups(spec)
    return spec


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


_NORMS = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
          "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}


def params_from_state_dict(spec: GemmaSpec, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None):
    """genfn's params pytree from Hugging Face parameter names (q/k/v and gate/up fused, as Llama's)."""
    get = tensor_getter(state_dict, dtype)

    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "wqkv": cat_rows([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
            "wo": cat_rows([get(p + "self_attn.o_proj.weight")]),
            "w_gate_up": cat_rows([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
            "w_down": cat_rows([get(p + "mlp.down_proj.weight")]),
            **{ours: get(p + theirs + ".weight") for ours, theirs in _NORMS.items()},
        }
        if spec.qk_norm:
            layer.update(q_norm=get(p + "self_attn.q_norm.weight"), k_norm=get(p + "self_attn.k_norm.weight"))
        if spec.attention_bias:
            layer["bqkv"] = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0)
        for name, value in layer.items():
            expected = _expected_shape(spec, name)
            if expected is not None and tuple(value.shape) != expected:
                raise ValueError(f"tensor of layer {i}'s {name} has shape {list(value.shape)}, but the config "
                                 f"implies {list(expected)}")
        layers.append(layer)
    embed = get("model.embed_tokens.weight")
    if tuple(embed.shape) != (spec.vocab_size, spec.hidden_size):
        raise ValueError(f"tensor model.embed_tokens.weight has shape {list(embed.shape)}, but the config implies "
                         f"{[spec.vocab_size, spec.hidden_size]}")
    lm_head = embed if spec.tie_word_embeddings else get("lm_head.weight")
    if isinstance(embed, RowBlocks):
        embed = dequantize(embed).to(dtype or torch.float32)
    elif isinstance(embed, (QuantizedWeight, KQuantWeight)):  # a GGUF file's blocks, as the loader placed them
        embed = embed.dequantize().to(dtype or torch.float32)
    return {
        "embed": embed, "layers": layers, "norm": get("model.norm.weight"), "lm_head": lm_head,
        "inv_freq": inverse_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling),
        "local_inv_freq": inverse_frequencies(spec.head_dim, spec.local_rope_theta, None),
    }


def _expected_shape(spec: GemmaSpec, name: str) -> tuple[int, ...] | None:
    q_rows, kv_rows = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {"wqkv": (q_rows + 2 * kv_rows, spec.hidden_size), "wo": (spec.hidden_size, q_rows),
            "w_gate_up": (2 * spec.intermediate_size, spec.hidden_size),
            "w_down": (spec.hidden_size, spec.intermediate_size), "q_norm": (spec.head_dim,),
            "k_norm": (spec.head_dim,), **{n: (spec.hidden_size,) for n in _NORMS}}.get(name)


def state_dict_of(spec: GemmaSpec, params, plain) -> dict[str, torch.Tensor]:
    """Hugging Face names -> tensors (the inverse of ``params_from_state_dict``); ``plain`` turns a
    weight into a dense tensor."""
    q_rows, kv_rows = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    state = {"model.embed_tokens.weight": plain(params["embed"]), "model.norm.weight": plain(params["norm"])}
    for i, layer in enumerate(params["layers"]):
        p = f"model.layers.{i}."
        q, k, v = plain(layer["wqkv"]).split([q_rows, kv_rows, kv_rows], dim=0)
        gate, up = plain(layer["w_gate_up"]).split([spec.intermediate_size] * 2, dim=0)
        state.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                      p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": plain(layer["wo"]),
                      p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                      p + "mlp.down_proj.weight": plain(layer["w_down"])})
        state.update({p + theirs + ".weight": plain(layer[ours]) for ours, theirs in _NORMS.items()})
        if spec.qk_norm:
            state.update({p + "self_attn.q_norm.weight": plain(layer["q_norm"]),
                          p + "self_attn.k_norm.weight": plain(layer["k_norm"])})
    if not spec.tie_word_embeddings:
        state["lm_head.weight"] = plain(params["lm_head"])
    return state


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Gemma's order: scale by (1 + w) in float32, then cast back.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).type_as(x)


def _attention(spec: GemmaSpec, q, keys, values, mask, want_weights: bool):
    """Scaled by ``query_pre_attn_scalar ** -0.5``, scores soft-capped where the spec says."""
    scale = attention_scale(spec)
    if spec.attn_logit_softcapping is None and not want_weights:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=spec.num_query_groups > 1), None
    if spec.num_query_groups > 1:
        keys = keys.repeat_interleave(spec.num_query_groups, dim=1)
        values = values.repeat_interleave(spec.num_query_groups, dim=1)
    scores = (q @ keys.transpose(-1, -2)) * scale
    if spec.attn_logit_softcapping is not None:
        cap = spec.attn_logit_softcapping
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return weights @ values, weights


def attention_scale(spec: GemmaSpec) -> float:
    return spec.query_pre_attn_scalar ** -0.5


def project_qkv(spec: GemmaSpec, layer, x: torch.Tensor):
    """The layer's q ``[..., H, D]``, k, v ``[..., Hkv, D]`` of ``x [..., hidden]``, before RoPE
    (input norm, fused projection, Gemma 3's per-head q/k norms)."""
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    h = _norm(x, layer["attn_norm"], spec.rms_norm_eps)
    q, k, v = linear(h, layer["wqkv"], layer.get("bqkv")).split([q_size, kv_size, kv_size], dim=-1)
    lead = x.shape[:-1]
    q, k = q.reshape(*lead, spec.num_heads, spec.head_dim), k.reshape(*lead, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm:
        q, k = _norm(q, layer["q_norm"], spec.rms_norm_eps), _norm(k, layer["k_norm"], spec.rms_norm_eps)
    return q, k, v.reshape(*lead, spec.num_kv_heads, spec.head_dim)


def finish_layer(spec: GemmaSpec, layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """The rest of the layer from the attention's heads ``attn [..., H * D]``: the output projection
    under its post-norm, then the GeGLU MLP between its pre- and post-norms, each added to ``x``.
    Under tensor parallelism the post-norms take the row-parallel outputs summed over the ranks."""
    attn_out = tensor_parallel.row_parallel(spec, attn, layer["wo"])
    x = x + _norm(attn_out, layer["post_attn_norm"], spec.rms_norm_eps)
    gate, up = linear(_norm(x, layer["mlp_norm"], spec.rms_norm_eps), layer["w_gate_up"]).chunk(2, dim=-1)
    mlp = tensor_parallel.row_parallel(spec, F.gelu(gate, approximate="tanh") * up, layer["w_down"])
    return x + _norm(mlp, layer["post_mlp_norm"], spec.rms_norm_eps)


def embed(spec: GemmaSpec, params, tokens: torch.Tensor) -> torch.Tensor:
    """The tokens' embeddings scaled by ``sqrt(hidden_size)`` (under tensor parallelism: the rows
    assembled over the ranks, then scaled)."""
    x = tensor_parallel.embedding(spec, tokens, params["embed"], params["norm"].dtype)
    return x * torch.tensor(math.sqrt(spec.hidden_size), dtype=x.dtype)  # rounded to the dtype, as transformers


def final_logits(spec: GemmaSpec, params, x: torch.Tensor) -> torch.Tensor:
    """float32 logits ``[N, V]`` of the last layer's ``x [N, hidden]``: final norm, head, soft-cap
    (under tensor parallelism: of the whole vocabulary's logits, gathered from the ranks)."""
    logits = linear(_norm(x, params["norm"], spec.rms_norm_eps), params["lm_head"]).to(torch.float32)
    logits = tensor_parallel.gathered_logits(spec, logits)
    if spec.final_logit_softcapping is not None:
        cap = spec.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits


def _decoder_layer(spec: GemmaSpec, layer, i: int, x, rope, cache: StaticCache, slots, masks, attend_len,
                   attentions: list | None):
    batch, seq = x.shape[0], x.shape[1]
    sliding = spec.sliding_layers[i]
    cos, sin = rope[sliding]
    q, k, v = project_qkv(spec, layer, x)
    q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
    keys, values = cache.write_layer(i, slots, k, v.transpose(1, 2))
    attn, weights = _attention(spec, q, keys[:, :, :attend_len], values[:, :, :attend_len], masks[sliding],
                               attentions is not None)
    if attentions is not None:
        attentions.append(weights)
    return finish_layer(spec, layer, x, attn.transpose(1, 2).reshape(batch, seq, spec.num_heads * spec.head_dim))


def apply(spec: GemmaSpec, params: Mapping[str, Any], tokens: torch.Tensor, positions: torch.Tensor,
          cache: StaticCache, attention_mask: torch.Tensor | None = None, *, logits_to_keep: int = 0,
          attend_len: int | None = None, output_hidden_states: bool = False, output_attentions: bool = False,
          num_layers: int | None = None):
    """As ``genfn.models.llama.apply`` (same arguments and results), for Gemma 2 / Gemma 3 text
    (in the batch-invariant mode: ``genfn.models.gemma_invariant``)."""
    layers = first_layers(params["layers"], num_layers)
    cache, slots, attend_len = begin_forward(cache, tokens, attention_mask, attend_len)
    masks = {False: slot_mask(cache, slots, attend_len, None),
             True: slot_mask(cache, slots, attend_len, spec.sliding_window)}
    x = embed(spec, params, tokens)
    rope = {False: rope_cos_sin(params["inv_freq"], positions, x.dtype),
            True: rope_cos_sin(params["local_inv_freq"], positions, x.dtype)}
    if invariant.batch_invariant():
        if output_hidden_states or output_attentions:
            raise ValueError("the batch-invariant mode (genfn.deterministic) does not return hidden states or "
                             "attentions")
        logits = gemma_invariant.forward(spec, params, layers, x, rope, cache, slots, masks, attend_len, logits_to_keep)
        return logits, cache
    hidden_states = [x] if output_hidden_states else None
    attentions = [] if output_attentions else None
    for i, layer in enumerate(layers):
        x = _decoder_layer(spec, layer, i, x, rope, cache, slots, masks, attend_len, attentions)
        if output_hidden_states:
            hidden_states.append(x)
    if logits_to_keep and not output_hidden_states:
        x = x[:, -logits_to_keep:]
    if output_hidden_states:
        hidden_states[-1] = _norm(x, params["norm"], spec.rms_norm_eps)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
    batch, kept = x.shape[:2]
    logits = final_logits(spec, params, x.reshape(batch * kept, x.shape[-1])).reshape(batch, kept, -1)
    if output_hidden_states or output_attentions:
        return ModelOutput(logits, cache, tuple(hidden_states) if hidden_states is not None else None,
                           tuple(attentions) if attentions is not None else None)
    return logits, cache
