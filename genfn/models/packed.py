"""The Llama family over a packed batch: ``apply_packed(spec, params, inputs, cache)``.

Continuous batching runs the tokens of many requests in one forward: prefill chunks and decode
tokens one after the other on a single ``[T]`` token axis (``genfn.batching.inputs.BatchInputs``).
Every per-token operation (embedding, norms, projections, MLP) is the dense model's on a batch of
one sequence of ``T`` tokens; only three things depend on which request a token belongs to, and
each reads its index tensor: RoPE rotates at each token's own position, the keys/values go to the
token's slot of the paged cache (``paged.write``), and attention reads only the token's own
request (``paged.paged_attention`` through its block-table row, or, for a cache of a few
tables' size, the whole cache under a mask built once per forward from the block tables). Logits are computed only at each
entry of ``logits_index`` (``[R + E, V]``: one per row, then a speculative row's drafted positions),
not for all ``T`` tokens.

Shapes are static (``T``, ``R``, ``W`` are the padded sizes ``build_batch_inputs`` was asked for),
so one compiled function serves every batch of a padded shape. Pure but for the cache, which is
donated and written in place, as everywhere in genfn.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from genfn.cache.paged import NATIVE_PREFILL_TOKENS, PackedPlan, PagedKVCache, init_paged_cache, paged_attention
from genfn.cache.paged import plan_attention
from genfn.cache.paged import PlannedAttention, planned_attention, sink_softmax, soft_capped, write
from genfn.kernels import MIN_PREFILL_QUERIES, decode_layer, invariant, portable_ops_available
from genfn.kernels import linear as plain_linear
from genfn.kernels.packed_gemm import PackedWeight, pack_linear_weights, packed_linear as linear
from genfn.models import tensor_parallel
from genfn.models.invariant_layers import check_invariant_spec, invariant_layers, invariant_logits
from genfn.models.llama import LlamaSpec, _rms_norm, projection_norms, stack_table_of
from genfn.models.moe import moe_mlp
from genfn.models.rope import rope_cos_sin

__all__ = ["PackedAttention", "apply_packed", "attend", "furthest_positions", "init_packed_cache", "pack_params",
           "packed_attention", "paged_cache_for", "refuse_other_family", "rotate_heads", "sampled_logits",
           "unpacked_params"]


def init_packed_cache(spec: LlamaSpec, num_blocks: int, block_size: int, dtype=torch.float32,
                      device=None) -> PagedKVCache:
    """A paged cache shaped for ``spec`` (``num_blocks`` allocator blocks plus the sink)."""
    check_packed_spec(spec)
    return paged_cache_for(spec, num_blocks, block_size, dtype, device)


def paged_cache_for(spec, num_blocks: int, block_size: int, dtype=torch.float32, device=None) -> PagedKVCache:
    """The paged cache of any decoder family's packed forward: its layers, kv heads and head size
    from ``spec`` (``num_blocks`` allocator blocks plus the sink)."""
    return init_paged_cache(spec.num_layers, num_blocks, spec.num_kv_heads, block_size, spec.head_dim,
                            dtype=dtype, device=device)


def unpacked_params(params: Mapping[str, Any]) -> Mapping[str, Any]:
    """``pack_params`` of a family whose packed layer runs on ``genfn.kernels.linear``, as its
    ``generate`` does: the weights as they are."""
    return params


def pack_params(params: Mapping[str, Any]) -> Mapping[str, Any]:
    """The eager forward's weights: the linears packed once for oneDNN's GEMM (many rows times each
    weight; ``genfn.kernels.packed_gemm``); the native stack's table (``step_params``) stays as it is.
    The compiled graph takes the plain tensors."""
    return pack_linear_weights(params, ("lm_head",), ("wqkv", "wo", "w_gate_up", "w_down"))


def rotate_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [T, H, D]`` with ``cos, sin [T, R]``: transformers' rotate-half form (on the first
    ``R`` dimensions only when ``R < D``: partial rotary)."""
    if cos.shape[-1] != x.shape[-1]:
        rotary = cos.shape[-1]
        return torch.cat((rotate_heads(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class _TorchLayerOps:
    """The elementwise steps between a packed layer's linears, as torch ops: what ``torch.compile``
    traces and fuses, and the eager path for any dtype or device."""

    @staticmethod
    def rms_norm(x, weight, eps):
        return _rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm(x, delta, weight, eps):
        x = x + delta
        return x, _rms_norm(x, weight, eps)

    @staticmethod
    def rope_qkv(qkv, cos, sin, spec):
        num_tokens, head_dim = qkv.shape[0], spec.head_dim
        q_size, kv_size = spec.num_heads * head_dim, spec.num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return (rotate_heads(q.reshape(num_tokens, spec.num_heads, head_dim), cos, sin),
                rotate_heads(k.reshape(num_tokens, spec.num_kv_heads, head_dim), cos, sin),
                v.reshape(num_tokens, spec.num_kv_heads, head_dim))

    @staticmethod
    def silu_mul(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class _NativeLayerOps:
    """The same steps as one native call each (``genfn/kernels/token_ops.cpp``): the eager forward
    ran them as ~250 small torch calls a step, ~15 ms of an 85 ms 32-token bfloat16 step."""

    @staticmethod
    def rms_norm(x, weight, eps):
        return torch.ops.genfn_kernels.rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm(x, delta, weight, eps):
        return torch.ops.genfn_kernels.add_rms_norm(x, delta, weight, eps)

    @staticmethod
    def rope_qkv(qkv, cos, sin, spec):
        return torch.ops.genfn_kernels.rope_qkv(qkv, cos, sin, spec.num_heads, spec.num_kv_heads)

    @staticmethod
    def silu_mul(gate_up):
        return torch.ops.genfn_kernels.silu_mul(gate_up)


def _variant_qkv(spec: LlamaSpec, layer: Mapping[str, Any], i: int, qkv: torch.Tensor, cos, sin):
    """``rope_qkv`` for the Llama variants (``genfn.models.llama_variants``): q/k norms, layers
    without RoPE, partial rotary; as ``llama._decoder_layer`` computes them."""
    num_tokens, head_dim = qkv.shape[0], spec.head_dim
    q_size, kv_size = spec.num_heads * head_dim, spec.num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    if spec.qk_norm == "projection":
        q, k = projection_norms(spec, layer, q, k)
    q = q.reshape(num_tokens, spec.num_heads, head_dim)
    k = k.reshape(num_tokens, spec.num_kv_heads, head_dim)
    if spec.qk_norm == "head":
        q, k = _rms_norm(q, layer["q_norm"], spec.rms_norm_eps), _rms_norm(k, layer["k_norm"], spec.rms_norm_eps)
    if spec.rope_layers is None or spec.rope_layers[i]:
        q, k = rotate_heads(q, cos, sin), rotate_heads(k, cos, sin)
    return q, k, v.reshape(num_tokens, spec.num_kv_heads, head_dim)


def check_packed_spec(spec: LlamaSpec) -> None:
    """Refuse a spec of another family (Gemma's is ``genfn.models.gemma_packed``)."""
    refuse_other_family(spec, LlamaSpec, "genfn.models.packed", "the Llama family")


def refuse_other_family(spec, spec_type: type, module: str, family: str) -> None:
    """A ValueError unless ``spec`` is a ``spec_type``: ``module``'s packed forward runs ``family`` only."""
    if not isinstance(spec, spec_type):
        raise ValueError(f"{module} runs {family}, not {spec.architecture}: "
                         "see genfn.models.registry.PACKED_FORWARDS")


def furthest_positions(inputs) -> torch.Tensor:
    """``[T]``: for each token, the furthest position of the forward ``generate`` computes it in
    when it runs the token's request alone: the prompt's last position for a prompt token (one
    prefill forward), the token's own for a generated one (one decode step each). LongRoPE picks
    its factors by it, per request, so a request's tokens never depend on the rest of the batch,
    on how its prompt was chunked, or on a recompute after preemption."""
    prompt_last = inputs.prompt_lens.index_select(0, inputs.request_index) - 1
    return torch.maximum(prompt_last, inputs.positions)


def _native_layer_ops(x: torch.Tensor, norm: torch.Tensor) -> bool:
    """Whether the eager forward's elementwise steps can run natively on activations like ``x``
    (norm weights like ``norm``)."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and norm.dtype == x.dtype
            and not (torch.is_grad_enabled() and x.requires_grad) and portable_ops_available())


# Attention reads the whole cache (masked) instead of gathering each query's blocks when the
# cache holds at most this many times the slots one query's gather would copy: a prefill chunk
# of T tokens of one request otherwise copies that request's keys T times.
WHOLE_CACHE_FACTOR = 16


def _slot_visibility(inputs, num_slots: int, block_size: int, sliding_window: int | None) -> torch.Tensor:
    """``[T, num_slots]`` bool: which cache slots token ``t`` attends (its own request's keys at
    positions ``0 .. positions[t]``), from the block tables."""
    rows, width = inputs.block_tables.shape
    offsets = torch.arange(block_size, device=inputs.block_tables.device)
    slots = (inputs.block_tables.unsqueeze(-1) * block_size + offsets).reshape(rows, width * block_size)
    logical = torch.arange(width * block_size, device=slots.device).expand(rows, -1)
    # Table entries past a row's length (the sink block, repeated) land on positions no query of
    # that row reaches, so whichever duplicate wins the scatter stays invisible.
    slot_pos = torch.full((rows, num_slots), -1, dtype=torch.int64, device=slots.device)
    slot_pos = slot_pos.scatter(1, slots, logical)
    token_pos = slot_pos.index_select(0, inputs.request_index)  # [T, num_slots]
    query_pos = inputs.positions.unsqueeze(1)
    visible = (token_pos >= 0) & (token_pos <= query_pos)
    if sliding_window is not None:
        visible = visible & (token_pos > query_pos - sliding_window)
    # Every query sees at least the slot its own key was written to (padding: the sink's first
    # slot), so no row of scores is all -inf: a NaN there would reach the sink's values, and a
    # zero weight times NaN poisons every later query.
    sink_slot = num_slots - block_size
    own = torch.where(inputs.slot_mapping < 0, torch.full_like(inputs.slot_mapping, sink_slot), inputs.slot_mapping)
    return visible | (torch.arange(num_slots, device=own.device).unsqueeze(0) == own.unsqueeze(1))


def _attend_whole_cache(q: torch.Tensor, cache: PagedKVCache, layer: int, visible: torch.Tensor,
                        scale: float | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``q [T, H, D]`` against every slot of the layer's cache, masked by ``visible [T, S]``;
    float32 (float64 for float64) accumulation, as ``paged_attention`` (``scale``, ``softcap``,
    ``sinks`` as there)."""
    num_tokens, num_heads, head_dim = q.shape
    keys, values = cache.keys[layer], cache.values[layer]  # [NB + 1, Hkv, bs, D]
    kv_heads = keys.shape[1]
    compute = torch.promote_types(q.dtype, torch.float32)
    k = keys.transpose(0, 1).reshape(kv_heads, -1, head_dim).to(compute)
    # Every query reads every slot, its weight 0 where masked; but 0 * NaN is NaN, so one request's
    # non-finite values (or a freed block's stale ones) would reach every row of the batch.
    v = torch.nan_to_num(values.transpose(0, 1).reshape(kv_heads, -1, head_dim).to(compute), 0.0, 0.0, 0.0)
    groups = num_heads // kv_heads
    qg = q.reshape(num_tokens, kv_heads, groups, head_dim).to(compute)
    scale = head_dim ** -0.5 if scale is None else scale
    scores = soft_capped(torch.einsum("thgd,hsd->thgs", qg, k) * scale, softcap)
    scores = scores.masked_fill(~visible.view(num_tokens, 1, 1, -1), float("-inf"))
    weights = sink_softmax(scores, None if sinks is None else sinks.view(1, kv_heads, groups, 1))
    out = torch.einsum("thgs,hsd->thgd", weights, v)
    return out.reshape(num_tokens, num_heads, head_dim).to(q.dtype)


@dataclasses.dataclass(frozen=True)
class PackedAttention:
    """How every layer of one forward attends under one window, built once per forward: through
    the plan's blocks (``planned``), the whole cache under a mask (``visible``), or, with
    neither, each query's gathered blocks (``paged_attention``)."""

    inputs: Any
    sliding_window: int | None
    planned: PlannedAttention | None = None
    visible: torch.Tensor | None = None


def packed_attention(inputs, cache: PagedKVCache, plan: PackedPlan | None, sliding_window: int | None,
                     native_chunk_tokens: int = NATIVE_PREFILL_TOKENS,
                     whole_prompt_tokens: int | None = None) -> PackedAttention:
    """The ``PackedAttention`` of ``inputs`` (``native_chunk_tokens``, ``whole_prompt_tokens``:
    ``plan_attention``'s)."""
    num_slots = cache.keys.shape[1] * cache.block_size
    gathered = inputs.block_tables.shape[1] * cache.block_size
    if plan is not None:
        planned = plan_attention(plan, inputs.block_tables, inputs.positions, cache.block_size, sliding_window,
                                 native_chunk_tokens=native_chunk_tokens, whole_prompt_tokens=whole_prompt_tokens)
        return PackedAttention(inputs, sliding_window, planned=planned)
    if num_slots <= WHOLE_CACHE_FACTOR * gathered:  # static: shapes only
        return PackedAttention(inputs, sliding_window,
                               visible=_slot_visibility(inputs, num_slots, cache.block_size, sliding_window))
    return PackedAttention(inputs, sliding_window)


def attend(q: torch.Tensor, cache: PagedKVCache, layer: int, route: PackedAttention, scale: float | None = None,
           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``q [T, H, D]`` of the packed tokens against their own requests' cached keys of ``layer``
    (``sinks [H]``: GPT-OSS's attention sinks, ``genfn.cache.paged.sink_softmax``)."""
    if route.planned is not None:
        if sinks is not None:
            raise ValueError("planned attention cannot add sinks: build the route without a plan")
        return planned_attention(q, cache, layer, route.planned, scale, softcap)
    if route.visible is not None:
        return _attend_whole_cache(q, cache, layer, route.visible, scale, softcap, sinks)
    inputs = route.inputs
    return paged_attention(q, cache, layer, inputs.block_tables, inputs.request_index, inputs.positions,
                           scale=scale, sliding_window=route.sliding_window, softcap=softcap, sinks=sinks)


def check_plan(plan: PackedPlan | None, num_tokens: int) -> None:
    if plan is not None and plan.num_tokens != num_tokens:
        raise ValueError(f"the plan is for {plan.num_tokens} tokens, the batch has {num_tokens}")


def sampled_logits(inputs, plan: PackedPlan | None, vocab_size: int, device,
                   logits_of: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``[R, V]`` float32: ``logits_of(token_index)`` at each row's ``logits_index``; with a plan, at
    its ``sample_rows`` only (the other rows get zeros). The final norm and head are per token, so
    taking the rows first computes the same values."""
    num_rows = inputs.logits_index.shape[0]
    if plan is None or len(plan.sample_rows) == num_rows:  # a decode step: no zero rows to fill
        return logits_of(inputs.logits_index)
    logits = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
    if not plan.sample_rows:
        return logits
    rows = torch.tensor(plan.sample_rows, dtype=torch.int64, device=device)
    return logits.index_copy_(0, rows, logits_of(inputs.logits_index.index_select(0, rows)))


def apply_packed(spec: LlamaSpec, params: Mapping[str, Any], inputs, cache: PagedKVCache,
                 plan: PackedPlan | None = None) -> tuple[torch.Tensor, PagedKVCache]:
    """Run the packed tokens of ``inputs`` against the paged ``cache`` (donated).

    Returns ``(logits [R, V] float32, cache)``: row ``r``'s logits are those of its chunk's last
    token (padding rows get the logits of token 0, to be ignored). With a ``plan`` (the eager
    path), attention reads only the blocks each row occupies (``planned_attention``) and only
    ``plan.sample_rows`` get logits (the other rows get zeros).
    """
    check_packed_spec(spec)
    num_tokens = inputs.input_ids.shape[0]
    x = tensor_parallel.embedding(spec, inputs.input_ids, params["embed"], params["norm"].dtype)  # [T, hidden]
    long_inv_freq = params.get("long_inv_freq")
    cos, sin = rope_cos_sin(params["inv_freq"], inputs.positions, x.dtype, spec.rope_attention_factor, long_inv_freq,
                            spec.original_context, None if long_inv_freq is None else furthest_positions(inputs))
    if invariant.batch_invariant():
        return _invariant_packed(spec, params, inputs, cache, plan, x, cos, sin)
    check_plan(plan, num_tokens)
    table = _paged_stack(spec, params, x, cache, plan)
    if table is not None:
        x = decode_layer.run_paged_stack(x, table, len(params["layers"]), cos, sin, cache.keys, cache.values, inputs,
                                         spec.rms_norm_eps, spec.sliding_window)
        mlp_out, cache = None, cache.replace()
    else:
        native = plan is not None and spec.is_plain_llama and _native_layer_ops(x, params["norm"])
        x, mlp_out, cache = _packed_layers(spec, params["layers"], inputs, cache, plan, x, cos, sin,
                                           _NativeLayerOps if native else _TorchLayerOps)

    def logits_of(index):
        # generate's final norm and head (llama.apply) on the rows: a token's logits are its generate
        # forward's wherever its hidden state is
        rows = x.index_select(0, index)
        if mlp_out is not None:
            rows = rows + mlp_out.index_select(0, index)
        h = _rms_norm(rows, params["norm"], spec.rms_norm_eps)
        return tensor_parallel.gathered_logits(spec, plain_linear(h, _plain(params["lm_head"])).to(torch.float32))

    return sampled_logits(inputs, plan, spec.vocab_size, x.device, logits_of), cache


def _paged_stack(spec: LlamaSpec, params: Mapping[str, Any], x: torch.Tensor, cache: PagedKVCache,
                 plan: PackedPlan | None) -> torch.Tensor | None:
    """The table of the packed tokens' whole stack of layers as one native call (``decode_layer.run_paged_stack``)
    where ``generate``'s step would take the native stack: Llama's own layers, at most
    ``decode_layer.MAX_LAYER_ROWS`` tokens (a decode step of a few requests, drafts, a short prompt),
    one process. Not a piece of a prompt that generate's prefill runs through the prefill kernel:
    the stack walks each query's keys. The eager forward's GEMM copies (``PackedWeight``) are read
    as their plain weights: the params' own table (``llama.step_params``), or one built here. None
    where the stack does not run."""
    if not spec.is_plain_llama or spec.tensor_shard is not None or x.shape[0] > decode_layer.MAX_LAYER_ROWS:
        return None
    if plan is not None and plan.rows_of_prompts_from(MIN_PREFILL_QUERIES):
        return None
    if not cache.keys.is_contiguous():
        return None
    if not decode_layer.stack_takes(x.unsqueeze(0), cache.keys, spec.head_dim):
        return None
    return stack_table_of(spec, params, x.dtype,
                          lambda: [{name: _plain(w) for name, w in layer.items()} for layer in params["layers"]])


def _plain(weight):
    """A weight as ``generate`` reads it: a ``PackedWeight`` (the eager GEMM's copy) by its plain tensor."""
    return weight.weight if isinstance(weight, PackedWeight) else weight


def _packed_layers(spec: LlamaSpec, layers, inputs, cache: PagedKVCache, plan: PackedPlan | None, x: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor | None, PagedKVCache]:
    """``apply_packed``'s layers one op at a time (any number of tokens, every Llama variant, tensor
    parallelism): ``(x, mlp_out, cache)``, the last layer's MLP output not yet added to ``x``."""
    num_tokens, q_size = x.shape[0], spec.num_heads * spec.head_dim
    # A prompt that generate's prefill would run through the native prefill kernel (its whole
    # prompt in one forward) runs through it here too, every chunk of it gathered, so that its keys,
    # values and logits are generate's to the bit however the prompt is cut.
    route = packed_attention(inputs, cache, plan, spec.sliding_window, native_chunk_tokens=MIN_PREFILL_QUERIES - 1,
                             whole_prompt_tokens=MIN_PREFILL_QUERIES)
    plain = spec.is_plain_llama
    mlp_out = None  # the previous layer's MLP output, added to x in the next norm's call
    for i, layer in enumerate(layers):
        if not plain:
            x = x if mlp_out is None else x + mlp_out
            h = x if spec.post_norms else _rms_norm(x, layer["attn_norm"], spec.rms_norm_eps)
            q, k, v = _variant_qkv(spec, layer, i, linear(h, layer["wqkv"], layer.get("bqkv")), cos, sin)
        elif mlp_out is None:
            h = ops.rms_norm(x, layer["attn_norm"], spec.rms_norm_eps)
            q, k, v = ops.rope_qkv(linear(h, layer["wqkv"], layer.get("bqkv")), cos, sin, spec)
        else:
            x, h = ops.add_rms_norm(x, mlp_out, layer["attn_norm"], spec.rms_norm_eps)
            q, k, v = ops.rope_qkv(linear(h, layer["wqkv"], layer.get("bqkv")), cos, sin, spec)
        cache = write(cache, i, inputs.slot_mapping, k, v)
        attn = attend(q, cache, i, route)
        attn_out = tensor_parallel.row_parallel(spec, attn.reshape(num_tokens, q_size), layer["wo"], linear)
        if spec.post_norms:  # OLMo 2: the norms sit on the outputs
            x = h = x + _rms_norm(attn_out, layer["post_attn_norm"], spec.rms_norm_eps)
        else:
            x, h = ops.add_rms_norm(x, attn_out, layer["mlp_norm"], spec.rms_norm_eps)
        if spec.num_experts:
            mlp_out = moe_mlp(spec, layer, h)
        else:
            mlp_out = tensor_parallel.row_parallel(spec, ops.silu_mul(linear(h, layer["w_gate_up"])), layer["w_down"],
                                                   linear)
        if spec.post_norms:
            mlp_out = _rms_norm(mlp_out, layer["post_mlp_norm"], spec.rms_norm_eps)
    return x, mlp_out, cache


def _invariant_packed(spec: LlamaSpec, params: Mapping[str, Any], inputs, cache: PagedKVCache,
                      plan: PackedPlan | None, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``apply_packed`` in the batch-invariant mode: ``genfn.models.invariant_layers`` (what
    ``generate`` runs in the mode) with each query attending its own request's paged keys on its
    own (``genfn.kernels.invariant.paged_attention``); logits as ``sampled_logits`` picks them."""
    check_invariant_spec(spec)

    def attend(i, q, k, v):
        nonlocal cache
        cache = write(cache, i, inputs.slot_mapping, k, v)
        return invariant.paged_attention(q, cache.keys[i], cache.values[i], inputs.block_tables,
                                         inputs.request_index, inputs.positions, spec.sliding_window)

    rows, mlp_out = invariant_layers(spec, params["layers"], x, cos, sin, attend)

    def logits_of(index):
        return invariant_logits(spec, params, rows.index_select(0, index), mlp_out.index_select(0, index))

    return sampled_logits(inputs, plan, spec.vocab_size, x.device, logits_of), cache
