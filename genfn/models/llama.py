"""The Llama family as pure functions: ``apply(spec, params, tokens, positions, cache)``.

Covers transformers' ``LlamaForCausalLM``, ``MistralForCausalLM`` and ``Qwen2ForCausalLM``:
grouped-query attention, rotary embeddings, RMSNorm, SwiGLU, optional q/k/v bias (Qwen2),
optional sliding window (Mistral), tied or untied embeddings; and, through the spec's variant
fields (``genfn.models.llama_variants``), Qwen3, SmolLM3, OLMo 2 and Phi-3/Phi-4-mini.

Parameters are a plain dict pytree. The q/k/v projections are stored fused as one ``wqkv``
matrix and gate/up as one ``w_gate_up``: one weight stream per block instead of three or two,
which is what decoding at batch 1 is bound by. Fusing concatenates rows, so every output element
is still the same dot product as transformers' separate projections.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from genfn.cache.base import begin_forward, real_tokens_back
from genfn.cache.dynamic import DynamicCache
from genfn.cache.static import StaticCache, init_static_cache
from genfn.kernels import decode_attention, decode_layer, invariant, linear, prefill_attention
from genfn.models import llama_variants as variants
from genfn.models import prefill_layer
from genfn.models import tensor_parallel
from genfn.models.decoder_config import check_head_groups, decoder_sizes
from genfn.models.invariant_layers import check_invariant_spec, invariant_layers, invariant_logits, long_rope_furthest
from genfn.models.loaders.checks import check_tensors
from genfn.models.moe import moe_mlp
from genfn.models.rope import SUPPORTED_ROPE_TYPES, apply_rope, inverse_frequencies, long_inverse_frequencies
from genfn.models.rope import rope_cos_sin
from genfn.quant.fuse import cat_rows

__all__ = ["LlamaSpec", "SUPPORTED_ARCHITECTURES", "spec_from_config", "params_from_state_dict", "apply",
           "init_cache", "ModelOutput", "mtp_head", "attention_mask", "projection_norms", "first_layers",
           "step_params", "stack_table_of", "STACK_TABLE"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           *variants.VARIANT_MODEL_TYPES.values())
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                **variants.VARIANT_MODEL_TYPES}


@dataclasses.dataclass(frozen=True)
class LlamaSpec:
    """Static description of a Llama-family model (hashable: it keys compiled steps)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_json: str | None  # JSON text: dicts are not hashable
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    # The variants' switches (genfn.models.llama_variants); the defaults are plain Llama.
    qk_norm: str | None = None  # "head": RMSNorm per head (Qwen3); "projection": over all heads (OLMo 2)
    rope_layers: tuple[bool, ...] | None = None  # False for a layer that skips RoPE (SmolLM3)
    post_norms: bool = False  # OLMo 2: norms on the attention's and the MLP's outputs, none on inputs
    rotary_dim: int | None = None  # partial rotary (Phi-4-mini): the first rotary_dim dims of a head rotate
    rope_attention_factor: float = 1.0  # YaRN's and LongRoPE's scale of cos and sin
    original_context: int = 0  # LongRoPE: past this many positions a forward uses the long factors
    num_experts: int = 0  # mixture of experts (genfn.models.moe): every layer's MLP is E experts
    experts_per_token: int = 0
    norm_topk_prob: bool = False
    moe_intermediate_size: int = 0
    tensor_shard: tensor_parallel.TensorShard | None = None  # this rank's slice (genfn.models.tensor_parallel)

    @property
    def is_plain_llama(self) -> bool:
        """Whether every layer is Llama's own (the native decode layer computes exactly that)."""
        return (self.qk_norm is None and self.rope_layers is None and not self.post_norms
                and self.rotary_dim is None and not self.num_experts)

    @property
    def rope_scaling(self) -> dict | None:
        return None if self.rope_scaling_json is None else json.loads(self.rope_scaling_json)

    @property
    def num_query_groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def _architecture(config: Mapping[str, Any]) -> str:
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    if not archs and config.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[config["model_type"]]
    found = archs or [config.get("model_type")]
    raise ValueError(f"unsupported architecture {found}; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")


