"""The Llama family's decoder layers in the batch-invariant mode (``genfn.deterministic``).

One layer loop, ``invariant_layers``, serves ``generate`` (``genfn.models.llama``, the static
cache) and continuous batching (``genfn.models.packed``, the paged cache): they differ only in the
``attend`` function they pass, so a request's logits are the same bits in both. Every step runs
per token row through ``genfn.kernels.invariant`` (linears, norms, RoPE, SwiGLU, attention) and
``genfn.kernels.invariant_ops`` (the mixture of experts), and covers the variants of
``genfn.models.llama_variants``:

- q/k norms per head (Qwen3, Qwen3-MoE) or over the projections (OLMo 2, OLMoE), and post-norms
  (OLMo 2): native per-row RMSNorms;
- layers without RoPE (SmolLM3): q, k, v split from the fused projection, nothing rotated;
- partial rotary (Phi-4-mini): the native rotation over each head's first ``rotary_dim``
  dimensions, the rest copied;
- LongRoPE (Phi-3): cos/sin at each token's own factors; a token's choice depends on its own
  request only (``long_rope_furthest`` here for ``generate``, ``genfn.models.packed.furthest_positions``
  for continuous batching), never on the batch's furthest position;
- fused q/k/v and gate/up (every family's layout, Phi-3's checkpoints' own): each output element
  of the invariant linear is its own dot product, fused or not;
- mixtures of experts (Qwen3-MoE, Mixtral, OLMoE): ``invariant_ops.moe_mlp``.

Nothing here imports ``genfn.models.llama`` (which imports this module).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from genfn.kernels import invariant, invariant_ops

__all__ = ["check_invariant_spec", "invariant_layers", "invariant_logits", "long_rope_furthest", "rotate_qkv"]


def check_invariant_spec(spec: Any) -> None:
    """Refuse a model the batch-invariant mode has no invariant layer for: a tensor-parallel shard
    (its row-parallel sums are not the mode's per-token order yet)."""
    if spec.tensor_shard is not None:
        raise ValueError(invariant.no_invariant_forward(f"{spec.architecture} under tensor parallelism",
                                                        "run it on one process, or outside the mode"))


def long_rope_furthest(positions: torch.Tensor) -> torch.Tensor:
    """For ``positions [B, S]``: each token's "furthest position of its forward" as its own row's
    furthest (LongRoPE picks its factors by it), so a row's rotation never depends on the other
    rows of a ``generate`` batch; a prompt's tokens get its last position, a decode step's token
    its own, as ``genfn.models.packed.furthest_positions`` gives them in continuous batching."""
    return positions.amax(dim=-1, keepdim=True).expand_as(positions)


def _qk_norm(spec: Any, layer: Mapping[str, Any], qkv: torch.Tensor) -> torch.Tensor:
    """``qkv [T, (H + 2 Hkv) D]`` with q and k RMS-normed per head (Qwen3) or over the projection
    (OLMo 2), each row on its own."""
    eps, head_dim = spec.rms_norm_eps, spec.head_dim
    q_size, kv_size = spec.num_heads * head_dim, spec.num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    if spec.qk_norm == "head":  # rows of one head each
        q = invariant.rms_norm(q.reshape(-1, spec.num_heads, head_dim), layer["q_norm"], eps).reshape(-1, q_size)
        k = invariant.rms_norm(k.reshape(-1, spec.num_kv_heads, head_dim), layer["k_norm"], eps).reshape(-1, kv_size)
    else:
        q, k = invariant.rms_norm(q, layer["q_norm"], eps), invariant.rms_norm(k, layer["k_norm"], eps)
    return torch.cat([q, k, v], dim=-1)


def _split_heads(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    num_tokens = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (q.reshape(num_tokens, heads, head_dim).contiguous(), k.reshape(num_tokens, kv_heads, head_dim).contiguous(),
            v.reshape(num_tokens, kv_heads, head_dim).contiguous())


def rotate_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
               rotate: bool = True):
    """``qkv [T, (H + 2 Hkv) D]`` as ``q [T, H, D]``, ``k, v [T, Hkv, D]``, q and k rotated at
    ``cos, sin [T, R]`` per row (``invariant.rope_qkv``): all of each head when ``R == D``, its first
    ``R`` dimensions when ``R < D`` (partial rotary), none when not ``rotate`` (a layer without RoPE)."""
    if not rotate:
        return _split_heads(qkv, heads, kv_heads, head_dim)
    rotary = cos.shape[-1]
    if rotary == head_dim:
        return invariant.rope_qkv(qkv, cos, sin, heads, kv_heads)
    num_tokens = qkv.shape[0]
    leading = qkv.reshape(num_tokens, heads + 2 * kv_heads, head_dim)[..., :rotary].reshape(num_tokens, -1)
    q_rot, k_rot, _ = invariant.rope_qkv(leading, cos, sin, heads, kv_heads)
    q, k, v = _split_heads(qkv, heads, kv_heads, head_dim)
    return torch.cat([q_rot, q[..., rotary:]], dim=-1), torch.cat([k_rot, k[..., rotary:]], dim=-1), v


def _mlp(spec: Any, layer: Mapping[str, Any], h: torch.Tensor) -> torch.Tensor:
    if spec.num_experts:
        return invariant_ops.moe_mlp(h, layer["router"], layer["experts_gate_up"], layer["experts_down"],
                                     spec.experts_per_token, spec.norm_topk_prob)
    return invariant.linear(invariant.silu_mul(invariant.linear(h, layer["w_gate_up"])), layer["w_down"])


def invariant_layers(spec: Any, layers, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend):
    """The decoder layers in the batch-invariant mode: the tokens as rows ``[T, hidden]`` (``cos,
    sin [T, R]``) through per-row ops; ``attend(i, q, k, v)`` writes layer ``i``'s keys/values
    (``[T, Hkv, D]``) to the cache and returns each query's attention ``[T, H, D]``. Returns
    ``(residual, last MLP output)``, to be summed by ``invariant_logits``' norm."""
    ops = invariant
    eps, heads, kv_heads = spec.rms_norm_eps, spec.num_heads, spec.num_kv_heads
    mlp_out = None  # the previous layer's MLP output, added to the residual in the next norm's call
    for i, layer in enumerate(layers):
        if spec.post_norms:  # OLMo 2: no input norms; the outputs are normed before each residual add
            h = rows = rows if mlp_out is None else rows + mlp_out
        elif mlp_out is None:
            h = ops.rms_norm(rows, layer["attn_norm"], eps)
        else:
            rows, h = ops.add_rms_norm(rows, mlp_out, layer["attn_norm"], eps)
        qkv = ops.linear(h, layer["wqkv"], layer.get("bqkv"))
        if spec.qk_norm is not None:
            qkv = _qk_norm(spec, layer, qkv)
        rotate = spec.rope_layers is None or spec.rope_layers[i]
        q, k, v = rotate_qkv(qkv, cos, sin, heads, kv_heads, spec.head_dim, rotate)
        attn_out = ops.linear(attend(i, q, k, v).reshape(rows.shape[0], heads * spec.head_dim), layer["wo"])
        if spec.post_norms:
            rows = h = rows + ops.rms_norm(attn_out, layer["post_attn_norm"], eps)
        else:
            rows, h = ops.add_rms_norm(rows, attn_out, layer["mlp_norm"], eps)
        mlp_out = _mlp(spec, layer, h)
        if spec.post_norms:
            mlp_out = ops.rms_norm(mlp_out, layer["post_mlp_norm"], eps)
    return rows, mlp_out


def invariant_logits(spec: Any, params: Mapping[str, Any], rows: torch.Tensor, mlp_out: torch.Tensor):
    """The final norm and LM head of ``invariant_layers``' rows: float32 ``[rows, V]``."""
    _, h = invariant.add_rms_norm(rows, mlp_out, params["norm"], spec.rms_norm_eps)
    return invariant.linear(h, params["lm_head"], out_float32=True)
