"""The BART family as pure functions over ``(spec, params)``.

BART is a post-norm transformer (each sublayer's residual sum is layer-normed), with learned
absolute positions whose table is offset by 2 (the first two rows are a relic of fairseq's padding
scheme), a layer norm over the embeddings, an optional ``sqrt(d_model)`` embedding scale
(``scale_embedding``), biased projections, and a ``final_logits_bias`` added to the LM head.
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

__all__ = ["BartSpec", "SUPPORTED_ARCHITECTURES", "POSITION_OFFSET", "spec_from_config", "params_from_state_dict",
           "encode", "cross_attention_kv", "apply", "init_cache"]

SUPPORTED_ARCHITECTURES = ("BartForConditionalGeneration",)
POSITION_OFFSET = 2  # position p reads row p + 2 of the learned table
_LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which BART uses


@dataclasses.dataclass(frozen=True)
class BartSpec:
    """Static description of a BART model; ``num_layers``/``num_heads``/``head_dim`` describe the
    decoder's self-attention (what a genfn cache holds)."""

    architecture: str
    vocab_size: int
    d_model: int
    num_encoder_layers: int
    num_layers: int
    num_encoder_heads: int
    num_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    activation_function: str
    max_position_embeddings: int
    scale_embedding: bool
    tie_word_embeddings: bool

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def encoder_head_dim(self) -> int:
        return self.d_model // self.num_encoder_heads

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.d_model) if self.scale_embedding else 1.0


def spec_from_config(config: Mapping[str, Any]) -> BartSpec:
    """A ``BartSpec`` from a ``config.json`` dict, with transformers' ``BartConfig`` defaults."""
    try:
        spec = BartSpec(
            architecture="BartForConditionalGeneration",
            vocab_size=int(config["vocab_size"]),
            d_model=int(config.get("d_model", 1024)),
            num_encoder_layers=int(config.get("encoder_layers", 12)),
            num_layers=int(config.get("decoder_layers", 12)),
            num_encoder_heads=int(config.get("encoder_attention_heads", 16)),
            num_heads=int(config.get("decoder_attention_heads", 16)),
            encoder_ffn_dim=int(config.get("encoder_ffn_dim", 4096)),
            decoder_ffn_dim=int(config.get("decoder_ffn_dim", 4096)),
            activation_function=str(config.get("activation_function", "gelu")),
            max_position_embeddings=int(config.get("max_position_embeddings", 1024)),
            scale_embedding=bool(config.get("scale_embedding", False)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        )
    except KeyError as missing:
        raise ValueError(f"config.json is missing the required BART field {missing}") from None
    activation(spec.activation_function)
    for heads, name in ((spec.num_heads, "decoder_attention_heads"),
                        (spec.num_encoder_heads, "encoder_attention_heads")):
        if spec.d_model % heads:
            raise ValueError(f"d_model ({spec.d_model}) must be a multiple of {name} ({heads})")
    return spec


def params_from_state_dict(spec: BartSpec, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None):
    """genfn's params pytree from transformers' BART parameter names."""
    def get(*names):
        return get_tensor(state_dict, *names, dtype=dtype)

    d = spec.d_model
    embed = check_shape("model.shared.weight", get("model.shared.weight", "model.encoder.embed_tokens.weight",
                                                    "model.decoder.embed_tokens.weight"), (spec.vocab_size, d))

    def attention(prefix: str, short: str) -> dict:
        out = {}
        for proj, key in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("out_proj", "o")):
            out[f"{short}w{key}"] = check_shape(prefix + proj + ".weight", get(prefix + proj + ".weight"), (d, d))
            out[f"{short}b{key}"] = get(prefix + proj + ".bias")
        return out

    def norm(prefix: str, name: str) -> dict:
        return {name + "_w": get(prefix + ".weight"), name + "_b": get(prefix + ".bias")}

    def stack(name: str, num_layers: int, ffn_dim: int, decoder: bool) -> dict:
        layers = []
        for i in range(num_layers):
            p = f"model.{name}.layers.{i}."
            layer = {**attention(p + "self_attn.", ""), **norm(p + "self_attn_layer_norm", "attn_norm"),
                     "fc1_w": check_shape(p + "fc1.weight", get(p + "fc1.weight"), (ffn_dim, d)),
                     "fc1_b": get(p + "fc1.bias"),
                     "fc2_w": check_shape(p + "fc2.weight", get(p + "fc2.weight"), (d, ffn_dim)),
                     "fc2_b": get(p + "fc2.bias"), **norm(p + "final_layer_norm", "ff_norm")}
            if decoder:
                layer.update(attention(p + "encoder_attn.", "c"))
                layer.update(norm(p + "encoder_attn_layer_norm", "cross_norm"))
            layers.append(layer)
        positions = check_shape(f"model.{name}.embed_positions.weight", get(f"model.{name}.embed_positions.weight"),
                                (spec.max_position_embeddings + POSITION_OFFSET, d))
        return {"layers": layers, "positions": positions, **norm(f"model.{name}.layernorm_embedding", "embed_norm")}

    lm_head = embed if spec.tie_word_embeddings else get("lm_head.weight")
    if "final_logits_bias" in state_dict:
        final_bias = get("final_logits_bias").reshape(-1)
    else:
        final_bias = torch.zeros(spec.vocab_size, dtype=embed.dtype)
    return {"embed": embed, "encoder": stack("encoder", spec.num_encoder_layers, spec.encoder_ffn_dim, False),
            "decoder": stack("decoder", spec.num_layers, spec.decoder_ffn_dim, True), "lm_head": lm_head,
            "final_logits_bias": check_shape("final_logits_bias", final_bias, (spec.vocab_size,))}