def spec_from_config(config: Mapping[str, Any]) -> LlamaSpec:
    """A ``LlamaSpec`` from a Hugging Face ``config.json`` dict, with transformers' defaults."""
    arch = _architecture(config)
    spec_fields = dict(architecture=arch, **decoder_sizes(config))
    rope_scaling = config.get("rope_scaling")
    rope_theta = config.get("rope_theta")
    rope_parameters = config.get("rope_parameters")  # transformers 5 folds theta and scaling into one dict
    if isinstance(rope_parameters, Mapping):
        rope_theta = rope_parameters.get("rope_theta", rope_theta)
        if rope_parameters.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
        if rope_type == "default":
            rope_scaling = None
    sliding_window = config.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not config.get("use_sliding_window", False):
        sliding_window = None
    if arch == "LlamaForCausalLM":
        sliding_window = None
    rope_scaling = variants.complete_rope_scaling(config, rope_scaling)
    extra = variants.variant_fields(arch, config, spec_fields["head_dim"], spec_fields["num_layers"], rope_scaling)
    if "sliding_window" in extra:
        sliding_window = extra.pop("sliding_window")
    spec = LlamaSpec(
        **spec_fields,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
        rope_scaling_json=None if rope_scaling is None else json.dumps(rope_scaling, sort_keys=True),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", arch == "Qwen2ForCausalLM")),
        sliding_window=None if sliding_window is None else int(sliding_window),
        **extra,
    )
    check_head_groups(spec)
    return spec


