"""Any ``nn.Module`` with a transformers-style forward as a genfn model: ``from_module(module)``.

The module's parameters and buffers become the params pytree (a flat ``{name: tensor}`` dict) and
its forward runs through ``torch.func.functional_call``, so the model is a value like the native
families: the same module object serves any params (``Model.to`` makes new ones without copying
the module), and the compiled driver can hold the params as its own buffers.

The cache bridge goes genfn -> module: the KV cache stays a genfn cache pytree (static, dynamic,
offloaded, quantized: whatever ``cache_implementation`` chose), and each call hands the module a
short-lived transformers ``Cache`` whose layers write through genfn's cache protocol
(``write_layer``) and report the sizes transformers' mask builders need. Together with an
``attention_mask`` over every cache slot (``cache.valid``) and explicit ``position_ids``, the module
sees exactly the inputs its own ``generate`` would give it, left padding included, so greedy and
beam tokens equal the module's own.

Rows move independently, as in every genfn cache (speculative decoding keeps a different number of
drafts per row and rewinds each row's fill pointer): transformers' masks assume one query offset for
the whole batch, so for modules that build their masks with transformers' ``sdpa`` or ``eager``
attention the bridge hands them a prepared 4-D mask instead, built from each row's own slots and
``cache.valid`` (transformers passes a 4-D mask through unchanged). Other modules get the 2-D mask,
and their rows must advance together (``ModuleSpec.rows_independent`` is False): speculative
decoding then runs them at batch size 1 only.

Early exit (``assistant_early_exit``) needs the first ``N`` layers of the model as a function; a
wrapped module runs its forward whole, so ``ModuleSpec.layer_access`` is False and the early-exit
drafter refuses it by name.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch

from genfn.cache.base import begin_forward
from genfn.cache.static import init_static_cache
from genfn.kernels.invariant import refuse_without_invariant_forward

__all__ = ["ModuleSpec", "RowMask", "from_module", "apply", "init_cache", "ModuleOutput", "row_attention_mask"]


@dataclasses.dataclass(frozen=True, eq=False)
class ModuleSpec:
    """The static half of a wrapped module: the module (its structure; its tensors are replaced by
    the params at every call) and the cache geometry read from one probing forward.

    Compared and hashed by identity: two wraps of one module share nothing but the module.
    """

    module: torch.nn.Module
    architecture: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None
    forward_args: frozenset  # the keyword arguments the module's forward accepts
    cache_arg: str  # "cache" (transformers 5) or "past_key_values"
    cache_view: Any  # the transformers Cache the module is handed, rebound at every forward
    # How the per-row 4-D mask is built: None (the module gets the 2-D mask: rows advance
    # together), or the static recipe (additive or boolean, windows per layer type).
    row_mask: "RowMask | None" = None
    float_param: str | None = None  # a floating-point param whose dtype an additive mask takes

    # The module's forward runs whole: no first-N-layers function for early exit.
    layer_access = False

    # An arbitrary module may not trace under torch.compile: the driver then runs its step
    # eagerly (logging it once) instead of failing the call.
    compile_fallback = True

    @property
    def rows_independent(self) -> bool:
        """Whether rows of one forward may sit at different slots (speculative decoding at batch > 1)."""
        return self.row_mask is not None

    def __repr__(self) -> str:
        return (f"ModuleSpec({self.architecture}, layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, vocab={self.vocab_size})")


@dataclasses.dataclass(frozen=True)
class RowMask:
    """How a wrapped transformers module takes a per-row mask (static: part of the spec).

    ``additive``: eager attention adds the mask to the scores (0 / the dtype's minimum), sdpa takes a
    boolean one. ``windows``: the sliding window of each mask the module reads (None: full causal);
    ``layer_types``: the mask-mapping keys when the module reads one mask per layer type (a dict),
    else None (one tensor).
    """

    additive: bool
    windows: tuple
    layer_types: tuple | None = None


def _row_mask_for(module: torch.nn.Module) -> RowMask | None:
    """The module's per-row mask recipe, or None when it does not build masks with transformers'
    sdpa/eager attention (then only the 2-D mask is known to be understood)."""
    config = getattr(module, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        return None
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    layer_types = getattr(config, "layer_types", None)
    additive = implementation == "eager"
    if layer_types is not None and len(set(layer_types)) > 1:
        kinds = tuple(sorted(set(layer_types)))
        if not set(kinds) <= {"full_attention", "sliding_attention"}:
            return None
        return RowMask(additive, tuple(window if kind == "sliding_attention" else None for kind in kinds), kinds)
    if layer_types is not None and set(layer_types) == {"full_attention"}:
        window = None
    return RowMask(additive, (window,))


def row_attention_mask(valid: torch.Tensor, slots: torch.Tensor, window: int | None = None,
                       positions: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, 1, S, T]`` bool: query ``i`` of row ``b`` (at slot ``slots[b, i]``) sees slot ``j`` when it
    holds a real token at or before the query and, with a sliding ``window``, less than ``window``
    tokens back. Pure; each row's queries sit at their own slots.

    The window counts the row's real tokens (``positions [B, S]`` of the queries against the running
    count of valid slots), not slots: a growing cache appends every row at the shared end and masks a
    rewound row's tail, so slot distance would count those holes. In transformers' own layout (left
    padding, no holes) the two agree.
    """
    columns = torch.arange(valid.shape[1], device=valid.device)
    query = slots.unsqueeze(-1)  # [B, S, 1]
    seen = (columns <= query) & valid.unsqueeze(1)
    if window is not None:
        if positions is None:
            seen = seen & (query - columns < window)
        else:
            key_positions = valid.to(torch.int64).cumsum(dim=1) - 1  # [B, T]
            seen = seen & (positions.unsqueeze(-1) - key_positions.unsqueeze(1) < window)
    return seen.unsqueeze(1)


def _module_mask(recipe: RowMask, valid: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                 dtype: torch.dtype):
    def one(window):
        seen = row_attention_mask(valid, slots, window, positions)
        if not recipe.additive:
            return seen
        zero = torch.zeros((), dtype=dtype, device=valid.device)
        return torch.where(seen, zero, torch.finfo(dtype).min)

    if recipe.layer_types is None:
        return one(recipe.windows[0])
    return {kind: one(window) for kind, window in zip(recipe.layer_types, recipe.windows)}


@dataclasses.dataclass
class ModuleOutput:
    """What ``apply`` returns when hidden states or attentions are asked for."""

    logits: torch.Tensor
    cache: Any
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@functools.lru_cache(maxsize=1)
def _bridge_classes():
    """The transformers ``Cache`` view over a genfn cache (built on first use: transformers is only
    needed by the modules that expect its cache type)."""
    try:
        from transformers.cache_utils import Cache, CacheLayerMixin
    except ImportError as missing:
        raise ImportError("genfn.from_module needs transformers for the module's cache interface: "
                          "pip install transformers") from missing

    class GenfnLayer(CacheLayerMixin):
        """One layer of the view: writes go to the genfn cache, sizes come from this forward."""

        is_compileable = True  # keeps transformers from host-syncing on the mask to skip it
        is_sliding = False  # a sliding window is applied by the mask over absolute slots

        def __init__(self, view, index: int):
            super().__init__()
            self.view, self.index, self.is_initialized = view, index, True

        def lazy_initialization(self, key_states, value_states) -> None:
            return None

        def update(self, key_states, value_states, *args, **kwargs):
            return self.view.write(self.index, key_states, value_states)

        def get_mask_sizes(self, query_length: int):
            return self.view.attend_len, 0

        def get_seq_length(self):
            return self.view.offset

        def get_max_length(self) -> int:
            return self.view.cache.max_cache_len

    class GenfnCacheView(Cache):
        """A transformers ``Cache`` over a genfn cache, built once per wrapped module (dynamo cannot
        build cache layers inside a compiled step) and bound to each forward's genfn cache."""

        def __init__(self, num_layers: int):
            self.cache = self.slots = self.offset = None
            self.attend_len = 0
            super().__init__(layers=[GenfnLayer(self, i) for i in range(num_layers)])

        def bind(self, cache, slots: torch.Tensor, attend_len: int) -> "GenfnCacheView":
            """This view over ``cache`` (already advanced) for a forward writing ``slots [B, S]``."""
            self.cache, self.slots, self.attend_len = cache, slots, attend_len
            # The first new token's slot, shared by every row: transformers' query offset.
            self.offset = slots[0, 0]
            return self

        def write(self, layer: int, key_states, value_states):
            keys, values = self.cache.write_layer(layer, self.slots, key_states, value_states)
            return keys[:, :, : self.attend_len], values[:, :, : self.attend_len]

    return GenfnCacheView


def _forward_args(module: torch.nn.Module) -> frozenset:
    """The forward's keyword names; ``"kwargs"`` stands for a ``**kwargs`` that takes any (empty:
    the signature is unknown, so every argument is passed)."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return frozenset()
    return frozenset("kwargs" if p.kind is inspect.Parameter.VAR_KEYWORD else name for name, p in parameters.items())


def _probe(module: torch.nn.Module, cache_arg: str, vocab_size: int | None):
    """(num_layers, kv_heads, head_dim, vocab_size) from one forward of one token into a recording cache."""
    from transformers.cache_utils import DynamicCache

    recorded: dict[int, tuple] = {}

    class Recorder(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            recorded[layer_idx] = (tuple(key_states.shape), tuple(value_states.shape))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    param = next(iter(module.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    with torch.no_grad():
        token = torch.zeros(1, 1, dtype=torch.int64, device=device)
        out = module(input_ids=token, attention_mask=torch.ones_like(token), **{cache_arg: Recorder(), "use_cache": True})
    if not recorded:
        raise TypeError(f"{type(module).__name__} did not write its keys and values through the cache passed as "
                        f"{cache_arg}=: genfn.from_module needs a module with transformers' cache interface")
    shapes = {shape for shape in recorded.values()}
    if len(shapes) != 1 or shapes.pop()[0] != next(iter(recorded.values()))[1]:
        raise TypeError(f"{type(module).__name__} has layers with different key/value shapes {sorted(set(recorded.values()))}; "
                        f"genfn's caches hold one shape for every layer")
    (_, heads, _, head_dim), _ = next(iter(recorded.values()))
    logits = out.logits if hasattr(out, "logits") else out[0]
    return len(recorded), heads, head_dim, vocab_size or int(logits.shape[-1])


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name, tied tensors once (``functional_call`` re-ties them)."""
    params = {name: p.detach() for name, p in module.named_parameters()}
    params.update({name: b for name, b in module.named_buffers()})
    return params


def spec_for(module: torch.nn.Module) -> ModuleSpec:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"from_module expects a torch.nn.Module, got {type(module).__name__}")
    view_class = _bridge_classes()  # fails early, and clearly, without transformers
    args = _forward_args(module)
    cache_arg = "cache" if "cache" in args or "past_key_values" not in args else "past_key_values"
    config = getattr(module, "config", None)
    vocab = getattr(config, "vocab_size", None)
    layers, heads, head_dim, vocab = _probe(module, cache_arg, vocab)
    architectures = getattr(config, "architectures", None) or [type(module).__name__]
    accepts_mask = not args or "kwargs" in args or "attention_mask" in args
    row_mask = _row_mask_for(module) if accepts_mask else None
    float_param = next((name for name, p in _params(module).items() if p.is_floating_point()), None)
    if row_mask is not None and row_mask.additive and float_param is None:
        row_mask = None
    return ModuleSpec(
        module=module, architecture=architectures[0], vocab_size=int(vocab), num_layers=layers, num_kv_heads=heads,
        head_dim=head_dim, max_position_embeddings=getattr(config, "max_position_embeddings", None),
        forward_args=args, cache_arg=cache_arg, cache_view=view_class(layers), row_mask=row_mask,
        float_param=float_param)


