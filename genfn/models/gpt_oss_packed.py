"""GPT-OSS over a packed batch: ``apply_packed(spec, params, inputs, cache)``.

The Llama family's packed forward (``genfn.models.packed``) with GPT-OSS's layer
(``genfn.models.gpt_oss``): the same token axis, cache writes and sampled rows. A sliding-window
layer masks each token's keys by its own position in its request, a full layer sees the whole
request (two attention routes per forward, as Gemma's). The attention sinks join each softmax,
which the plan's SDPA and native paged kernels do not compute: GPT-OSS attends through the
reference paths (the whole cache under a mask, or each query's gathered blocks), exact but
slower than the plan's kernels on long contexts.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from genfn.cache.paged import PackedPlan, PagedKVCache, write
from genfn.kernels.invariant import refuse_without_invariant_forward
from genfn.models import tensor_parallel
from genfn.models.gpt_oss import GptOssSpec, attention_scale, final_logits, finish_layer, project_qkv
from genfn.models.packed import attend, check_plan, packed_attention, paged_cache_for, refuse_other_family
from genfn.models.packed import rotate_heads, sampled_logits, unpacked_params
from genfn.models.rope import rope_cos_sin

__all__ = ["apply_packed", "init_packed_cache", "pack_params"]


def _check_spec(spec) -> None:
    refuse_other_family(spec, GptOssSpec, "genfn.models.gpt_oss_packed", "GPT-OSS")


def init_packed_cache(spec: GptOssSpec, num_blocks: int, block_size: int, dtype=torch.float32,
                      device=None) -> PagedKVCache:
    """A paged cache shaped for ``spec`` (``num_blocks`` allocator blocks plus the sink)."""
    _check_spec(spec)
    return paged_cache_for(spec, num_blocks, block_size, dtype, device)


pack_params = unpacked_params


def apply_packed(spec: GptOssSpec, params: Mapping[str, Any], inputs, cache: PagedKVCache,
                 plan: PackedPlan | None = None) -> tuple[torch.Tensor, PagedKVCache]:
    """As ``genfn.models.packed.apply_packed`` (same arguments and results), for GPT-OSS."""
    refuse_without_invariant_forward("GPT-OSS")
    _check_spec(spec)
    num_tokens = inputs.input_ids.shape[0]
    check_plan(plan, num_tokens)
    x = tensor_parallel.embedding(spec, inputs.input_ids, params["embed"], params["norm"].dtype)  # [T, hidden]
    cos, sin = rope_cos_sin(params["inv_freq"], inputs.positions, x.dtype, spec.rope_attention_factor)
    windows = {False: None, True: spec.sliding_window}
    routes = {sliding: packed_attention(inputs, cache, None, windows[sliding])  # sinks: no plan
              for sliding in set(spec.sliding_layers)}
    scale = attention_scale(spec)
    for i, layer in enumerate(params["layers"]):
        q, k, v = project_qkv(spec, layer, x)
        q, k = rotate_heads(q, cos, sin), rotate_heads(k, cos, sin)
        cache = write(cache, i, inputs.slot_mapping, k, v)
        attn = attend(q, cache, i, routes[spec.sliding_layers[i]], scale, sinks=layer["sinks"])
        x = finish_layer(spec, layer, x, attn.reshape(num_tokens, spec.num_heads * spec.head_dim))
    logits = sampled_logits(inputs, plan, spec.vocab_size, x.device,
                            lambda index: final_logits(spec, params, x.index_select(0, index)))
    return logits, cache