def first_layers(layers: list, num_layers: int | None) -> list:
    """The layers an ``apply(..., num_layers=)`` runs: the first ``num_layers`` (None: all), or a
    ValueError naming the allowed range."""
    if num_layers is None:
        return layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers must be an int in [1, {len(layers)}] (the model's layers), got {num_layers!r}")
    return layers[:num_layers]


def tensor_getter(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None):
    """``get(name)``: the checkpoint's tensor ``name`` in ``dtype`` (quantized blocks stay blocks), or
    a ValueError naming the missing tensor."""
    def get(name: str) -> torch.Tensor:
        try:
            tensor = state_dict[name]
        except KeyError:
            raise ValueError(f"checkpoint is missing the tensor {name!r}") from None
        # Quantized weights (RowBlocks, tiles, K-quant blocks, experts) stay as they are.
        return tensor if dtype is None or not isinstance(tensor, torch.Tensor) else tensor.to(dtype)

    return get


def params_from_state_dict(spec: LlamaSpec, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None):
    """genfn's params pytree from Hugging Face parameter names (fusing q/k/v and gate/up).

    A matrix may be ``genfn.quant.RowBlocks`` (a GGUF file's own blocks): fusing concatenates its
    blocks as they are, and the embedding lookup gets its float values (the tied LM head keeps
    the blocks; ``genfn.models.quantized`` turns them into the kernel's layout)."""
    check_tensors(state_dict, spec, "state dict")  # shapes and dtypes against the spec, naming the tensor

    get = tensor_getter(state_dict, dtype)

    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "wqkv": variants.fused(state_dict, p + "self_attn.qkv_proj.weight", get,
                                   lambda: cat_rows([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"])),
            "wo": cat_rows([get(p + "self_attn.o_proj.weight")]),
            **variants.mlp_params(spec, p, state_dict, get),
            **variants.norm_params(spec, p, get),
        }
        if spec.attention_bias:
            layer["bqkv"] = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0)
        layers.append(layer)
    embed = get("model.embed_tokens.weight")
    lm_head = embed if spec.tie_word_embeddings else get("lm_head.weight")
    # A quantized table stays as stored (genfn.kernels.embedding dequantizes the rows it looks up);
    # Q8_0/Q4_0/Q4_1 blocks become the kernel's tiles in quantize_params, a tied head's shared.
    rotary_dim = spec.rotary_dim or spec.head_dim
    params = {
        "embed": embed,
        "layers": layers,
        "norm": get("model.norm.weight"),
        "lm_head": lm_head,
        "inv_freq": inverse_frequencies(rotary_dim, spec.rope_theta, spec.rope_scaling),
    }
    long_inv_freq = long_inverse_frequencies(rotary_dim, spec.rope_theta, spec.rope_scaling)
    if long_inv_freq is not None:
        params["long_inv_freq"] = long_inv_freq
    return params


def init_cache(spec: LlamaSpec, batch_size: int, max_cache_len: int, dtype=torch.float32, device=None) -> StaticCache:
    return init_static_cache(spec.num_layers, batch_size, spec.num_kv_heads, max_cache_len, spec.head_dim,
                             dtype=dtype, device=device)


@dataclasses.dataclass
class ModelOutput:
    """What ``apply`` returns beyond logits when asked (hidden states per layer, attention maps)."""

    logits: torch.Tensor
    cache: StaticCache
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
              mean_square: torch.Tensor | None = None) -> torch.Tensor:
    # Normalize in float32 and cast back before scaling, in transformers' order, so bfloat16
    # rounds at the same places. ``mean_square``: x's, when it spans more than x (projection_norms).
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt((xf.pow(2).mean(-1, keepdim=True) if mean_square is None else mean_square) + eps)
    return weight * xf.to(dtype)


def projection_norms(spec: LlamaSpec, layer: Mapping[str, Any], q: torch.Tensor, k: torch.Tensor):
    """OLMo 2's RMSNorms over the whole q and k projections (``[..., H * D]``, ``[..., Hkv * D]``).
    Under tensor parallelism a rank holds its heads' part of each (and of the norm weights): the
    mean squares are the whole projections', summed over the ranks (``tensor_parallel.mean_squares``)."""
    eps = spec.rms_norm_eps
    if spec.tensor_shard is None:
        return _rms_norm(q, layer["q_norm"], eps), _rms_norm(k, layer["k_norm"], eps)
    q_square, k_square = tensor_parallel.mean_squares(spec, (q, k))
    return _rms_norm(q, layer["q_norm"], eps, q_square), _rms_norm(k, layer["k_norm"], eps, k_square)


def _attention_mask(spec: LlamaSpec, cache: StaticCache, slots: torch.Tensor, attend_len: int) -> torch.Tensor:
    return attention_mask(cache, slots, attend_len, spec.sliding_window)


def attention_mask(cache: StaticCache, slots: torch.Tensor, attend_len: int, sliding_window: int | None) -> torch.Tensor:
    """Boolean ``[B, 1, S, attend_len]``: row ``b``'s query ``i`` (at slot ``slots[b, i]``) may see slot ``j``.

    The sliding window spans the row's last ``sliding_window`` real tokens, as in transformers
    (where a row's real tokens are contiguous after its left padding). A growing cache leaves
    masked holes inside rows it rewound or widened, so there the window is counted in real tokens;
    the fixed-size caches keep rows contiguous and count slots (no running count per step).
    """
    j = torch.arange(attend_len, device=slots.device).view(1, 1, attend_len)
    query_slots = slots.unsqueeze(2)  # [B, S, 1]
    causal = j <= query_slots  # [B, S, A]
    if sliding_window is not None:
        if cache.rows_have_holes:
            causal = causal & (real_tokens_back(cache.valid, slots, attend_len) < sliding_window)
        else:
            causal = causal & (j > query_slots - sliding_window)
    valid = cache.valid[:, :attend_len]  # [B, A]
    mask = causal & valid.unsqueeze(1)
    # A padding query would see nothing and its softmax would be NaN; letting every query see
    # its own slot keeps all values finite (padding outputs are never read).
    mask = mask | (j == query_slots)
    return mask.unsqueeze(1)


def _decoder_layer(spec: LlamaSpec, layer: Mapping[str, Any], i: int, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, cache: StaticCache, slots: torch.Tensor, mask: torch.Tensor, attend_len,
                   attentions: list | None, row_plan: prefill_layer.PrefillRows | None = None) -> torch.Tensor:
    """Decoder layer ``i`` on the residual stream ``x [B, S, H]``: attention (writing the layer's
    K, V at ``slots`` into the donated ``cache``), then the SwiGLU MLP. Returns the new ``x``;
    appends the attention map to ``attentions`` when that is a list. ``row_plan``: the forward's
    ``prefill_layer.prefill_rows``."""
    batch, seq = x.shape[0], x.shape[1]
    q_size = spec.num_heads * spec.head_dim
    kv_size = spec.num_kv_heads * spec.head_dim
    output_attentions = attentions is not None
    # Under tensor parallelism the row-parallel outputs are summed over ranks before each residual
    # add, which the fused native layer does inside one call: a rank runs its native pieces with
    # the sums between them (quantized layers, which must match one process bit for bit), or the
    # op-by-op path, which has the seams.
    # A verification's S drafts of a row take the fused layer as S tokens of that row, each with
    # the bits its own decode step gives, so speculation cannot change the greedy tokens.
    # The growing cache's write hands back the layer's whole cache as the static one's does, so
    # generate's default eager path takes the fused layer too (1.2x SmolLM2 float32, 1.4-1.8x its
    # Q4_1 blocks at batch 1 against the layer op by op; the same tokens in float32).
    if (not output_attentions and _native_layers_take(spec, cache)
            and decode_layer.takes(x, layer, cache.keys, spec.head_dim)):
        if spec.tensor_shard is None:
            return _native_decode_layer(spec, layer, i, x, cos, sin, cache, slots, mask, attend_len)
        if decode_layer.quantized(layer):
            return _sharded_decode_layer(spec, layer, i, x, cos, sin, cache, slots, mask, attend_len)
    # A float32 or bfloat16 prefill's many tokens per row: the same layer with its elementwise work in native passes.
    if not output_attentions and prefill_layer.takes(spec, layer, x):
        return prefill_layer.prefill_layer(spec, layer, i, x, cos, sin, cache, slots, mask, attend_len, row_plan)
    h = x if spec.post_norms else _rms_norm(x, layer["attn_norm"], spec.rms_norm_eps)
    qkv = linear(h, layer["wqkv"], layer.get("bqkv"))
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    if spec.qk_norm == "projection":
        q, k = projection_norms(spec, layer, q, k)
    q = q.view(batch, seq, spec.num_heads, spec.head_dim)
    k = k.view(batch, seq, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm == "head":
        q, k = _rms_norm(q, layer["q_norm"], spec.rms_norm_eps), _rms_norm(k, layer["k_norm"], spec.rms_norm_eps)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = v.view(batch, seq, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    if spec.rope_layers is None or spec.rope_layers[i]:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    keys, values = cache.write_layer(i, slots, k, v)
    keys, values = keys[:, :, :attend_len], values[:, :, :attend_len]
    grouped = spec.num_query_groups > 1
    if output_attentions:
        if grouped:
            keys = keys.repeat_interleave(spec.num_query_groups, dim=1)
            values = values.repeat_interleave(spec.num_query_groups, dim=1)
        attn, weights = _eager_attention(q, keys, values, mask, spec.head_dim)
        attentions.append(weights)
    else:
        # enable_gqa reads each K/V head in place for its query group (the CPU flash kernel takes
        # grouped heads natively, same values as repeating them): repeat_interleave copied the
        # layer's whole attended K and V, num_query_groups times over, every layer of every step.
        # A branch, not enable_gqa=grouped: SDPA takes a Python bool, and where dynamo holds the
        # spec's ints as symbols the comparison is a SymBool (a branch on it specializes).
        # A decode step's single query per row takes the native kernel (genfn.kernels.decode_attention),
        # a prefill's many the native one that skips the key tiles the mask hides (a causal
        # prefill's upper half, which the library kernel computes and then masks).
        attn = decode_attention(q, keys, values, mask)
        if attn is None and row_plan is not None:
            attn = prefill_attention(q, keys, values, mask, row_plan.first_slots)
        if attn is None and grouped:
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        elif attn is None:
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    attn = attn.transpose(1, 2).reshape(batch, seq, q_size)
    if spec.post_norms:
        attn_out = tensor_parallel.row_parallel(spec, attn, layer["wo"])
        x = x + _rms_norm(attn_out, layer["post_attn_norm"], spec.rms_norm_eps)
        return x + _rms_norm(_mlp(spec, layer, x), layer["post_mlp_norm"], spec.rms_norm_eps)
    x = x + tensor_parallel.row_parallel(spec, attn, layer["wo"])
    return x + _mlp(spec, layer, _rms_norm(x, layer["mlp_norm"], spec.rms_norm_eps))


def _mlp(spec: LlamaSpec, layer: Mapping[str, Any], h: torch.Tensor) -> torch.Tensor:
    """SwiGLU, or (a mixture-of-experts spec) the routed experts' SwiGLUs."""
    if spec.num_experts:
        return moe_mlp(spec, layer, h)
    gate, up = linear(h, layer["w_gate_up"]).chunk(2, dim=-1)
    return tensor_parallel.row_parallel(spec, F.silu(gate) * up, layer["w_down"])


def _native_decode_layer(spec: LlamaSpec, layer: Mapping[str, Any], i: int, x: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, cache: StaticCache, slots: torch.Tensor, mask: torch.Tensor,
                         attend_len) -> torch.Tensor:
    """``_decoder_layer`` for one token per row, in two native calls around the cache write
    (genfn.kernels.decode_layer): the same numbers, a fraction of the per-op overhead."""
    q, keys, values = _native_attention_input(spec, layer, i, x, cos, sin, cache, slots)
    return decode_layer.layer_output(x, q.reshape(-1, spec.num_heads, spec.head_dim), keys[:, :, :attend_len],
                                     values[:, :, :attend_len], mask, layer, spec.rms_norm_eps)


def _native_attention_input(spec: LlamaSpec, layer: Mapping[str, Any], i: int, x: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, cache: StaticCache, slots: torch.Tensor):
    """The fused layer's first native call and the cache write: ``(q, keys, values)``, the rows'
    queries (heads flattened) and the layer's whole cache after the write."""
    batch, seq = x.shape[0], x.shape[1]
    q_size = spec.num_heads * spec.head_dim
    kv_size = spec.num_kv_heads * spec.head_dim
    qkv = decode_layer.attention_input(x, layer, cos, sin, spec.rms_norm_eps, spec.num_heads, spec.num_kv_heads)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    k = k.reshape(batch, seq, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    v = v.reshape(batch, seq, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    keys, values = cache.write_layer(i, slots, k, v)
    return q, keys, values


def _native_stack(spec: LlamaSpec, params: Mapping[str, Any], layers, x: torch.Tensor,
                  cache) -> torch.Tensor | None:
    """The table (``decode_layer.stack_table``) of the step's whole stack of layers as one native call
    (``decode_layer.run_stack``), where every layer would take the fused native layer on its own: the
    same numbers without the Python, dispatch and glue between the layers' calls (~70 us a layer
    eager; in a compiled step inductor's wrapper calls and the cache writes' kernels between them).
    Generate's params carry the table built once (``step_params``); other params get one built here,
    each call. None where the stack does not run."""
    if not _native_layers_take(spec, cache) or spec.tensor_shard is not None:
        return None
    if not decode_layer.stack_takes(x, cache.keys, spec.head_dim):
        return None
    # ``layers`` are the params' first few (``first_layers``): the table of all of them serves.
    return stack_table_of(spec, params, x.dtype, lambda: layers)


# The params entry of the native stack's table (step_params).
STACK_TABLE = "decode_stack_table"


def step_params(spec: LlamaSpec, params: Mapping[str, Any]) -> Mapping[str, Any]:
    """``params`` as generate's steps read them, eager and compiled (``genfn.models.registry.step_params``):
    with the native stack's table of its layers (``decode_layer.stack_table``), so a step neither walks
    every layer's weights again nor hands each to the native call."""
    if not spec.is_plain_llama or spec.tensor_shard is not None:
        return params
    table = _built_stack_table(spec, params["layers"], params["norm"].dtype)
    return params if table is None else {**params, STACK_TABLE: table}


def stack_table_of(spec: LlamaSpec, params: Mapping[str, Any], dtype: torch.dtype,
                   layers: Callable[[], list]) -> torch.Tensor | None:
    """The native stack's table for activations of ``dtype``: the params' own (``step_params``, made for
    the norms' dtype, which is x's), else one built now of ``layers()`` (params of the user's own,
    without one)."""
    table = params.get(STACK_TABLE) if dtype == params["norm"].dtype else None
    return table if table is not None else _built_stack_table(spec, layers(), dtype)


def _built_stack_table(spec: LlamaSpec, layers, dtype: torch.dtype) -> torch.Tensor | None:
    return decode_layer.stack_table(layers, dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim)


def _native_layers_take(spec: LlamaSpec, cache) -> bool:
    """Whether the native decode layer (one layer's calls, or the stack) can run ``spec``'s layers on
    ``cache``, before each layer's own weights and the step's rows (``decode_layer.takes``): Llama's own
    layers over a static or growing cache, whose write hands back the layer's whole cache."""
    return type(cache) in (StaticCache, DynamicCache) and spec.is_plain_llama


def _sharded_decode_layer(spec: LlamaSpec, layer: Mapping[str, Any], i: int, x: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, cache: StaticCache, slots: torch.Tensor, mask: torch.Tensor,
                          attend_len) -> torch.Tensor:
    """``_native_decode_layer`` on a tensor-parallel rank's block-quantized shard: the fused layer's
    own pieces (its attention input, the native attention, its MLP input) around the row-parallel
    sums (``tensor_parallel.row_parallel``), so every value is one process's bit for bit."""
    q_size = spec.num_heads * spec.head_dim
    q, keys, values = _native_attention_input(spec, layer, i, x, cos, sin, cache, slots)
    keys, values = keys[:, :, :attend_len], values[:, :, :attend_len]
    # Each query on its own over its row's visible slots: the fused layer's attention.
    attn = invariant.dense_attention(q.reshape(*x.shape[:2], spec.num_heads, spec.head_dim), keys, values, mask)
    x1 = x + tensor_parallel.row_parallel(spec, attn.reshape(-1, q_size), layer["wo"]).view(x.shape)
    act = decode_layer.mlp_input(x1, layer, spec.rms_norm_eps)
    return x1 + tensor_parallel.row_parallel(spec, act, layer["w_down"]).view(x.shape)


def apply(
    spec: LlamaSpec,
    params: Mapping[str, Any],
    tokens: torch.Tensor,
    positions: torch.Tensor,
    cache: StaticCache,
    attention_mask: torch.Tensor | None = None,
    *,
    logits_to_keep: int = 0,
    attend_len: int | None = None,
    output_hidden_states: bool = False,
    output_attentions: bool = False,
    num_layers: int | None = None,
):
    """Run ``tokens [B, S]`` at ``positions [B, S]`` against ``cache`` (donated).

    ``attention_mask [B, S]`` marks real tokens (1) versus left padding (0); default all real.
    ``logits_to_keep``: compute logits for the last that many positions only (0 = all).
    ``attend_len``: attend over the first ``attend_len`` cache slots only (static; must cover
    every filled slot), so attention costs the real context rather than ``max_cache_len``.
    ``num_layers``: run only the first that many layers, then the final norm and LM head (early
    exit: a cheaper draft of the same model; the cache's deeper layers are left as they were).
    Returns ``(logits [B, S', V] float32, cache)``, or a ``ModelOutput`` when hidden states or
    attentions are requested.
    """
    layers = first_layers(params["layers"], num_layers)
    # slots [B, S]: rows fill their caches independently.
    cache, slots, attend_len = begin_forward(cache, tokens, attention_mask, attend_len)
    mask = _attention_mask(spec, cache, slots, attend_len)

    x = tensor_parallel.embedding(spec, tokens, params["embed"], params["norm"].dtype)
    in_mode = invariant.batch_invariant()
    long_inv_freq = params.get("long_inv_freq")
    # In the mode LongRoPE picks its factors per row (the row's furthest position), not by the batch's.
    cos, sin = rope_cos_sin(params["inv_freq"], positions, x.dtype, spec.rope_attention_factor, long_inv_freq,
                            spec.original_context,
                            long_rope_furthest(positions) if in_mode and long_inv_freq is not None else None)
    if in_mode:
        check_invariant_spec(spec)
        if output_hidden_states or output_attentions:
            raise ValueError("the batch-invariant mode (genfn.deterministic) does not return hidden states or "
                             "attentions")
        return _invariant_forward(spec, params, layers, x, cos, sin, cache, slots, mask, attend_len,
                                  logits_to_keep), cache
    hidden_states = [x] if output_hidden_states else None
    attentions = [] if output_attentions else None
    table = None if output_hidden_states or output_attentions else _native_stack(spec, params, layers, x, cache)
    if table is not None:
        x = decode_layer.run_stack(x, table, len(layers), cos, sin, cache.keys, cache.values, slots, mask,
                                   spec.rms_norm_eps)
    else:
        row_plan = prefill_layer.prefill_rows(cache, attention_mask, tokens.shape[1], attend_len)
        for i, layer in enumerate(layers):
            x = _decoder_layer(spec, layer, i, x, cos, sin, cache, slots, mask, attend_len, attentions, row_plan)
            if output_hidden_states:
                hidden_states.append(x)
    if logits_to_keep and not output_hidden_states:
        x = x[:, -logits_to_keep:]  # the norm is per token: only the kept positions need it
    x = _rms_norm(x, params["norm"], spec.rms_norm_eps)
    if output_hidden_states:
        hidden_states[-1] = x  # transformers reports the final-norm output as the last hidden state
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
    # As rows of one matrix: torch multiplied a 3-D slice (strided across the batch) by the
    # broadcast weight as a batched matmul, copying the 56 MB LM head once per row (1.3 s of a
    # 1.7 s prefill of 32 x 30 tokens).
    batch, kept = x.shape[:2]
    logits = linear(x.reshape(batch * kept, x.shape[-1]), params["lm_head"]).to(torch.float32)
    logits = tensor_parallel.gathered_logits(spec, logits)
    logits = logits.reshape(batch, kept, -1)
    if output_hidden_states or output_attentions:
        return ModelOutput(logits, cache,
                           tuple(hidden_states) if hidden_states is not None else None,
                           tuple(attentions) if attentions is not None else None)
    return logits, cache


def _invariant_forward(spec: LlamaSpec, params: Mapping[str, Any], layers, x: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, cache: StaticCache, slots: torch.Tensor, mask: torch.Tensor, attend_len,
                       logits_to_keep: int) -> torch.Tensor:
    """``apply``'s layers, final norm and LM head in the batch-invariant mode, over the static cache."""
    batch, seq, hidden = x.shape
    kv_heads, head_dim = spec.num_kv_heads, spec.head_dim

    def attend(i, q, k, v):
        keys, values = cache.write_layer(i, slots, k.view(batch, seq, kv_heads, head_dim).transpose(1, 2),
                                         v.view(batch, seq, kv_heads, head_dim).transpose(1, 2))
        return invariant.dense_attention(q.view(batch, seq, spec.num_heads, head_dim), keys[:, :, :attend_len],
                                         values[:, :, :attend_len], mask)

    rows, mlp_out = invariant_layers(spec, layers, x.reshape(batch * seq, hidden), cos.reshape(batch * seq, -1),
                                     sin.reshape(batch * seq, -1), attend)
    kept = seq if not logits_to_keep else min(logits_to_keep, seq)
    rows, mlp_out = (t.view(batch, seq, hidden)[:, seq - kept:].reshape(batch * kept, hidden) for t in (rows, mlp_out))
    return invariant_logits(spec, params, rows, mlp_out).reshape(batch, kept, -1)


def mtp_head(spec: LlamaSpec, params: Mapping[str, Any], index: int, hidden: torch.Tensor, token: torch.Tensor):
    """Multi-token prediction head ``index`` (optional ``params["mtp"]``, a list of heads).

    DeepSeek-V3's MTP module without its transformer block: the head mixes the previous depth's
    hidden state ``hidden [B, H]`` with the embedding of the token chosen from it, ``token [B]``
    (each RMS-normed, concatenated, projected back to ``H`` by ``eh_proj [H, 2H]``), and reads the
    next-next token through the model's final norm and LM head. Returns ``(logits [B, V] float32,
    hidden [B, H])``; the hidden state feeds head ``index + 1``.
    """
    head = params["mtp"][index]
    embedded = tensor_parallel.embedding(spec, token, params["embed"], params["norm"].dtype)
    embedded = _rms_norm(embedded, head["enorm"], spec.rms_norm_eps)
    mixed = linear(torch.cat([embedded, _rms_norm(hidden, head["hnorm"], spec.rms_norm_eps)], dim=-1),
                   head["eh_proj"])
    logits = linear(_rms_norm(mixed, params["norm"], spec.rms_norm_eps), params["lm_head"]).to(torch.float32)
    logits = tensor_parallel.gathered_logits(spec, logits)
    return logits, mixed


def _eager_attention(q, k, v, mask, head_dim):
    scores = (q @ k.transpose(-1, -2)) * head_dim**-0.5
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return weights @ v, weights
