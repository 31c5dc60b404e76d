"""The mixture-of-experts MLP of Qwen3-MoE, Mixtral and OLMoE: a top-k softmax router over
experts stored as one stacked weight per projection (``experts_gate_up [E, 2I, H]``,
``experts_down [E, H, I]``, transformers 5's layout).

Router (transformers' ``TopKRouter``): ``softmax(x @ router.T)`` in float32, the ``k`` largest,
renormalized to sum to one where the family says (``norm_topk_prob``; Mixtral always), cast to the
activation dtype. Each chosen expert is a SwiGLU MLP; the outputs are summed with those weights.

A decode step (a few rows, float32, the native kernels built) runs ``genfn_kernels::moe_decode``
(``genfn/kernels/moe_decode.cpp``), which reads only the chosen experts' weights: batch 1 streams
``k`` experts per layer, not ``E``. Other calls (prefill, bfloat16) run every expert on every row
with the unchosen ones weighted zero: shapes that do not depend on the routing (so the step
compiles), the same sums in the same (ascending expert) order as transformers' loop.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

from genfn.kernels import MAX_DECODE_ROWS, decode_linear_available

__all__ = ["route", "moe_mlp", "native_moe_takes"]


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] in x's dtype, experts [T, k] int64)`` for ``x [T, H]``."""
    logits = F.linear(x, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def native_moe_takes(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """Whether ``moe_decode`` runs these rows: float32 on the CPU, a decode step's few rows."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and gate_up.dtype == torch.float32
            and x.shape[0] <= MAX_DECODE_ROWS[torch.float32] and not (torch.is_grad_enabled() and x.requires_grad)
            and decode_linear_available())


def moe_mlp(spec: Any, layer: Mapping[str, Any], h: torch.Tensor) -> torch.Tensor:
    """The MoE MLP on ``h [..., H]`` with the layer's ``router``, ``experts_gate_up``, ``experts_down``."""
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    weights, experts = route(x, layer["router"], spec.experts_per_token, spec.norm_topk_prob)
    gate_up, down = layer["experts_gate_up"], layer["experts_down"]
    if native_moe_takes(x, gate_up):
        out, _ = torch.ops.genfn_kernels.moe_decode(x, experts, weights, gate_up, down)
        return out.reshape(shape)
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        weight = (weights * (experts == e)).sum(dim=-1, keepdim=True)  # [T, 1]; 0 where e was not chosen
        gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
        out = out + F.linear(F.silu(gate) * up, down[e]) * weight
    return out.reshape(shape)
