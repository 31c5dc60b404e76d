"""The T5 family (T5, T5 v1.1, Flan-T5, mT5 layouts) as pure functions over ``(spec, params)``.

What sets T5 apart from the decoder-only families: no positional embeddings (a learned bias per
bucket of relative distance, computed by the first layer of each stack and shared by the rest),
a scale-only RMS layer norm, unscaled attention logits (the scale is folded into the weights at
training time), a ReLU or gated-GELU feed-forward, and, in original T5 (whose LM head is the tied
embedding), the decoder output rescaled by ``d_model ** -0.5`` before the head.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from genfn.cache.base import begin_forward
from genfn.cache.static import StaticCache, init_static_cache
from genfn.models.seq2seq import (DecoderOutput, EncoderOutput, activation, attend, causal_mask, check_shape,
                                  get_tensor, merge_heads, padding_mask, split_heads)
from genfn.kernels.invariant import refuse_without_invariant_forward

__all__ = ["T5Spec", "SUPPORTED_ARCHITECTURES", "spec_from_config", "params_from_state_dict", "encode",
           "cross_attention_kv", "apply", "init_cache", "relative_position_buckets"]

SUPPORTED_ARCHITECTURES = ("T5ForConditionalGeneration", "MT5ForConditionalGeneration")


@dataclasses.dataclass(frozen=True)
class T5Spec:
    """Static description of a T5-family model (hashable: it keys compiled steps).

    ``num_layers`` / ``num_heads`` / ``num_kv_heads`` / ``head_dim`` describe the decoder's
    self-attention, which is what a genfn cache holds.
    """

    architecture: str
    vocab_size: int
    d_model: int
    d_ff: int
    head_dim: int
    num_heads: int
    num_encoder_layers: int
    num_layers: int
    relative_attention_num_buckets: int
    relative_attention_max_distance: int
    layer_norm_epsilon: float
    is_gated: bool
    dense_act_fn: str
    # Original T5 rescales the decoder output by d_model ** -0.5 before its (tied) head; v1.1,
    # Flan-T5 and mT5 do not. transformers 5 stores this as ``scale_decoder_outputs``; older configs said
    # it with ``tie_word_embeddings`` (False for v1.1).
    scale_decoder_outputs: bool
    max_position_embeddings: int | None = None  # relative positions: no fixed context

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def hidden_size(self) -> int:
        return self.d_model


def spec_from_config(config: Mapping[str, Any]) -> T5Spec:
    """A ``T5Spec`` from a ``config.json`` dict, with transformers' ``T5Config`` defaults."""
    archs = [a for a in (config.get("architectures") or []) if a in SUPPORTED_ARCHITECTURES]
    projection = str(config.get("feed_forward_proj", "relu"))
    parts = projection.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise ValueError(f"feed_forward_proj {projection!r} is not valid: use 'relu', 'gated-gelu' or "
                         f"'gated-<activation>'")
    is_gated = parts[0] == "gated"
    # T5Config maps "gated-gelu" to the tanh approximation, for backwards compatibility.
    act = "gelu_new" if projection == "gated-gelu" else parts[-1]
    activation(act)  # unsupported activations fail here, naming the allowed ones
    if archs:
        arch = archs[0]
    else:
        arch = "MT5ForConditionalGeneration" if config.get("model_type") == "mt5" else "T5ForConditionalGeneration"
    # mT5 never rescales (transformers' MT5 has no such step).
    scale = arch != "MT5ForConditionalGeneration" and bool(
        config.get("scale_decoder_outputs", config.get("tie_word_embeddings", True)))
    try:
        num_layers = int(config["num_layers"])
        spec = T5Spec(
            architecture=arch,
            vocab_size=int(config["vocab_size"]),
            d_model=int(config["d_model"]),
            d_ff=int(config["d_ff"]),
            head_dim=int(config["d_kv"]),
            num_heads=int(config["num_heads"]),
            num_encoder_layers=num_layers,
            num_layers=int(config.get("num_decoder_layers") or num_layers),
            relative_attention_num_buckets=int(config.get("relative_attention_num_buckets", 32)),
            relative_attention_max_distance=int(config.get("relative_attention_max_distance", 128)),
            layer_norm_epsilon=float(config.get("layer_norm_epsilon", 1e-6)),
            is_gated=is_gated,
            dense_act_fn=act,
            scale_decoder_outputs=scale,
        )
    except KeyError as missing:
        raise ValueError(f"config.json is missing the required T5 field {missing}") from None
    return spec


def _attention_params(get, prefix: str, spec: T5Spec) -> dict:
    inner = spec.num_heads * spec.head_dim
    shapes = {"q": (inner, spec.d_model), "k": (inner, spec.d_model), "v": (inner, spec.d_model),
              "o": (spec.d_model, inner)}
    return {f"w{n}": check_shape(prefix + f"{n}.weight", get(prefix + f"{n}.weight"), shape)
            for n, shape in shapes.items()}


