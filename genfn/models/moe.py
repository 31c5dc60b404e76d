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
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from genfn.kernels import MAX_DECODE_ROWS, decode_linear_available, linear
from genfn.kernels import moe_quant
from genfn.quant.experts import QuantizedExperts

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
    return out.reshape(shape)
