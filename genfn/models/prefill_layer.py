"""A plain Llama decoder layer over many float32 or bfloat16 tokens per row (a prefill), with its
work between the linears in native passes.

Op by op, a 512-token SmolLM2 prefill spent ~20 % of its time in the elementwise ops between the
linears (torch profiler, 2 threads): RMSNorm as five kernels, RoPE as ten per q and k, SwiGLU as
a silu and a product, each a pass over the whole activation. Here each is one native pass
(``genfn.kernels.invariant``'s row ops, ``token_ops.cpp``): the norm and the residual add fused,
RoPE and the q/k/v split fused, silu and the product fused; attention is the native prefill
kernel (``genfn.kernels.prefill_attention``). float32 activations keep the op-by-op layer's
values (sums in another order: within rounding, as a prefill is promised). bfloat16 ones are
widened inside each op and rounded once at its output, where the op-by-op layer rounds after
every torch op (RoPE's products and sum, silu then the product; the norm rounds at the same two
places): within bfloat16 rounding of it. bfloat16 linears on plain bfloat16 weights take genfn's
``vdpbf16ps`` GEMM (``bf16_gemm.cpp``), packing each 48-column panel of the weight as it goes (no
packed copy is kept), and the gate/up GEMM runs SwiGLU on its float32 sums before its one rounding
(the separate pass rounded gate and up first: within that rounding). oneDNN's GEMM was already
near the core's ``vdpbf16ps`` ceiling: a 512-token SmolLM2 prefill gains 3-9 % a CPU-second
(docs/guides/k-quants-and-scale.md). Where the CPU has AMX-BF16 tiles, oneDNN's GEMM runs on them
and the linears stay there (``bf16_gemm_preferred``). Which layer runs is decided from shapes,
dtypes, the spec and the CPU alone.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import torch

from genfn.kernels import MIN_PREFILL_QUERIES, invariant, linear, portable_ops_available, prefill_attention
from genfn.kernels.packed_gemm import bf16_gemm_preferred
from genfn.quant.coded_bf16 import CodedBfloat16

__all__ = ["takes", "prefill_layer", "PrefillRows", "prefill_rows", "first_real_slots"]


def takes(spec, layer: Mapping[str, Any], x: torch.Tensor) -> bool:
    """Whether ``prefill_layer`` runs this layer: a plain Llama layer (no variant, no tensor
    parallelism, a head_dim the attention kernels take) on float32 or bfloat16 activations of at
    least MIN_PREFILL_QUERIES tokens per row, or float32 ones of fewer (the rows the native decode
    layer would take one by one, too many for one call of it: a batch of short prompts, a decode
    step of many rows), with norm weights of their dtype (the row ops take one dtype), the native
    kernels built, nothing to differentiate (the native ops have no backward: neither ``x`` nor a
    tensor of the layer may need a gradient)."""
    few = x.shape[1] < MIN_PREFILL_QUERIES
    return (spec.is_plain_llama and spec.tensor_shard is None and x.dtype in (torch.float32, torch.bfloat16)
            and layer["attn_norm"].dtype == layer["mlp_norm"].dtype == x.dtype
            and x.device.type == "cpu" and (not few or x.dtype == torch.float32)
            and spec.head_dim % 16 == 0 and spec.head_dim <= 256
            and not (torch.is_grad_enabled() and _needs_gradient(layer, x)) and portable_ops_available())


def _needs_gradient(layer: Mapping[str, Any], x: torch.Tensor) -> bool:
    return x.requires_grad or any(isinstance(t, torch.Tensor) and t.requires_grad for t in layer.values())


class PrefillRows(NamedTuple):
    """What a forward of many queries a row tells its layers' attention about its rows, found once
    for all its layers (``prefill_rows``)."""

    first_slots: torch.Tensor  # [B] each row's first real slot, where the prefill kernel's key tiles start
    walked: torch.Tensor | None  # the rows of fewer than MIN_PREFILL_QUERIES real tokens, attended query by query


def prefill_rows(cache, attention_mask: torch.Tensor | None, seq: int, attend_len) -> PrefillRows | None:
    """``PrefillRows`` for a forward of ``seq`` tokens a row (``attention_mask [B, S]`` marking its
    real ones), after ``begin_forward``; None where it has fewer than MIN_PREFILL_QUERIES (every row
    is attended query by query then).

    A row of fewer real tokens, left-padded beside a longer prompt, runs alone as a few-token
    forward: the native decode layer's walk over its keys. Walking it here too gives it those bits
    in the batch. Which rows those are is read on the host, so a traced forward walks none."""
    if seq < MIN_PREFILL_QUERIES:
        return None
    walked = None
    if attention_mask is not None and not torch.compiler.is_compiling():
        rows = (attention_mask.sum(dim=1) < MIN_PREFILL_QUERIES).nonzero().flatten()
        walked = rows if rows.numel() else None
    return PrefillRows(first_real_slots(cache, attend_len), walked)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
              row_plan: PrefillRows) -> torch.Tensor:
    """``q [B, S, H, D]`` (S >= MIN_PREFILL_QUERIES) against its rows' visible ``keys``/``values [B,
    Hkv, A, D]``: the native prefill kernel (SDPA where it declines the layout), the walked rows
    query by query. Returns ``[B, S, H, D]``."""
    heads_first = q.transpose(1, 2)
    attn = prefill_attention(heads_first, keys, values, mask, row_plan.first_slots)
    if attn is None:  # a mask or cache layout the kernel does not take
        attn = torch.nn.functional.scaled_dot_product_attention(heads_first, keys, values, attn_mask=mask,
                                                                enable_gqa=True)
    attn = attn.transpose(1, 2)
    rows = row_plan.walked
    if rows is not None:
        walked = invariant.dense_attention(q.index_select(0, rows), keys, values, mask.index_select(0, rows), rows)
        attn = attn.index_copy(0, rows, walked.view(rows.shape[0], *q.shape[1:]))
    return attn


def prefill_layer(spec, layer: Mapping[str, Any], i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache, slots: torch.Tensor, mask: torch.Tensor, attend_len,
                  row_plan: PrefillRows | None) -> torch.Tensor:
    """Decoder layer ``i`` on ``x [B, S, H]`` (writing its K, V at ``slots`` into the donated
    ``cache``): the op-by-op layer's values, in fewer passes. ``row_plan``: the forward's
    ``prefill_rows``."""
    batch, seq, hidden = x.shape
    eps, heads, kv_heads, head_dim = spec.rms_norm_eps, spec.num_heads, spec.num_kv_heads, spec.head_dim
    rows = x.reshape(batch * seq, hidden)
    qkv = _linear(invariant.rms_norm(rows, layer["attn_norm"], eps), layer["wqkv"], layer.get("bqkv"))
    q, k, v = invariant.rope_qkv(qkv, cos.reshape(batch * seq, -1), sin.reshape(batch * seq, -1), heads, kv_heads)
    k = k.view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    v = v.view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    keys, values = cache.write_layer(i, slots, k, v)
    keys, values = keys[:, :, :attend_len], values[:, :, :attend_len]
    q = q.view(batch, seq, heads, head_dim)
    if row_plan is None:
        # Each query on its own over its row's visible keys, as the native decode layer (and the
        # stack of layers) attends them: a row's tokens get the bits they get there, alone.
        attn = invariant.dense_attention(q, keys, values, mask)
    else:
        attn = attention(q, keys, values, mask, row_plan)
    attn = attn.reshape(batch * seq, heads * head_dim)
    rows, h = invariant.add_rms_norm(rows, _linear(attn, layer["wo"]), layer["mlp_norm"], eps)
    out = rows + _linear(_swiglu(h, layer["w_gate_up"]), layer["w_down"])
    return out.view(batch, seq, hidden)


def first_real_slots(cache, attend_len) -> torch.Tensor:
    """``[B]``: each row's first real slot in the cache (past its left padding), where the prefill
    kernel's key tiles start."""
    return cache.valid[:, :attend_len].to(torch.int8).argmax(dim=1)