def _ff_params(get, prefix: str, spec: T5Spec) -> dict:
    if spec.is_gated:
        ff = {"wi_0": get(prefix + "wi_0.weight"), "wi_1": get(prefix + "wi_1.weight")}
    else:
        ff = {"wi": get(prefix + "wi.weight")}
    for name, tensor in ff.items():
        check_shape(prefix + name + ".weight", tensor, (spec.d_ff, spec.d_model))
    ff["wo_ff"] = check_shape(prefix + "wo.weight", get(prefix + "wo.weight"), (spec.d_model, spec.d_ff))
    return ff


def params_from_state_dict(spec: T5Spec, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None):
    """genfn's params pytree from transformers' T5 parameter names."""
    def get(*names):
        return get_tensor(state_dict, *names, dtype=dtype)

    embed = check_shape("shared.weight", get("shared.weight", "encoder.embed_tokens.weight",
                                              "decoder.embed_tokens.weight"), (spec.vocab_size, spec.d_model))

    def stack(name: str, num_layers: int, decoder: bool) -> dict:
        layers = []
        for i in range(num_layers):
            p = f"{name}.block.{i}.layer."
            layer = {"attn_norm": get(p + "0.layer_norm.weight"),
                     **_attention_params(get, p + "0.SelfAttention.", spec)}
            ff_index = 1
            if decoder:
                cross = _attention_params(get, p + "1.EncDecAttention.", spec)
                layer.update({"cross_norm": get(p + "1.layer_norm.weight"),
                              **{"c" + k[1:]: v for k, v in cross.items()}})
                ff_index = 2
            layer["ff_norm"] = get(p + f"{ff_index}.layer_norm.weight")
            layer.update(_ff_params(get, p + f"{ff_index}.DenseReluDense.", spec))
            layers.append(layer)
        bias_name = f"{name}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        rel_bias = check_shape(bias_name, get(bias_name), (spec.relative_attention_num_buckets, spec.num_heads))
        return {"layers": layers, "rel_bias": rel_bias, "norm": get(f"{name}.final_layer_norm.weight")}

    # A checkpoint with its own head uses it; one saved tied (transformers 5 always ties T5) reuses the embedding.
    lm_head = get("lm_head.weight") if "lm_head.weight" in state_dict else embed
    check_shape("lm_head.weight", lm_head, (spec.vocab_size, spec.d_model))
    return {"embed": embed, "encoder": stack("encoder", spec.num_encoder_layers, False),
            "decoder": stack("decoder", spec.num_layers, True), "lm_head": lm_head}


def init_cache(spec: T5Spec, batch_size: int, max_cache_len: int, dtype=torch.float32, device=None) -> StaticCache:
    """The decoder's self-attention cache."""
    return init_static_cache(spec.num_layers, batch_size, spec.num_heads, max_cache_len, spec.head_dim,
                             dtype=dtype, device=device)


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Scale only (no mean, no bias), with the variance in float32, as T5LayerNorm.
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        x = x.to(weight.dtype)
    return weight * x


def relative_position_buckets(relative: torch.Tensor, bidirectional: bool, num_buckets: int,
                              max_distance: int) -> torch.Tensor:
    """The bucket of each relative distance ``key - query``: exact for small distances, then
    logarithmically wider up to ``max_distance`` (everything farther shares the last bucket).
    Bidirectional buckets give the keys after the query their own half of the buckets."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).to(relative.dtype) * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    exact = num_buckets // 2
    spread = torch.log(distance.float() / exact) / math.log(max_distance / exact) * (num_buckets - exact)
    far = (exact + spread.to(relative.dtype)).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, far)


def _position_bias(spec: T5Spec, table: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
                   bidirectional: bool) -> torch.Tensor:
    """``[B, H, S, T]`` additive bias for queries at ``query_pos [B, S]`` and keys at ``key_pos [T]``."""
    relative = key_pos.view(1, 1, -1) - query_pos.unsqueeze(2)
    buckets = relative_position_buckets(relative, bidirectional, spec.relative_attention_num_buckets,
                                        spec.relative_attention_max_distance)
    return F.embedding(buckets, table).permute(0, 3, 1, 2)


def _feed_forward(spec: T5Spec, layer: Mapping[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    act = activation(spec.dense_act_fn)
    if spec.is_gated:
        inner = act(F.linear(h, layer["wi_0"])) * F.linear(h, layer["wi_1"])
    else:
        inner = act(F.linear(h, layer["wi"]))
    return F.linear(inner, layer["wo_ff"])


def _project(h: torch.Tensor, weight: torch.Tensor, spec: T5Spec) -> torch.Tensor:
    return split_heads(F.linear(h, weight), spec.num_heads, spec.head_dim)


def encode(spec: T5Spec, params: Mapping[str, Any], input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
           output_hidden_states: bool = False, output_attentions: bool = False) -> EncoderOutput:
    """The encoder over ``input_ids [B, S]`` (any padding side: ``attention_mask`` says which keys are real)."""
    enc = params["encoder"]
    x = F.embedding(input_ids, params["embed"])
    seq = input_ids.shape[1]
    pos = torch.arange(seq, device=input_ids.device)
    bias = _position_bias(spec, enc["rel_bias"], pos.unsqueeze(0), pos, bidirectional=True)
    mask = padding_mask(attention_mask)
    hidden_states = [x] if output_hidden_states else None
    attentions = [] if output_attentions else None
    for layer in enc["layers"]:
        h = _layer_norm(x, layer["attn_norm"], spec.layer_norm_epsilon)
        q, k, v = (_project(h, layer[w], spec) for w in ("wq", "wk", "wv"))
        out, weights = attend(q, k, v, mask, scale=1.0, bias=bias, want_weights=output_attentions)
        x = x + F.linear(merge_heads(out), layer["wo"])
        x = x + _feed_forward(spec, layer, _layer_norm(x, layer["ff_norm"], spec.layer_norm_epsilon))
        if output_hidden_states:
            hidden_states.append(x)
        if output_attentions:
            attentions.append(weights)
    x = _layer_norm(x, enc["norm"], spec.layer_norm_epsilon)
    if output_hidden_states:
        hidden_states[-1] = x  # transformers reports the final-norm output as the last hidden state
    return EncoderOutput(x, tuple(hidden_states) if output_hidden_states else None,
                         tuple(attentions) if output_attentions else None)


def cross_attention_kv(spec: T5Spec, params: Mapping[str, Any], encoder_hidden: torch.Tensor):
    """Every decoder layer's cross-attention keys and values, ``[L, B, H, S_enc, D]`` each."""
    layers = params["decoder"]["layers"]
    keys = torch.stack([_project(encoder_hidden, layer["ck"], spec) for layer in layers])
    values = torch.stack([_project(encoder_hidden, layer["cv"], spec) for layer in layers])
    return keys, values


