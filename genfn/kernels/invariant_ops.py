"""The batch-invariant mode's ops for the families beyond Llama's layer: Gemma's GeGLU, norm and
soft-capping, attention with a scale and soft-cap of its own, and the mixture of experts.

``genfn.kernels.invariant`` holds the mode itself and the Llama layer's kernels; these build on
them, under the same rule: every value a token's logits pass through is computed from that
token's own row alone, in an order that does not depend on how many rows the call has or on the
thread count.

- Elementwise math (the GELU, ``tanh`` soft-caps, the router's ``exp``) runs as torch's eager
  ops over float32: each element is computed alone, and the transcendental ones go through
  torch's vector math for every element, the tail of a buffer included, so an element's bits do
  not depend on where in the buffer it sits. Each op here is an opaque ``torch.library``
  custom op, so a compiled step runs the same eager arithmetic (inductor would fuse the chain and
  round bfloat16 intermediates elsewhere), as ``genfn.models.rope``'s cos/sin do.
- The MoE MLP: router logits by the invariant linear, softmax as ``exp(logit - logsumexp)`` with
  the row's logsumexp from one native pass, top-k per row, each chosen expert's SwiGLU through
  the invariant linears on the rows that chose it, the weighted outputs added to each row in
  ascending expert order (transformers' loop): the row's sum never depends on the other rows.
"""

from __future__ import annotations

import math

import torch

from genfn.kernels import invariant
from genfn.quant.experts import QuantizedExperts

__all__ = ["gelu_tanh_mul", "gemma_rms_norm", "soft_cap", "dense_attention", "paged_attention", "moe_mlp"]

_GELU_SCALE = math.sqrt(2.0 / math.pi)


@torch.library.custom_op("genfn_invariant::gelu_tanh_mul", mutates_args=())
def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` of ``gate_up [T, 2F]`` (its two halves), in float32, rounded once to
    ``gate_up``'s dtype: ``0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * up``."""
    gate, up = gate_up.to(torch.float32).chunk(2, dim=-1)
    inner = (gate + gate * gate * gate * 0.044715) * _GELU_SCALE
    return (gate * 0.5 * (torch.tanh(inner) + 1.0) * up).to(gate_up.dtype)


@gelu_tanh_mul.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("genfn_invariant::gemma_rms_norm", mutates_args=())
def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm of each row of ``x [..., H]``: normalized and scaled by ``1 + weight`` in
    float32 (the native per-row norm), rounded once to ``x``'s dtype."""
    scale = weight.to(torch.float32) + 1.0
    return invariant.rms_norm(x.to(torch.float32), scale, eps).to(x.dtype)


@gemma_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("genfn_invariant::soft_cap", mutates_args=())
def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``tanh(x / cap) * cap`` elementwise (Gemma 2's final logits)."""
    return torch.tanh(x / cap) * cap


@soft_cap.register_fake
def _(x, cap):
    return torch.empty_like(x)


def _attention_options(head_dim: int, scale: float | None, softcap: float | None) -> tuple[float, float]:
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive float or None, got {softcap!r}")
    return (head_dim ** -0.5 if scale is None else float(scale)), (0.0 if softcap is None else float(softcap))


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """``genfn.kernels.invariant.dense_attention`` with the scores scaled by ``scale`` (default
    ``head_dim ** -0.5``) and soft-capped, ``tanh(s / softcap) * softcap``, where ``softcap`` is set."""
    scale, cap = _attention_options(q.shape[-1], scale, softcap)
    return invariant.dense_attention(q, keys, values, mask, scale=scale, softcap=cap)


def paged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
                    request_index: torch.Tensor, positions: torch.Tensor, sliding_window: int | None,
                    scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """``genfn.kernels.invariant.paged_attention`` with ``scale`` and ``softcap`` as in ``dense_attention``."""
    scale, cap = _attention_options(q.shape[-1], scale, softcap)
    tables = block_tables.index_select(0, request_index)
    return torch.ops.genfn_kernels.paged_query_attention(q, keys, values, tables, positions + 1, scale,
                                                          sliding_window or 0, cap)


# ---------------------------------------------------------------------------------------------
# Mixture of experts


@torch.library.custom_op("genfn_invariant::route", mutates_args=())
def _route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(weights [T, k], experts [T, k])`` of float32 router logits ``[T, E]``, per row."""
    _, logsumexp = torch.ops.genfn_kernels.max_logsumexp(logits.contiguous())
    probs = torch.exp(logits - logsumexp.unsqueeze(-1))
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:  # the k weights summed left to right, elementwise: no reduction kernel's order
        total = weights[:, 0]
        for j in range(1, top_k):
            total = total + weights[:, j]
        weights = weights / total.unsqueeze(-1)
    return weights, experts


@_route.register_fake
def _(logits, top_k, normalize):
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape), logits.new_empty(shape, dtype=torch.int64)


def _expert(stack, e: int):
    return stack.expert(e) if isinstance(stack, QuantizedExperts) else stack[e]


def _num_experts(stack) -> int:
    return stack.num_experts if isinstance(stack, QuantizedExperts) else stack.shape[0]


def _moe_rows(x: torch.Tensor, router, gate_up, down, top_k: int, normalize: bool, grouped: bool) -> torch.Tensor:
    """The MoE MLP of ``x [T, H]``. ``grouped``: each expert on the rows that chose it (shapes from
    the routing: eager only); else every expert on every row, weighted zero where unchosen (a
    zero term adds nothing, so both give the same bits)."""
    weights, experts = _route(invariant.linear(x, router, out_float32=True), top_k, normalize)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    if not grouped:
        for e in range(_num_experts(gate_up)):
            weight = (weights * (experts == e)).sum(dim=-1, keepdim=True)  # one nonzero term at most: exact
            y = invariant.linear(invariant.silu_mul(invariant.linear(x, _expert(gate_up, e))), _expert(down, e))
            out = out + y * weight
        return out
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=_num_experts(gate_up)).tolist()
    picked = weights.reshape(-1)
    start = 0
    for e, count in enumerate(counts):
        if count:
            pairs = order[start:start + count]
            rows = pairs // top_k
            y = invariant.linear(invariant.silu_mul(invariant.linear(x.index_select(0, rows), _expert(gate_up, e))),
                                 _expert(down, e))
            out.index_copy_(0, rows, out.index_select(0, rows) + y * picked[pairs, None])
        start += count
    return out


@torch.library.custom_op("genfn_invariant::moe_mlp", mutates_args=())
def _moe_op(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
            normalize: bool) -> torch.Tensor:
    return _moe_rows(x, router, gate_up, down, top_k, normalize, grouped=True)


@_moe_op.register_fake
def _(x, router, gate_up, down, top_k, normalize):
    return torch.empty_like(x)


def moe_mlp(x: torch.Tensor, router, gate_up, down, top_k: int, normalize: bool) -> torch.Tensor:
    """The batch-invariant MoE MLP of ``x [T, H]`` (see the module's docstring): float expert
    stacks ``[E, 2I, H]``/``[E, H, I]`` or ``QuantizedExperts``. Float stacks run as one opaque op
    (a compiled step runs the eager loop); quantized ones eagerly by expert group, and inside a
    compiled step every expert on every row (the same sums: unchosen experts weigh zero)."""
    floats = all(isinstance(w, torch.Tensor) for w in (router, gate_up, down))
    if floats:
        return _moe_op(x.contiguous(), router, gate_up, down, top_k, normalize)
    return _moe_rows(x, router, gate_up, down, top_k, normalize, grouped=not torch.compiler.is_compiling())