def _on_bf16_gemm(x: torch.Tensor, weight) -> bool:
    """Whether genfn's bfloat16 GEMM takes ``x @ weight.T``: both bfloat16, the weight a plain tensor
    or a coded one (decoded as the GEMM takes it, so that a coded model's prefill has the plain
    model's bits; a quantized weight has its own kernels), on a CPU where that GEMM is the faster
    (without AMX)."""
    return (isinstance(weight, (torch.Tensor, CodedBfloat16)) and weight.dtype == x.dtype == torch.bfloat16
            and bf16_gemm_preferred())


def _linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if _on_bf16_gemm(x, weight):
        if isinstance(weight, CodedBfloat16):
            if bias is None:
                return torch.ops.genfn_kernels.coded_bf16_gemm(x, *weight.tensors(), False)
            weight = torch.ops.genfn_kernels.coded_bf16_decode(*weight.tensors())  # the GEMM adds the bias
        return torch.ops.genfn_kernels.bf16_gemm_plain(x, weight, bias, False)
    return linear(x, weight, bias)


def _swiglu(x: torch.Tensor, gate_up) -> torch.Tensor:
    """silu(gate) * up of ``x``'s gate/up projection (``gate_up = [gate; up]``)."""
    if _on_bf16_gemm(x, gate_up):
        if isinstance(gate_up, CodedBfloat16):
            return torch.ops.genfn_kernels.coded_bf16_gemm(x, *gate_up.tensors(), True)
        return torch.ops.genfn_kernels.bf16_gemm_swiglu(x, gate_up)
    return invariant.silu_mul(linear(x, gate_up))
