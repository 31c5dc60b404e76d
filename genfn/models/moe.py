"""The mixture-of-experts MLP of Qwen3-MoE, Mixtral and OLMoE: a top-k softmax router over
experts stored as one stacked weight per projection (``experts_gate_up [E, 2I, H]``,
``experts_down [E, H, I]``, transformers 5's layout), float tensors or a GGUF file's blocks
(``genfn.quant.QuantizedExperts``: Q8_0/Q4_0/Q4_1 and the K-quants, each expert's blocks as stored).

Router (transformers' ``TopKRouter``): ``softmax(x @ router.T)`` in float32, the ``k`` largest,
renormalized to sum to one where the family says (``norm_topk_prob``; Mixtral always), cast to the
activation dtype. Each chosen expert is a SwiGLU MLP; the outputs are summed with those weights.

Three ways to run it, picked by the call:

- a decode step (a few rows on the CPU, the native kernels built) runs a native kernel that reads
  only the chosen experts' weights: ``genfn_kernels::moe_decode`` for float32 stacks,
  ``genfn.kernels.moe_quant`` for block-quantized ones. Batch 1 streams ``k`` experts per layer,
  not ``E``;
- other eager calls (a prefill, a bfloat16 step) group the rows by expert: each expert that some
  row chose runs once on the rows that chose it, its outputs weighted and added in ascending
  expert order (transformers' loop): the work of ``k`` experts per row, not ``E``. The groups'
  sizes are data, so this runs only where nothing is being traced;
- inside a compiled step the rest run that same grouping as one op (``genfn_moe::grouped``, a
  ``torch.library`` custom op with a fake implementation of ``x``'s shape) that the compiler does
  not look into: the graph's shapes do not depend on the routing, the work is ``k`` experts per
  row whatever ``E`` is, and the numbers are the eager call's. On CUDA the op reads the group
  sizes on the host, so it is tagged ``cudagraph_unsafe`` (CUDA graphs run around it).

Under tensor parallelism (``genfn.models.tensor_parallel``) each rank holds a slice of every
expert's intermediate size; the router is whole on every rank, so every rank picks the same
experts, runs them on its slice by whichever path above, and one all-reduce sums the ranks'
partial outputs (float rounding: the parts are added in another order than one process's sum).
GPT-OSS's down biases are whole on every rank and added once, to that sum (``biased_moe_mlp``).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from genfn.kernels import MAX_DECODE_ROWS, decode_linear_available, linear
from genfn.kernels import moe_quant
from genfn.models import tensor_parallel
from genfn.quant.experts import QuantizedExperts

__all__ = ["route", "moe_mlp", "native_moe_takes", "route_top_k_softmax", "clamped_swiglu", "biased_moe_mlp"]


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
    return (isinstance(gate_up, torch.Tensor) and x.device.type == "cpu" and x.dtype == torch.float32
            and gate_up.dtype == torch.float32 and x.shape[0] <= MAX_DECODE_ROWS[torch.float32]
            and not (torch.is_grad_enabled() and x.requires_grad) and decode_linear_available())


def _expert(stack, e: int):
    """Expert ``e``'s matrix of a stacked projection (float or ``QuantizedExperts``)."""
    return stack.expert(e) if isinstance(stack, QuantizedExperts) else stack[e]


def _linear(x: torch.Tensor, weight) -> torch.Tensor:
    # Float experts multiply as transformers' loop does; blocks through genfn's quantized kernels.
    return F.linear(x, weight) if isinstance(weight, torch.Tensor) else linear(x, weight)


def _swiglu(x: torch.Tensor, gate_up, down) -> torch.Tensor:
    gate, up = _linear(x, gate_up).chunk(2, dim=-1)
    return _linear(F.silu(gate) * up, down)


