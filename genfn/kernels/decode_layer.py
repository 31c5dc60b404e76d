"""A Llama decoder layer's decode step in two native calls, one on each side of the KV-cache write.

``attention_input`` is RMS norm, the fused q/k/v projection and RoPE; ``layer_output`` is the
attention over the cache, the output projection and residual, the MLP's norm, SwiGLU MLP and
residual. ``mlp_input`` is ``layer_output``'s MLP up to its down projection, for a tensor-parallel
rank (which sums the o and down projections over the ranks around it). Each is one parallel region (``decode_layer.cpp``) where the op-by-op layer made six
thread-pool dispatches and ten calls: at batch 1 on two cores that overhead was ~15 % of a
bfloat16 step. The numbers are those of the op-by-op compiled layer (the same linear and
attention kernels; elementwise work in float32, rounded where the model code rounds).

Block-quantized layers (``QuantizedWeight`` linears, float32 activations) take the ``_quant``
forms of both ops: the same layer around ``quant_linear``'s arithmetic. GGUF K-quant layers (every
linear a ``KQuantWeight`` of Q4_K/Q5_K/Q6_K/IQ4, or a ``RowStack`` of them, as a Q4_K_M file's q/k
beside a Q6_K v) take the ``_kquant`` forms: the same layer around ``kquant_linear``'s row kernels,
which stay in the K-quant library (built per function for AVX-512 or AVX2) and are reached through
its entry table (``kquant.h``'s ``LayerEntry``), so each token gets the bits the op-by-op row
kernels give it.

:func:`takes` says whether a layer's decode step can run here; the model code falls back to
its op-by-op layer otherwise (prefill, biased or mixed weights, a dtype, grad, no kernels).

:func:`run_stack` runs a step's whole stack of such layers in one native call (``decode_stack.cpp``,
built from the same pieces, ``decode_layer.h``), each layer's keys and values written into the cache
between its two halves: the model code takes it wherever every layer would take the two calls,
eager and compiled, and the Python between the layers' calls is gone. It reads the layers' weights
from a table (:func:`stack_table`): their pointers, checked once, in one tensor that keeps them
alive, which a family builds once with its params (``genfn.models.registry.step_params``), so that a
step hands the stack one tensor, not every weight (a compiled step's wrapper and dynamo's bytecode
spent ~1 us on each of SmolLM2's ~440).
:func:`run_paged_stack` is the same stack over continuous batching's paged cache, for a packed
batch of a few tokens (decode steps, drafts, short prompt chunks).

On a CPU without AVX-512 the decode library cannot load; the stack's own build for AVX2
(``native.DECODE_AVX2``) runs there instead, for layers of plain weights, tiles16 blocks and K-quant
rows, with the same bits (``lanes16.h``, ``plain_rows.h``; bfloat16 the AVX-512 library's widening
path's); coded bfloat16 layers run op by op there.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from genfn.kernels import (MAX_DECODE_ROWS, _OP_NAMESPACE, decode_linear_available, decode_stack_isa, kernel_status,
                           kquant, native, portable_ops_available)
from genfn.quant.coded_bf16 import CodedBfloat16
from genfn.quant.kquants import FORMAT_ID, KQuantWeight
from genfn.quant.stack import RowStack
from genfn.quant.weight import QuantizedWeight

__all__ = ["takes", "quantized", "kquantized", "attention_input", "layer_output", "mlp_input", "stack_takes",
           "stack_table", "run_stack", "run_paged_stack"]

# The most tokens one call takes (decode_layer.cpp's kMaxLayerRows): a decode step's rows, or a
# speculative verification's positions (each of them the bits of a step of that token alone).
MAX_LAYER_ROWS = 2 * MAX_DECODE_ROWS[torch.float32]

_NORMS = ("attn_norm", "mlp_norm")
_LINEARS = ("wqkv", "wo", "w_gate_up", "w_down")
_WEIGHTS = _NORMS + _LINEARS

# Read at import: a compiled step must not open files while it is traced. The coded bfloat16 layer
# needs the CPU's vdpbf16ps, the quantized one its vpdpbusd (plain bfloat16 layers widen where the
# CPU has no vdpbf16ps).
_BF16_DOT = native.cpu_has("avx512_bf16")
_VNNI = native.cpu_has("avx512_vnni")


def _tiles(weight) -> bool:
    return isinstance(weight, QuantizedWeight) and weight.layout == "tiles16" and weight.codes.is_cpu


def quantized(layer: Mapping[str, Any]) -> bool:
    """Whether every linear of ``layer`` is a block-quantized weight the quantized form reads."""
    return all(_tiles(layer.get(n)) for n in _LINEARS)


# The most row ranges in other formats one K-quant linear may stack (kquant.h's SharedLinear::kMaxParts).
_MAX_KQUANT_PARTS = 4


def _kquant_parts(weight) -> tuple | None:
    """A linear's K-quant parts (one, or a ``RowStack``'s), or None where it is not all K-quant on the CPU."""
    parts = weight.parts if isinstance(weight, RowStack) else (weight,)
    if len(parts) > _MAX_KQUANT_PARTS or not all(isinstance(p, KQuantWeight) and p.data.is_cpu
                                                 for p in parts):
        return None
    return parts


# The most row ranges in other tile kinds one tiles linear may stack (decode_layer.h's QuantLinear::kMaxParts).
_MAX_TILE_PARTS = 4


def _tile_parts(weight) -> tuple | None:
    """A linear's tiles parts (one, or a ``RowStack``'s: a Q5_K_M file's Q5_1 q/k beside its Q8_0 v),
    or None where it is not all tiles on the CPU."""
    parts = weight.parts if isinstance(weight, RowStack) else (weight,)
    return parts if len(parts) <= _MAX_TILE_PARTS and all(_tiles(p) for p in parts) else None


def kquantized(layer: Mapping[str, Any]) -> bool:
    """Whether every linear of ``layer`` is GGUF K-quant rows (a ``KQuantWeight``, or a ``RowStack`` of
    them) that the ``_kquant`` form reads with the native K-quant kernels."""
    # Where the decode kernels load (AVX-512) the K-quant kernels have a path: only their library is asked.
    return all(_kquant_parts(layer.get(n)) for n in _LINEARS) and kquant.kquant_available()


def takes(x: torch.Tensor, layer: Mapping[str, Any], keys: torch.Tensor, head_dim: int) -> bool:
    """Whether ``layer``'s step on ``x [B, S, hidden]`` (S tokens of each row, a decode step's one or a
    verification's drafts) runs natively: float32, or bfloat16 inside a compiled step; at most
    ``MAX_LAYER_ROWS`` tokens; plain weights of ``x``'s dtype, or every linear block-quantized with
    float32 ``x`` on a CPU with AVX512_VNNI, or every linear K-quant rows with float32 ``x``; no q/k/v
    bias; the cache in ``x``'s dtype; nothing to differentiate. The per-layer ops are the decode
    library's (AVX-512) alone: the AVX2 build runs a step's layers as the stack."""
    return (stack_takes(x, keys, head_dim) and decode_linear_available()
            and layer_kind(layer, x.dtype) in (_PLAIN, _TILES, _KQUANT))


def stack_takes(x: torch.Tensor, keys: torch.Tensor, head_dim: int) -> bool:
    """``takes``' conditions on the rows and the cache, the same for every layer of a step: whether
    layers the native calls read (a ``stack_table`` of ``x``'s dtype) run a step on ``x``, with either
    build of the stack (``genfn.kernels.decode_stack_isa``)."""
    dtype = x.dtype
    if (x.dim() != 3 or dtype not in MAX_DECODE_ROWS or x.shape[0] * x.shape[1] > MAX_LAYER_ROWS
            or x.device.type != "cpu"):
        return False
    if keys.dtype != dtype or head_dim % 16 or head_dim > 128:
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    if dtype == torch.bfloat16 and not torch.compiler.is_compiling():
        # Eager bfloat16 rounds after every op (transformers' numbers); the native layer rounds
        # as the compiled step does, so it stands in for the compiled layer only.
        return False
    return portable_ops_available()


# A layer's kind, as decode_stack_table's layout numbers it. A mixed layer's linears are each tiles
# (a stack of parts in several tile kinds among them) or K-quant rows (a Q4_K_M file's Q5_0 matrices
# kept as tiles beside its K-quant rows): only the stack runs it, not the per-layer ops.
# A coded layer's linears are each a CodedBfloat16 (bfloat16 x): only the stack runs it.
_PLAIN, _TILES, _KQUANT, _MIXED, _CODED = 0, 1, 2, 3, 4


def layer_kind(layer: Mapping[str, Any], dtype: torch.dtype) -> int | None:
    """How ``layer``'s weights run natively against activations of ``dtype`` (``_PLAIN``, ``_TILES``,
    ``_KQUANT``), or None where they do not (``takes``)."""
    if "bqkv" in layer:
        return None
    # The weights that must be plain tensors of x's dtype: all six, or the norms of a quantized layer.
    if quantized(layer):
        if dtype != torch.float32 or not _tiles_native():
            return None
        kind, plain = _TILES, _NORMS
    elif kquantized(layer):
        if dtype != torch.float32:
            return None
        kind, plain = _KQUANT, _NORMS
    elif (all(_tile_parts(layer.get(n)) or _kquant_parts(layer.get(n)) for n in _LINEARS)
          and (all(_tile_parts(layer.get(n)) for n in _LINEARS) or kquant.kquant_available())):
        if dtype != torch.float32 or not _tiles_native():
            return None
        kind, plain = _MIXED, _NORMS
    elif all(isinstance(layer.get(n), CodedBfloat16) for n in _LINEARS):
        # vdpbf16ps, which the AVX2 build has no form of
        if dtype != torch.bfloat16 or not _BF16_DOT or decode_stack_isa() == "avx2":
            return None
        kind, plain = _CODED, _NORMS
    elif dtype not in MAX_DECODE_ROWS:
        return None
    else:
        # a lone QuantizedWeight (a mixed layer) is no Tensor: it runs op by op
        kind, plain = _PLAIN, _WEIGHTS
    for name in plain:
        weight = layer.get(name)
        if not isinstance(weight, torch.Tensor) or weight.dtype != dtype or not weight.is_cpu:
            return None
        if torch.is_grad_enabled() and weight.requires_grad:
            return None
    return kind


def _tiles_native() -> bool:
    """Whether tiles16 layers run natively: the decode library's VNNI kernels, or the AVX2 build's."""
    return _VNNI or decode_stack_isa() == "avx2"


def _ops():
    if not portable_ops_available():
        raise RuntimeError(f"genfn.kernels.decode_layer needs the native kernels, which are {kernel_status()}")
    return getattr(torch.ops, _OP_NAMESPACE)


def attention_input(x: torch.Tensor, layer: Mapping[str, Any], cos: torch.Tensor, sin: torch.Tensor, eps: float,
                    heads: int, kv_heads: int) -> torch.Tensor:
    """``qkv [B * S, (heads + 2 kv_heads) * D]`` for ``x [B, S, hidden]``: q and k rotated by
    ``cos, sin [B, S, D]``."""
    rows, cos, sin = x.reshape(-1, x.shape[-1]), cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
    wqkv = layer["wqkv"]
    if _kquant_parts(wqkv):
        return _ops().decode_attention_input_kquant(rows, layer["attn_norm"], *_kquant_args(wqkv), cos, sin, eps,
                                                    heads, kv_heads)
    if isinstance(wqkv, QuantizedWeight):
        return _ops().decode_attention_input_quant(rows, layer["attn_norm"], *_parts(wqkv), cos, sin, eps, heads,
                                                   kv_heads)
    return _ops().decode_attention_input(rows, layer["attn_norm"], wqkv, cos, sin, eps, heads, kv_heads)


def _parts(weight: QuantizedWeight) -> tuple:
    """A quantized weight as the ``_quant`` ops take it: codes, scales, minimums (or None), kind."""
    return weight.codes, weight.scales, weight.mins, weight.kind


def _kquant_args(weight) -> tuple[list, list]:
    """A K-quant linear as the ``_kquant`` ops take it: its parts' rows and their formats (the K-quant
    library loaded: the ops find its row kernels through it)."""
    kquant.kquant_available()
    parts = _kquant_parts(weight)
    return [p.data for p in parts], [FORMAT_ID[p.format] for p in parts]


def layer_output(x: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                 layer: Mapping[str, Any], eps: float) -> torch.Tensor:
    """The layer's new residual stream ``[B, S, hidden]``: each of ``q [B * S, H, D]`` attends its
    row's ``keys``/``values [B, Hkv, A, D]`` where its line of ``mask [B, 1, S, A]`` is set, then the
    output projection, the MLP and both residual adds."""
    hidden = x.shape[-1]
    rows, visible, scale = x.reshape(-1, hidden), mask.reshape(-1, mask.shape[-1]), q.shape[-1] ** -0.5
    if _kquant_parts(layer["wo"]):
        out = _ops().decode_layer_output_kquant(
            rows, q, keys, values, visible, *_kquant_args(layer["wo"]), layer["mlp_norm"],
            *_kquant_args(layer["w_gate_up"]), *_kquant_args(layer["w_down"]), eps, scale)
    elif isinstance(layer["wo"], QuantizedWeight):
        out = _ops().decode_layer_output_quant(
            rows, q, keys, values, visible, *_parts(layer["wo"]), layer["mlp_norm"], *_parts(layer["w_gate_up"]),
            *_parts(layer["w_down"]), eps, scale)
    else:
        out = _ops().decode_layer_output(rows, q, keys, values, visible, layer["wo"], layer["mlp_norm"],
                                         layer["w_gate_up"], layer["w_down"], eps, scale)
    return out.view(x.shape)


def mlp_input(x1: torch.Tensor, layer: Mapping[str, Any], eps: float) -> torch.Tensor:
    """``act [B * S, F] = silu(g) * u`` for ``g, u = rms_norm(x1) @ w_gate_up.T`` (``x1 [B, S, hidden]``, a
    block-quantized layer): ``layer_output``'s own code between the attention's residual and the
    down projection, so a tensor-parallel rank's values are one process's bit for bit."""
    w = layer["w_gate_up"]
    return _ops().decode_mlp_input_quant(x1.reshape(-1, x1.shape[-1]), layer["mlp_norm"], *_parts(w),
                                         w.out_features, eps)


def stack_table(layers, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor | None:
    """The weights of ``layers`` as ``run_stack`` reads them for activations of ``dtype``: one uint8 tensor
    (``decode_stack.cpp``'s table) holding each layer's kind and its weights' pointers, checked here
    once, and references that keep the weights alive. None where a layer does not run natively
    (``layer_kind``), where a weight asks for gradients, for heads the native attention does not
    take (``stack_takes``' head_dim), or without the native kernels. The table
    reads the weights as they are now: weights replaced later (not changed in place) need a new
    table, as a compiled step closes over the weights it was traced with."""
    if head_dim % 16 or head_dim > 128 or heads % kv_heads or not portable_ops_available():
        return None
    weights, layout = [], []
    for layer in layers:
        kind = layer_kind(layer, dtype)
        if kind is None or any(isinstance(w, torch.Tensor) and w.requires_grad for w in layer.values()):
            return None
        layout.append(kind)
        weights += (layer["attn_norm"], layer["mlp_norm"])
        if kind not in (_PLAIN, _CODED):
            layout.append(layer["w_down"].shape[1])  # the MLP's width
        for name in _LINEARS:
            weight = layer[name]
            if kind == _PLAIN:
                weights.append(weight)
                continue
            if kind == _CODED:
                weights += weight.tensors()
                continue
            tiles = _tile_parts(weight)
            if kind == _MIXED:
                layout.append(_TILES if tiles else _KQUANT)
            if tiles:
                layout.append(len(tiles))
                for part in tiles:
                    layout += (part.kind, part.out_features)
                for part in tiles:
                    weights += (part.codes, part.scales, part.mins)
            else:
                parts = _kquant_parts(weight)
                layout += (len(parts), *(FORMAT_ID[p.format] for p in parts))
                weights += (p.data for p in parts)
    if not layout:
        return None
    hidden = layers[0]["attn_norm"].shape[0]
    return _ops().decode_stack_table(weights, layout, dtype, hidden, heads, kv_heads, head_dim)


def run_stack(x: torch.Tensor, table: torch.Tensor, layers: int, cos: torch.Tensor, sin: torch.Tensor,
              keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
              eps: float) -> torch.Tensor:
    """The residual stream ``[B, S, hidden]`` after the first ``layers`` layers of ``table`` (``stack_table``
    of ``x``'s dtype), in one native call (``decode_stack.cpp``; eager or inside a compiled step): each
    layer's ``attention_input``, its keys and values written into ``keys``/``values [L, B, Hkv, T, D]``
    at ``slots [B, S]`` in place, then its ``layer_output`` over the slots ``mask [B, 1, S, A]`` shows.
    The same numbers as those ops layer by layer."""
    out = _ops().decode_stack(x.reshape(-1, x.shape[-1]), table, layers, cos.reshape(-1, cos.shape[-1]),
                              sin.reshape(-1, sin.shape[-1]), keys, values, slots, mask.reshape(-1, mask.shape[-1]),
                              eps, cos.shape[-1] ** -0.5)
    return out.view(x.shape)


def run_paged_stack(x: torch.Tensor, table: torch.Tensor, layers: int, cos: torch.Tensor, sin: torch.Tensor,
                    keys: torch.Tensor, values: torch.Tensor, inputs, eps: float,
                    sliding_window: int | None) -> torch.Tensor:
    """``run_stack`` over the paged cache ``keys``/``values [L, blocks, Hkv, block_size, D]`` (written in
    place) for the packed tokens ``x [T, hidden]`` of ``inputs`` (``genfn.batching.inputs.BatchInputs``):
    token ``t`` writes at ``inputs.slot_mapping[t]`` and attends positions ``0 .. inputs.positions[t]``
    of its request's block table (the last ``sliding_window`` of them), in position order, with the
    static cache's arithmetic: a decode token gets the bits a ``generate`` step gives it over the same
    keys."""
    return _ops().decode_stack_paged(x, table, layers, cos, sin, keys, values, inputs.slot_mapping,
                                     inputs.block_tables, inputs.request_index, inputs.positions, eps,
                                     cos.shape[-1] ** -0.5, sliding_window or 0)
