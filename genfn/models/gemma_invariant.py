"""Gemma 2 / Gemma 3 in the batch-invariant mode (``genfn.deterministic``).

Gemma's layer (``genfn.models.gemma``) with every step per token row, as the Llama family's
``genfn.models.invariant_layers``: the linears through ``genfn.kernels.invariant.linear``; Gemma's
RMSNorm (``1 + weight``, in float32, rounded once) through the native per-row norm
(``invariant_ops.gemma_rms_norm``); RoPE through the native rotation, at the local base on the
sliding layers; the GeGLU and the final logits' soft-cap elementwise (``invariant_ops``); and
attention, every query on its own, scaled by ``query_pre_attn_scalar ** -0.5``, soft-capped where
the spec says (Gemma 2) and windowed on the sliding layers: the static cache's mask in ``generate``
(``forward``), each query's own positions in the paged cache in continuous batching
(``forward_packed``). One layer loop serves both, so a request's logits are the same bits in each.

Nothing here imports ``genfn.models.gemma`` (which imports this module).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from genfn.cache.paged import write
from genfn.kernels import invariant, invariant_ops

__all__ = ["forward", "forward_packed"]


def _norm(spec: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return invariant_ops.gemma_rms_norm(x.contiguous(), weight, spec.rms_norm_eps)


def _qk_norm(spec: Any, layer: Mapping[str, Any], qkv: torch.Tensor) -> torch.Tensor:
    """Gemma 3's per-head q/k norms on ``qkv [T, (H + 2 Hkv) D]``, each head of each row on its own."""
    head_dim = spec.head_dim
    q_size, kv_size = spec.num_heads * head_dim, spec.num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = _norm(spec, q.reshape(-1, head_dim), layer["q_norm"]).reshape(-1, q_size)
    k = _norm(spec, k.reshape(-1, head_dim), layer["k_norm"]).reshape(-1, kv_size)
    return torch.cat([q, k, v], dim=-1)


def attention_options(spec: Any) -> dict[str, Any]:
    return dict(scale=spec.query_pre_attn_scalar ** -0.5, softcap=spec.attn_logit_softcapping)


def _layers(spec: Any, layers, rows: torch.Tensor, rope, attend) -> torch.Tensor:
    """The decoder layers on the tokens as rows ``[T, hidden]``; ``rope[sliding] = (cos, sin)
    [T, D]``; ``attend(i, sliding, q, k, v)`` writes layer ``i``'s keys/values and returns each
    query's attention ``[T, H, D]``."""
    heads, kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    for i, layer in enumerate(layers):
        sliding = spec.sliding_layers[i]
        qkv = invariant.linear(_norm(spec, rows, layer["attn_norm"]), layer["wqkv"], layer.get("bqkv"))
        if spec.qk_norm:
            qkv = _qk_norm(spec, layer, qkv)
        cos, sin = rope[sliding]
        q, k, v = invariant.rope_qkv(qkv, cos, sin, heads, kv_heads)
        attn = attend(i, sliding, q, k, v).reshape(rows.shape[0], heads * head_dim)
        rows = rows + _norm(spec, invariant.linear(attn, layer["wo"]), layer["post_attn_norm"])
        gate_up = invariant.linear(_norm(spec, rows, layer["mlp_norm"]), layer["w_gate_up"])
        mlp = invariant.linear(invariant_ops.gelu_tanh_mul(gate_up.contiguous()), layer["w_down"])
        rows = rows + _norm(spec, mlp, layer["post_mlp_norm"])
    return rows


def _logits(spec: Any, params: Mapping[str, Any], rows: torch.Tensor) -> torch.Tensor:
    """float32 ``[N, V]``: final norm, LM head, Gemma 2's soft-cap."""
    logits = invariant.linear(_norm(spec, rows, params["norm"]), params["lm_head"], out_float32=True)
    if spec.final_logit_softcapping is not None:
        logits = invariant_ops.soft_cap(logits.contiguous(), float(spec.final_logit_softcapping))
    return logits


def forward(spec: Any, params: Mapping[str, Any], layers, x: torch.Tensor, rope, cache, slots: torch.Tensor,
            masks, attend_len: int, logits_to_keep: int) -> torch.Tensor:
    """``gemma.apply``'s layers, final norm, head and soft-cap over the static cache: ``x [B, S,
    hidden]``, ``rope[sliding] = (cos, sin) [B, S, D]``, ``masks[sliding] [B, 1, S, A]``. Returns
    float32 logits ``[B, S', V]``."""
    batch, seq, hidden = x.shape
    heads, kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    options = attention_options(spec)

    def attend(i, sliding, q, k, v):
        keys, values = cache.write_layer(i, slots, k.view(batch, seq, kv_heads, head_dim).transpose(1, 2),
                                         v.view(batch, seq, kv_heads, head_dim).transpose(1, 2))
        return invariant_ops.dense_attention(q.view(batch, seq, heads, head_dim), keys[:, :, :attend_len],
                                             values[:, :, :attend_len], masks[sliding], **options)

    rope_rows = {sliding: tuple(t.reshape(batch * seq, -1) for t in pair) for sliding, pair in rope.items()}
    rows = _layers(spec, layers, x.reshape(batch * seq, hidden), rope_rows, attend)
    kept = seq if not logits_to_keep else min(logits_to_keep, seq)
    rows = rows.view(batch, seq, hidden)[:, seq - kept:].reshape(batch * kept, hidden)
    return _logits(spec, params, rows).reshape(batch, kept, -1)


def forward_packed(spec: Any, params: Mapping[str, Any], inputs, cache, x: torch.Tensor, rope, sampled_logits):
    """``gemma_packed.apply_packed`` over the paged cache: ``x [T, hidden]``, ``rope[sliding] = (cos,
    sin) [T, D]``; ``sampled_logits(logits_of)`` picks the rows to compute logits for. Returns
    ``(logits, cache)``."""
    options = attention_options(spec)

    def attend(i, sliding, q, k, v):
        nonlocal cache
        cache = write(cache, i, inputs.slot_mapping, k, v)
        window = spec.sliding_window if sliding else None
        return invariant_ops.paged_attention(q, cache.keys[i], cache.values[i], inputs.block_tables,
                                             inputs.request_index, inputs.positions, window, **options)

    rows = _layers(spec, params["layers"], x, rope, attend)
    logits = sampled_logits(lambda index: _logits(spec, params, rows.index_select(0, index)))
    return logits, cache