def init_cache(spec: BartSpec, batch_size: int, max_cache_len: int, dtype=torch.float32, device=None) -> StaticCache:
    """The decoder's self-attention cache."""
    return init_static_cache(spec.num_layers, batch_size, spec.num_heads, max_cache_len, spec.head_dim,
                             dtype=dtype, device=device)


def _layer_norm(x: torch.Tensor, params: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), params[name + "_w"], params[name + "_b"], _LAYER_NORM_EPS)


def _heads(x: torch.Tensor, layer, short: str, key: str, heads: int) -> torch.Tensor:
    y = F.linear(x, layer[f"{short}w{key}"], layer[f"{short}b{key}"])
    return split_heads(y, heads, y.shape[-1] // heads)


def _out(x: torch.Tensor, layer, short: str) -> torch.Tensor:
    return F.linear(merge_heads(x), layer[f"{short}wo"], layer[f"{short}bo"])


def _feed_forward(spec: BartSpec, layer, x: torch.Tensor) -> torch.Tensor:
    act = activation(spec.activation_function)
    return F.linear(act(F.linear(x, layer["fc1_w"], layer["fc1_b"])), layer["fc2_w"], layer["fc2_b"])


def _embed(spec: BartSpec, params, stack, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    x = F.embedding(tokens, params["embed"]) * spec.embed_scale
    x = x + F.embedding(positions + POSITION_OFFSET, stack["positions"])
    return _layer_norm(x, stack, "embed_norm")


def encode(spec: BartSpec, params: Mapping[str, Any], input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
           output_hidden_states: bool = False, output_attentions: bool = False) -> EncoderOutput:
    """The encoder over ``input_ids [B, S]``; positions count from 0 whatever the padding, as in transformers."""
    enc = params["encoder"]
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    x = _embed(spec, params, enc, input_ids, positions)
    mask = padding_mask(attention_mask)
    scale = spec.encoder_head_dim ** -0.5
    hidden_states = [x] if output_hidden_states else None
    attentions = [] if output_attentions else None
    for layer in enc["layers"]:
        q, k, v = (_heads(x, layer, "", key, spec.num_encoder_heads) for key in "qkv")
        out, weights = attend(q, k, v, mask, scale=scale, want_weights=output_attentions)
        x = _layer_norm(x + _out(out, layer, ""), layer, "attn_norm")
        x = _layer_norm(x + _feed_forward(spec, layer, x), layer, "ff_norm")
        if output_hidden_states:
            hidden_states.append(x)
        if output_attentions:
            attentions.append(weights)
    return EncoderOutput(x, tuple(hidden_states) if output_hidden_states else None,
                         tuple(attentions) if output_attentions else None)


def cross_attention_kv(spec: BartSpec, params: Mapping[str, Any], encoder_hidden: torch.Tensor):
    """Every decoder layer's cross-attention keys and values, ``[L, B, H, S_enc, D]`` each."""
    layers = params["decoder"]["layers"]
    keys = torch.stack([_heads(encoder_hidden, layer, "c", "k", spec.num_heads) for layer in layers])
    values = torch.stack([_heads(encoder_hidden, layer, "c", "v", spec.num_heads) for layer in layers])
    return keys, values


def apply(spec: BartSpec, params: Mapping[str, Any], tokens: torch.Tensor, positions: torch.Tensor, cache,
          attention_mask: torch.Tensor | None = None, *, logits_to_keep: int = 0, attend_len: int | None = None,
          output_hidden_states: bool = False, output_attentions: bool = False):
    """The decoder: ``tokens [B, S]`` against ``cache`` (an ``EncoderDecoderCache``, donated).

    The learned positions are the cache slots, as transformers counts them from the cache length,
    so ``positions`` is not read. Returns ``(logits [B, S', V] float32, cache)``, or a
    ``DecoderOutput`` when hidden states or attentions are requested.
    """
    refuse_without_invariant_forward("BART")
    dec = params["decoder"]
    batch, seq = tokens.shape
    cache, slots, attend_len = begin_forward(cache, tokens, attention_mask, attend_len)
    self_mask = causal_mask(cache, slots, attend_len)
    cross_mask = padding_mask(cache.encoder_valid)
    scale = spec.head_dim ** -0.5

    x = _embed(spec, params, dec, tokens, slots)
    hidden_states = [x] if output_hidden_states else None
    attentions = [] if output_attentions else None
    cross_attentions = [] if output_attentions else None
    for i, layer in enumerate(dec["layers"]):
        q, k, v = (_heads(x, layer, "", key, spec.num_heads) for key in "qkv")
        keys, values = cache.write_layer(i, slots, k, v)
        out, weights = attend(q, keys[:, :, :attend_len], values[:, :, :attend_len], self_mask, scale=scale,
                              want_weights=output_attentions)
        x = _layer_norm(x + _out(out, layer, ""), layer, "attn_norm")
        cross_k, cross_v = cache.cross_layer(i)
        out, cross_weights = attend(_heads(x, layer, "c", "q", spec.num_heads), cross_k, cross_v, cross_mask,
                                    scale=scale, want_weights=output_attentions)
        x = _layer_norm(x + _out(out, layer, "c"), layer, "cross_norm")
        x = _layer_norm(x + _feed_forward(spec, layer, x), layer, "ff_norm")
        if output_hidden_states:
            hidden_states.append(x)
        if output_attentions:
            attentions.append(weights)
            cross_attentions.append(cross_weights)
    if logits_to_keep:
        x = x[:, -logits_to_keep:]
    logits = (F.linear(x, params["lm_head"]) + params["final_logits_bias"]).to(torch.float32)
    if output_attentions:
        cache = cache.replace(cross_attentions=tuple(cross_attentions))
    if output_hidden_states or output_attentions:
        return DecoderOutput(logits, cache, tuple(hidden_states) if output_hidden_states else None,
                             tuple(attentions) if output_attentions else None,
                             tuple(cross_attentions) if output_attentions else None)
    return logits, cache