def _grouped(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up, down) -> torch.Tensor:
    """Each chosen expert once, on the rows that chose it. The groups' sizes are data, so a compiled
    step calls this through ``_grouped_op``."""
    top_k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (row, slot) pairs grouped by expert, ascending
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    picked = weights.reshape(-1)
    out = torch.zeros_like(x)
    start = 0
    for e, count in enumerate(counts):
        if count:
            pairs = order[start:start + count]
            rows = pairs // top_k  # distinct: a row picks an expert once
            y = _swiglu(x[rows], _expert(gate_up, e), _expert(down, e)) * picked[pairs, None]
            # out[rows] += y without index_add_ (its scatter took 2.6 ms a call for 64 rows of 2048)
            out.index_copy_(0, rows, out.index_select(0, rows) + y)
        start += count
    return out


@torch.library.custom_op("genfn_moe::grouped", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _grouped_op(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                gate_up_scales: Optional[torch.Tensor], gate_up_mins: Optional[torch.Tensor], gate_up_format: str,
                gate_up_out: int, down: torch.Tensor, down_scales: Optional[torch.Tensor],
                down_mins: Optional[torch.Tensor], down_format: str, down_out: int) -> torch.Tensor:
    """``_grouped`` for a compiled step: each stack as its tensors (``_stack_parts``), rebuilt here."""
    gate_up_stack = _stack(gate_up, gate_up_scales, gate_up_mins, gate_up_format, gate_up_out, x.shape[-1])
    down_stack = _stack(down, down_scales, down_mins, down_format, down_out, gate_up_out // 2)
    return _grouped(x, weights, experts, gate_up_stack, down_stack)


@_grouped_op.register_fake
def _(x, weights, experts, gate_up, gate_up_scales, gate_up_mins, gate_up_format, gate_up_out, down, down_scales,
      down_mins, down_format, down_out):
    return torch.empty_like(x)


def _stack_parts(stack) -> tuple:
    """A stacked projection as ``(codes, scales, mins, format, out_features)``; a float stack is
    ``(stack, None, None, "float", out_features)``."""
    if isinstance(stack, QuantizedExperts):
        return stack.codes, stack.scales, stack.mins, stack.format, stack.out_features
    return stack, None, None, "float", stack.shape[1]


def _stack(codes, scales, mins, fmt: str, out_features: int, in_features: int):
    return codes if fmt == "float" else QuantizedExperts(codes, scales, mins, fmt, out_features, in_features)


def moe_mlp(spec: Any, layer: Mapping[str, Any], h: torch.Tensor) -> torch.Tensor:
    """The MoE MLP on ``h [..., H]`` with the layer's ``router``, ``experts_gate_up``, ``experts_down``."""
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    weights, experts = route(x, layer["router"], spec.experts_per_token, spec.norm_topk_prob)
    gate_up, down = layer["experts_gate_up"], layer["experts_down"]
    if native_moe_takes(x, gate_up) and isinstance(down, torch.Tensor):
        out, _ = torch.ops.genfn_kernels.moe_decode(x, experts, weights, gate_up, down)
    elif moe_quant.takes(x, gate_up, down):
        out, _ = moe_quant.moe_decode(x, experts, weights, gate_up, down)
    elif torch.compiler.is_compiling():
        out = _grouped_op(x, weights, experts, *_stack_parts(gate_up), *_stack_parts(down))
    else:
        out = _grouped(x, weights, experts, gate_up, down)
    if getattr(spec, "tensor_shard", None) is not None:  # this rank's part of every chosen expert's output
        out = tensor_parallel.reduced(spec, out)
    return out.reshape(shape)


# ---- GPT-OSS's variant: biased router and experts, softmax over the chosen k, clamped SwiGLU ----


def route_top_k_softmax(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor,
                        top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's router (transformers' ``GptOssTopKRouter``): the ``k`` largest of ``x @ router.T +
    bias``, softmaxed over those ``k`` alone. ``(weights [T, k] in x's dtype, experts [T, k])``."""
    top, experts = torch.topk(F.linear(x, router, bias), top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype), experts


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's activation of ``gate_up [..., 2I]`` (gate columns, then up): the gate clamped from
    above and the up projection on both sides at ``limit``, ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _biased_expert(x: torch.Tensor, layer: Mapping[str, Any], e: int, alpha: float, limit: float,
                   down_bias: bool = True) -> torch.Tensor:
    gate_up = _linear(x, _expert(layer["experts_gate_up"], e)) + layer["experts_gate_up_bias"][e]
    out = _linear(clamped_swiglu(gate_up, alpha, limit), _expert(layer["experts_down"], e))
    return out + layer["experts_down_bias"][e] if down_bias else out


def _biased_gathered(x: torch.Tensor, layer: Mapping[str, Any], weights: torch.Tensor, experts: torch.Tensor,
                     alpha: float, limit: float, down_bias: bool = True) -> torch.Tensor:
    """Each row's ``k`` chosen experts, their weights gathered from the float stacks: static shapes
    (a compiled step's few rows) that read ``T * k`` experts, not all ``E``."""
    gate_up = torch.einsum("th,tkoh->tko", x, layer["experts_gate_up"][experts])
    act = clamped_swiglu(gate_up + layer["experts_gate_up_bias"][experts], alpha, limit)
    out = torch.einsum("tki,tkhi->tkh", act, layer["experts_down"][experts])
    if down_bias:
        out = out + layer["experts_down_bias"][experts]
    return (out * weights.unsqueeze(-1)).sum(dim=1)


def biased_moe_mlp(spec: Any, layer: Mapping[str, Any], h: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's MoE MLP on ``h [..., H]``: ``route_top_k_softmax`` over the layer's ``router`` and
    ``router_bias``, experts ``experts_gate_up [E, 2I, H]`` (gate rows, then up) and ``experts_down
    [E, H, I]`` (float, or ``QuantizedExperts``) with their biases, ``clamped_swiglu`` between them
    (``spec.swiglu_alpha``, ``spec.swiglu_limit``). Eagerly each chosen expert runs once on the rows
    that chose it (ascending expert order, as transformers adds them); inside a compiled step a few
    rows gather their chosen float experts, more rows (or quantized stacks) run every expert
    weighted zero where unchosen.

    Under tensor parallelism each rank runs its slice of the chosen experts; one all-reduce sums
    the slices, and the chosen down biases (whole on every rank), weighted, are added to the sum once."""
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    weights, experts = route_top_k_softmax(x, layer["router"], layer["router_bias"], spec.experts_per_token)
    alpha, limit = spec.swiglu_alpha, spec.swiglu_limit
    sharded = spec.tensor_shard is not None
    gate_up = layer["experts_gate_up"]
    num_experts = gate_up.shape[0]
    if not torch.compiler.is_compiling():  # the groups' sizes are data: eager only
        out = torch.zeros_like(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (row, slot) pairs grouped by expert, ascending
        start = 0
        for e, count in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
            if count:
                pairs = order[start:start + count]
                rows = pairs // spec.experts_per_token
                y = _biased_expert(x[rows], layer, e, alpha, limit, not sharded) * weights.reshape(-1)[pairs, None]
                out.index_copy_(0, rows, out.index_select(0, rows) + y)
            start += count
    elif isinstance(gate_up, torch.Tensor) and x.shape[0] * spec.experts_per_token < num_experts:
        out = _biased_gathered(x, layer, weights, experts, alpha, limit, not sharded)
    else:
        out = torch.zeros_like(x)
        for e in range(num_experts):
            weight = (weights * (experts == e)).sum(dim=-1, keepdim=True)
            out = out + _biased_expert(x, layer, e, alpha, limit, not sharded) * weight
    if sharded:
        out = tensor_parallel.reduced(spec, out) \
            + (layer["experts_down_bias"][experts] * weights.unsqueeze(-1)).sum(dim=1)
    return out.reshape(shape)
