"""Gemma 2 / Gemma 3 over a packed batch: ``apply_packed(spec, params, inputs, cache)``.

The Llama family's packed forward (``genfn.models.packed``) with Gemma's layer
(``genfn.models.gemma``): the same token axis, cache writes, attention routes and sampled rows;
Gemma's embedding scale, norms, GeGLU MLP and final soft-capping from its own module. Two things
differ per layer: a sliding-window layer masks each token's keys by its own position in its
request (the window counted in the paged cache, as ``generate`` counts it) and rotates by the
local RoPE base, a global layer sees the whole request under the global base; and the scores are
scaled by ``query_pre_attn_scalar ** -0.5`` and, for Gemma 2, soft-capped: the native paged op
caps them itself (``decode_attention.cpp``), the plan's gathered rows and chunks cap them in float32
instead of running SDPA (``genfn.cache.paged.planned_attention``).
Under tensor parallelism the shared pieces (``embed``, ``finish_layer``, ``final_logits``) hold
the collectives, so this forward runs a rank's shard unchanged.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from genfn.cache.paged import PackedPlan, PagedKVCache, write
from genfn.models.gemma import GemmaSpec, attention_scale, embed, final_logits, finish_layer, project_qkv
from genfn.models.packed import attend, check_plan, packed_attention, paged_cache_for, refuse_other_family
from genfn.models.packed import rotate_heads, sampled_logits, unpacked_params
from genfn.kernels import invariant
from genfn.models import gemma_invariant
from genfn.models.rope import rope_cos_sin

__all__ = ["apply_packed", "init_packed_cache", "pack_params"]


def _check_spec(spec) -> None:
    refuse_other_family(spec, GemmaSpec, "genfn.models.gemma_packed", "Gemma 2 / Gemma 3")


def init_packed_cache(spec: GemmaSpec, num_blocks: int, block_size: int, dtype=torch.float32,
                      device=None) -> PagedKVCache:
    """A paged cache shaped for ``spec`` (``num_blocks`` allocator blocks plus the sink)."""
    _check_spec(spec)
    return paged_cache_for(spec, num_blocks, block_size, dtype, device)


pack_params = unpacked_params


def apply_packed(spec: GemmaSpec, params: Mapping[str, Any], inputs, cache: PagedKVCache,
                 plan: PackedPlan | None = None) -> tuple[torch.Tensor, PagedKVCache]:
    """As ``genfn.models.packed.apply_packed`` (same arguments and results), for Gemma 2 / Gemma 3
    (in the batch-invariant mode: ``genfn.models.gemma_invariant``)."""
    _check_spec(spec)
    num_tokens = inputs.input_ids.shape[0]
    check_plan(plan, num_tokens)
    x = embed(spec, params, inputs.input_ids)  # [T, hidden]
    rope = {False: rope_cos_sin(params["inv_freq"], inputs.positions, x.dtype),
            True: rope_cos_sin(params["local_inv_freq"], inputs.positions, x.dtype)}
    if invariant.batch_invariant():
        return gemma_invariant.forward_packed(spec, params, inputs, cache, x, rope, lambda logits_of: sampled_logits(
            inputs, plan, spec.vocab_size, x.device, logits_of))
    softcap = spec.attn_logit_softcapping
    windows = {False: None, True: spec.sliding_window}
    routes = {sliding: packed_attention(inputs, cache, plan, windows[sliding])
              for sliding in set(spec.sliding_layers)}
    scale = attention_scale(spec)
    for i, layer in enumerate(params["layers"]):
        sliding = spec.sliding_layers[i]
        cos, sin = rope[sliding]
        q, k, v = project_qkv(spec, layer, x)
        q, k = rotate_heads(q, cos, sin), rotate_heads(k, cos, sin)
        cache = write(cache, i, inputs.slot_mapping, k, v)
        attn = attend(q, cache, i, routes[sliding], scale, softcap)
        x = finish_layer(spec, layer, x, attn.reshape(num_tokens, spec.num_heads * spec.head_dim))
    logits = sampled_logits(inputs, plan, spec.vocab_size, x.device,
                            lambda index: final_logits(spec, params, x.index_select(0, index)))
    return logits, cache