def apply(spec: T5Spec, params: Mapping[str, Any], tokens: torch.Tensor, positions: torch.Tensor, cache,
          attention_mask: torch.Tensor | None = None, *, logits_to_keep: int = 0, attend_len: int | None = None,
          output_hidden_states: bool = False, output_attentions: bool = False):
    """The decoder: ``tokens [B, S]`` against ``cache`` (an ``EncoderDecoderCache``, donated).

    Relative positions are measured between cache slots, as transformers measures them between
    cache positions, so ``positions`` is not read. Returns ``(logits [B, S', V] float32, cache)``,
    or a ``DecoderOutput`` when hidden states or attentions are requested.
    """
    refuse_without_invariant_forward("T5")
    dec = params["decoder"]
    batch, seq = tokens.shape
    cache, slots, attend_len = begin_forward(cache, tokens, attention_mask, attend_len)
    self_mask = causal_mask(cache, slots, attend_len)
    key_pos = torch.arange(attend_len, device=tokens.device)
    bias = _position_bias(spec, dec["rel_bias"], slots, key_pos, bidirectional=False)
    cross_mask = padding_mask(cache.encoder_valid)

    x = F.embedding(tokens, params["embed"])
    hidden_states = [x] if output_hidden_states else None
    attentions = [] if output_attentions else None
    cross_attentions = [] if output_attentions else None
    eps = spec.layer_norm_epsilon
    for i, layer in enumerate(dec["layers"]):
        h = _layer_norm(x, layer["attn_norm"], eps)
        q, k, v = (_project(h, layer[w], spec) for w in ("wq", "wk", "wv"))
        keys, values = cache.write_layer(i, slots, k, v)
        out, weights = attend(q, keys[:, :, :attend_len], values[:, :, :attend_len], self_mask, scale=1.0,
                              bias=bias, want_weights=output_attentions)
        x = x + F.linear(merge_heads(out), layer["wo"])
        h = _layer_norm(x, layer["cross_norm"], eps)
        cross_k, cross_v = cache.cross_layer(i)
        out, cross_weights = attend(_project(h, layer["cq"], spec), cross_k, cross_v, cross_mask, scale=1.0,
                                    want_weights=output_attentions)
        x = x + F.linear(merge_heads(out), layer["co"])
        x = x + _feed_forward(spec, layer, _layer_norm(x, layer["ff_norm"], eps))
        if output_hidden_states:
            hidden_states.append(x)
        if output_attentions:
            attentions.append(weights)
            cross_attentions.append(cross_weights)
    x = _layer_norm(x, dec["norm"], eps)
    if output_hidden_states:
        hidden_states[-1] = x
    if logits_to_keep:
        x = x[:, -logits_to_keep:]
    if spec.scale_decoder_outputs:
        x = x * (spec.d_model ** -0.5)
    logits = F.linear(x, params["lm_head"]).to(torch.float32)
    if output_attentions:
        cache = cache.replace(cross_attentions=tuple(cross_attentions))
    if output_hidden_states or output_attentions:
        return DecoderOutput(logits, cache, tuple(hidden_states) if output_hidden_states else None,
                             tuple(attentions) if output_attentions else None,
                             tuple(cross_attentions) if output_attentions else None)
    return logits, cache
