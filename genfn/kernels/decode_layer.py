"""A Llama decoder layer's decode step in two native calls, one on each side of the KV-cache write.

``attention_input`` is RMS norm, the fused q/k/v projection and RoPE; ``layer_output`` is the
attention over the cache, the output projection and residual, the MLP's norm, SwiGLU MLP and
residual. Each is one parallel region (``decode_layer.cpp``) where the op-by-op layer made six
thread-pool dispatches and ten calls: at batch 1 on two cores that overhead was ~15 % of a
bfloat16 step. The numbers are those of the op-by-op compiled layer (the same linear and
attention kernels; elementwise work in float32, rounded where the model code rounds).

:func:`takes` says whether a layer's decode step can run here; the model code falls back to
its op-by-op layer otherwise (prefill, quantized or biased weights, a dtype, grad, no kernels).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from genfn.kernels import MAX_DECODE_ROWS, _OP_NAMESPACE, decode_linear_available, kernel_status

__all__ = ["takes", "attention_input", "layer_output"]

_WEIGHTS = ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down")


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


# Read at import: a compiled step must not open files while it is traced. The bfloat16 layer
# needs the CPU's vdpbf16ps.
_BF16_DOT = _cpu_has("avx512_bf16")


def takes(x: torch.Tensor, layer: Mapping[str, Any], keys: torch.Tensor, head_dim: int) -> bool:
    """Whether ``layer``'s step on ``x [B, 1, hidden]`` (one token per row) runs natively: float32,
    or bfloat16 inside a compiled step on a CPU with AVX512_BF16; at most ``MAX_DECODE_ROWS`` rows; plain weights of
    ``x``'s dtype and no q/k/v bias; the cache in ``x``'s dtype; nothing to differentiate."""
    dtype = x.dtype
    if x.dim() != 3 or x.shape[1] != 1 or x.shape[0] > MAX_DECODE_ROWS.get(dtype, 0) or x.device.type != "cpu":
        return False
    if dtype == torch.bfloat16 and not (_BF16_DOT and torch.compiler.is_compiling()):
        # Eager bfloat16 rounds after every op (transformers' numbers); the native layer rounds
        # as the compiled step does, so it stands in for the compiled layer only.
        return False
    if "bqkv" in layer or keys.dtype != dtype or head_dim % 16 or head_dim > 128:
        return False
    for name in _WEIGHTS:
        weight = layer.get(name)  # a QuantizedWeight is no Tensor: its layers run op by op
        if not isinstance(weight, torch.Tensor) or weight.dtype != dtype or weight.device.type != "cpu":
            return False
    if torch.is_grad_enabled() and (x.requires_grad or any(layer[n].requires_grad for n in _WEIGHTS)):
        return False
    return decode_linear_available()


def _ops():
    if not decode_linear_available():
        raise RuntimeError(f"genfn.kernels.decode_layer needs the native kernels, which are {kernel_status()}")
    return getattr(torch.ops, _OP_NAMESPACE)


def attention_input(x: torch.Tensor, layer: Mapping[str, Any], cos: torch.Tensor, sin: torch.Tensor, eps: float,
                    heads: int, kv_heads: int) -> torch.Tensor:
    """``qkv [B, (heads + 2 kv_heads) * D]`` for ``x [B, 1, hidden]``: q and k rotated by
    ``cos, sin [B, 1, D]``."""
    batch = x.shape[0]
    return _ops().decode_attention_input(
        x.reshape(batch, x.shape[-1]), layer["attn_norm"], layer["wqkv"], cos.reshape(batch, cos.shape[-1]),
        sin.reshape(batch, sin.shape[-1]), eps, heads, kv_heads)


def layer_output(x: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                 layer: Mapping[str, Any], eps: float) -> torch.Tensor:
    """The layer's new residual stream ``[B, 1, hidden]``: ``q [B, H, D]`` attends ``keys``/``values
    [B, Hkv, A, D]`` where ``mask [B, 1, 1, A]`` is set, then the output projection, the MLP and
    both residual adds."""
    batch, hidden = x.shape[0], x.shape[-1]
    out = _ops().decode_layer_output(
        x.reshape(batch, hidden), q, keys, values, mask.reshape(batch, mask.shape[-1]), layer["wo"],
        layer["mlp_norm"], layer["w_gate_up"], layer["w_down"], eps, q.shape[-1] ** -0.5)
    return out.view(batch, 1, hidden)