def init_cache(spec: ModuleSpec, batch_size: int, max_cache_len: int, dtype=torch.float32, device=None):
    return init_static_cache(spec.num_layers, batch_size, spec.num_kv_heads, max_cache_len, spec.head_dim,
                             dtype=dtype, device=device)


def apply(spec: ModuleSpec, params, tokens, positions, cache, attention_mask=None, *, logits_to_keep: int = 0,
          attend_len: int | None = None, output_hidden_states: bool = False, output_attentions: bool = False):
    """The module's forward on ``tokens [B, S]`` at ``positions [B, S]`` against genfn ``cache`` (donated).

    The same contract as the native families' ``apply``: returns ``(logits [B, S', V] float32, cache)``,
    or a ``ModuleOutput`` when hidden states or attentions are asked for.
    """
    refuse_without_invariant_forward("a wrapped module (genfn.from_module)")
    batch, seq = tokens.shape
    cache, slots, attend_len = begin_forward(cache, tokens, attention_mask, attend_len)
    view = spec.cache_view.bind(cache, slots, attend_len)
    valid = cache.valid[:, :attend_len]
    if spec.row_mask is not None:
        dtype = params[spec.float_param].dtype if spec.float_param is not None else torch.float32
        mask = _module_mask(spec.row_mask, valid, slots, positions, dtype)
    else:
        mask = valid
    kwargs = {"input_ids": tokens, "attention_mask": mask, "position_ids": positions,
              spec.cache_arg: view, "use_cache": True}
    if spec.forward_args and "kwargs" not in spec.forward_args:
        kwargs = {name: value for name, value in kwargs.items() if name in spec.forward_args}
    if logits_to_keep and "logits_to_keep" in spec.forward_args:
        kwargs["logits_to_keep"] = logits_to_keep
    if output_hidden_states:
        kwargs["output_hidden_states"] = True
    if output_attentions:
        kwargs["output_attentions"] = True
    out = torch.func.functional_call(spec.module, params, args=(), kwargs=kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    if logits_to_keep and logits.shape[1] > logits_to_keep:
        logits = logits[:, -logits_to_keep:]
    logits = logits.to(torch.float32)
    if output_hidden_states or output_attentions:
        return ModuleOutput(logits, cache, getattr(out, "hidden_states", None) if output_hidden_states else None,
                            getattr(out, "attentions", None) if output_attentions else None)
    return logits, cache


def _generation_config(module: torch.nn.Module):
    from genfn.config import GenerationConfig

    config = getattr(module, "config", None)
    config_dict = config.to_dict() if hasattr(config, "to_dict") else {}
    own = getattr(module, "generation_config", None)
    if own is not None and hasattr(own, "to_diff_dict"):
        try:
            return GenerationConfig.from_dict(own.to_diff_dict())
        except (TypeError, ValueError):
            pass  # a field genfn does not know: fall back to the model config's special tokens
    return GenerationConfig.from_model_config(config_dict)


def from_module(module: torch.nn.Module, *, tokenizer=None, generation_config=None, source: str | None = None):
    """``module`` (a transformers ``PreTrainedModel`` or any module with its forward signature) as a
    genfn ``Model``: greedy, sampling and beam search run on it through every genfn cache."""
    from genfn.config import GenerationConfig
    from genfn.models.model import Model

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"from_module expects a torch.nn.Module, got {type(module).__name__}")
    module = module.eval()
    spec = spec_for(module)
    if isinstance(generation_config, dict):
        generation_config = GenerationConfig.from_dict(generation_config)
    if generation_config is None:
        generation_config = _generation_config(module)
    config = getattr(module, "config", None)
    return Model(spec, _params(module), apply, init_cache, tokenizer=tokenizer, generation_config=generation_config,
                 config=config.to_dict() if hasattr(config, "to_dict") else {}, source=source)
