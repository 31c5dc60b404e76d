"""``Model``: a model as a value (static spec + params pytree + pure apply), plus conveniences.

A ``Model`` bundles what a checkpoint brings: the spec, the params, the pure ``apply`` function,
the tokenizer and the generation defaults. Its methods are thin: ``model.apply(...)`` is
``apply_fn(spec, params, ...)``. ``model.generate(...)`` (``genfn.generate(model, ...)``) and the
continuous-batching methods are attached by the public API (``genfn.model_methods``): a model
imports nothing above ``genfn.models``.
The only thing a Model keeps besides its value is the table of compiled steps, which belongs to
the model because the compiled code closes over its weights.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable

import optree
import torch

from genfn.models import encoder_decoder, registry
from genfn.models.functional import FunctionalModel
from genfn.models.weight_arena import WeightArena, place_in_arena
from genfn.models.seq2seq import EncoderOutput

__all__ = ["Model", "EncoderDecoderModel", "ModelCallOutput", "load", "from_hf_state_dict", "refuse_hub_id"]


@dataclasses.dataclass
class ModelCallOutput:
    """What ``model(input_ids)`` returns: ``logits [B, S, V]`` (float32) and the filled cache."""

    logits: torch.Tensor
    cache: Any


class Model:
    def __init__(self, spec, params, apply_fn: Callable, init_cache_fn: Callable, *,
                 tokenizer=None, generation_config=None, config: dict | None = None, source: str | None = None):
        self.spec = spec
        self.params = params
        self.apply_fn = apply_fn
        self.init_cache_fn = init_cache_fn
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.config = config or {}
        self.source = source
        self.compiled_steps: dict = {}
        self._functional: tuple | None = None  # (the params it was made of, functional()'s value)

    @property
    def dtype(self) -> torch.dtype:
        return _first_floating(self.params).dtype

    @property
    def device(self) -> torch.device:
        return _first_floating(self.params).device

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def max_position_embeddings(self) -> int | None:
        return getattr(self.spec, "max_position_embeddings", None)

    def apply(self, tokens, positions, cache, attention_mask=None, **kwargs):
        return self.functional().apply(tokens, positions, cache, attention_mask, **kwargs)

    def __call__(self, input_ids, attention_mask=None, *, cache=None) -> ModelCallOutput:
        """One forward over ``input_ids [B, S]`` (left padding marked 0 in ``attention_mask``), like
        calling a transformers model: ``model(input_ids).logits``. Positions count the real tokens
        of each row (padding gets 1, as in transformers); ``cache`` (default: a fresh static cache
        holding exactly the prompt) is donated."""
        input_ids = torch.as_tensor(input_ids, dtype=torch.int64, device=self.device)
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq] token ids, got shape {tuple(input_ids.shape)}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = torch.as_tensor(attention_mask, device=self.device)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got "
                             f"{tuple(attention_mask.shape)}")
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        if cache is None:
            cache = self.init_cache(input_ids.shape[0], input_ids.shape[1])
        with torch.no_grad():
            logits, cache = self.apply(input_ids, positions, cache, attention_mask)
        return ModelCallOutput(logits, cache)

    def to(self, device=None, dtype=None) -> "Model":
        """A new Model with the floating-point params cast to ``dtype`` and every param moved to
        ``device`` (either may be None); this model is unchanged. Compiled steps are not shared:
        they closed over the old weights."""
        if isinstance(device, torch.dtype):  # model.to(torch.bfloat16), as with nn.Module
            device, dtype = None, device
        if dtype is not None:
            dtype = _check_dtype(dtype)
        if device is not None:
            device = torch.device(device)

        def moved(leaf):
            if not isinstance(leaf, torch.Tensor):
                return leaf
            cast = dtype if dtype is not None and leaf.is_floating_point() and not _keeps_float32(leaf, self.params) \
                else None
            return leaf.to(device=device, dtype=cast)

        params = place_in_arena(optree.tree_map(moved, self.params, none_is_leaf=True))
        return Model(self.spec, params, self.apply_fn, self.init_cache_fn, tokenizer=self.tokenizer,
                     generation_config=self.generation_config, config=dict(self.config), source=self.source)

    def functional(self) -> FunctionalModel:
        """The value a step function receives (eager and compiled alike): spec, params, apply. Its
        params may carry values the family derives from them once (``registry.step_params``: Llama's
        native stack table), made on the first call and kept while ``self.params`` is the same object:
        they read the weights as they were then, so after replacing a weight inside the params
        (rather than changing it in place) assign ``self.params`` anew, or make a new ``Model``."""
        made = self._functional
        if made is None or made[0] is not self.params:
            made = self._functional = (self.params, FunctionalModel(
                self.spec, registry.step_params(self.spec, self.params), self.apply_fn))
        return made[1]

    def init_cache(self, batch_size: int, max_cache_len: int, implementation: str | None = "static",
                   cache_config: dict | None = None):
        """A fresh cache; ``implementation`` as ``GenerationConfig.cache_implementation`` (None: "dynamic")."""
        if implementation == "static" and not cache_config:
            return self.init_cache_fn(self.spec, batch_size, max_cache_len, dtype=self.dtype, device=self.device)
        from genfn.cache.factory import make_cache

        return make_cache(implementation, self.spec, batch_size, max_cache_len, dtype=self.dtype,
                          device=self.device, cache_config=cache_config)

    def compute_transition_scores(self, sequences, scores, beam_indices=None, normalize_logits=False):
        from genfn.scores import compute_transition_scores

        return compute_transition_scores(sequences, scores, beam_indices, normalize_logits)

    def __repr__(self) -> str:
        return f"Model({self.spec!r}, dtype={self.dtype}, source={self.source!r})"


def _first_floating(params) -> torch.Tensor:
    """The embedding of a native family (its final norm when the embedding is quantized), else the
    first floating-point tensor of the params."""
    if isinstance(params, dict):
        for key in ("embed", "norm"):
            if isinstance(params.get(key), torch.Tensor) and params[key].is_floating_point():
                return params[key]
    import optree

    for leaf in optree.tree_leaves(params):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf
    raise ValueError("the model's params hold no floating-point tensor")


class EncoderDecoderModel(Model):
    """A ``Model`` whose ``apply`` is the decoder, with a pure encoder beside it.

    ``generate`` runs ``encode`` once per call (in the strategy's ``init``) and keeps the
    cross-attention keys/values in the decode state's cache.
    """

    is_encoder_decoder = True

    def __init__(self, spec, params, apply_fn: Callable, init_cache_fn: Callable, *, encode_fn: Callable,
                 cross_kv_fn: Callable, **kwargs):
        super().__init__(spec, params, apply_fn, init_cache_fn, **kwargs)
        self.encode_fn = encode_fn
        self.cross_kv_fn = cross_kv_fn

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
               output_hidden_states: bool = False, output_attentions: bool = False) -> EncoderOutput:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self.encode_fn(self.spec, self.params, input_ids, attention_mask,
                              output_hidden_states=output_hidden_states, output_attentions=output_attentions)

    def cross_attention_kv(self, encoder_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K, V)`` ``[L, B, H, S_enc, D]``: every decoder layer's cross-attention keys/values."""
        return self.cross_kv_fn(self.spec, self.params, encoder_hidden)


def _check_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype, dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be one of float32, bfloat16, float16; got {dtype!r}")
    return dtype


def _keeps_float32(leaf: torch.Tensor, params) -> bool:
    """Whether ``leaf`` is a float32 table a native family keeps at full precision whatever the
    weights' dtype (the rotary inverse frequencies)."""
    return isinstance(params, dict) and any(params.get(name) is leaf
                                            for name in ("inv_freq", "long_inv_freq", "local_inv_freq"))


def from_hf_state_dict(config: dict, state_dict: dict, *, dtype=torch.float32, tokenizer=None,
                       generation_config=None, source: str | None = None, tensor_shard=None) -> Model:
    """A native ``Model`` from a Hugging Face config dict and state dict (any architecture in
    ``genfn.models.registry``), its weights in one huge-page arena (``genfn.models.weight_arena``).
    ``tensor_shard``: keep only this rank's slice (see ``load``)."""
    model = _from_state_dict(config, state_dict, dtype=dtype, tokenizer=tokenizer,
                             generation_config=generation_config, source=source, tensor_shard=tensor_shard)
    model.params = place_in_arena(model.params)
    return model


def _from_state_dict(config: dict, state_dict: dict, *, dtype, tokenizer, generation_config, source,
                     tensor_shard=None, sliced: bool = False) -> Model:
    from genfn.config import GenerationConfig

    dtype = _check_dtype(dtype)
    if encoder_decoder.is_encoder_decoder_config(config):
        if tensor_shard is not None:
            _refuse_encoder_decoder()
        return EncoderDecoderModel(**encoder_decoder.family_parts(config, state_dict, dtype), tokenizer=tokenizer,
                                   generation_config=generation_config, config=dict(config), source=source)
    family = registry.native_family(config)
    spec = family.spec_from_config(config)
    if tensor_shard is not None:  # this rank's slice only (genfn.models.tensor_parallel)
        from genfn.models.tensor_parallel import shard_params

        spec, params = shard_params(family, spec, state_dict, tensor_shard, dtype=dtype, sliced=sliced)
    else:
        params = family.params_from_state_dict(spec, state_dict, dtype=dtype)
    if isinstance(generation_config, dict):
        generation_config = GenerationConfig.from_dict(generation_config)
    if generation_config is None:
        generation_config = GenerationConfig.from_model_config(config)
    return Model(spec, params, family.apply, family.init_cache, tokenizer=tokenizer,
                 generation_config=generation_config, config=dict(config), source=source)


def _refuse_encoder_decoder():
    raise ValueError("tensor parallelism supports the decoder-only native families "
                     f"({', '.join(registry.ARCHITECTURES)}); this is an encoder-decoder model")


def _slice_plan(tensor_shard):
    """``config -> plan``: the loaders' ``shard_plan``, so that a rank reads only its slices."""
    def plan(config: dict):
        from genfn.models.tensor_parallel import slice_plan

        if encoder_decoder.is_encoder_decoder_config(config):
            _refuse_encoder_decoder()
        return slice_plan(registry.native_family(config).spec_from_config(config), tensor_shard)
    return plan


def load(path: str | os.PathLike | None = None, *, dtype=torch.float32, quantize: str | None = None,
         tensor_shard=None) -> Model:
    """Load a Hugging Face directory or a GGUF file; ``None`` loads the embedded default (SmolLM2).

    ``tensor_shard`` (a ``genfn.models.tensor_parallel.TensorShard``): read and keep only this
    rank's slice of the weights (the file's other bytes are never read), for tensor parallelism
    over a torch.distributed process group.

    ``quantize``: None (default) loads every weight as ``dtype``; ``"gguf"`` keeps a GGUF file's
    own blocks bit for bit (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants); ``"q8_0" | "q4_0" |
    "q4_1" | "q5_0" | "q5_1" | "int8" | "int4"``
    quantizes the float weights on load. Quantized linears run ``genfn.kernels``' VNNI kernel
    (see ``genfn.models.quantized``); activations stay ``dtype``. ``"coded_bf16"`` (with
    ``dtype=torch.bfloat16``, on a CPU with AVX512_BF16) quantizes nothing: it keeps every linear
    weight bit for bit in 12.2 bits instead of 16 (``genfn.quant.coded_bf16``), so a decode step,
    which waits on memory, reads 0.76x the bytes; tokens are those of the bfloat16 model.
    """
    from genfn import kernels
    from genfn.models.loaders import find_checkpoint_format, load_checkpoint
    from genfn.models.quantized import CODED_BF16, check_quantize, quantize_params

    if path is None:
        from genfn.default_model import default_model_path

        path = default_model_path()
    dtype = _check_dtype(dtype)
    refuse_hub_id(path)
    quantize = check_quantize(quantize)
    if quantize == CODED_BF16 and dtype != torch.bfloat16:
        raise ValueError(f"quantize={CODED_BF16!r} codes bfloat16 weights: load with dtype=torch.bfloat16, got {dtype}")
    shard_plan = None if tensor_shard is None else _slice_plan(tensor_shard)
    # The weights' final place: a GGUF file's kept blocks are written into it as they are read.
    arena = WeightArena()
    if quantize == "gguf":
        from genfn.models.loaders.gguf import load_gguf_checkpoint

        kind, resolved = find_checkpoint_format(path)
        if kind != "gguf":
            raise ValueError(f"quantize='gguf' keeps a GGUF file's blocks, but {path} is a {kind} checkpoint; "
                             "pick a format to quantize to (q8_0, q4_0, q4_1, int8, int4)")
        ckpt = load_gguf_checkpoint(resolved, dtype=dtype, keep_blocks=True, shard_plan=shard_plan, arena=arena)
    elif quantize == CODED_BF16:
        # The floats are read once, to be coded into the arena: left in the file's mapping where
        # they lie there as they are used (no copy into fresh memory, which is what a load waits on).
        ckpt = load_checkpoint(path, dtype=dtype, shard_plan=shard_plan, arena=WeightArena(huge_pages=False))
    else:
        # Weights quantized on load pass through floats that are not kept: only unquantized ones go
        # straight to the arena.
        ckpt = load_checkpoint(path, dtype=dtype, shard_plan=shard_plan, arena=None if quantize else arena)
    model = _from_state_dict(ckpt.config, ckpt.state_dict, dtype=dtype, tokenizer=ckpt.tokenizer,
                             generation_config=ckpt.generation_config, source=ckpt.source, tensor_shard=tensor_shard,
                             sliced=tensor_shard is not None)
    del ckpt
    if quantize is not None:
        if isinstance(model, EncoderDecoderModel):
            raise ValueError(f"quantize={quantize!r} supports the Llama family; {model.spec.architecture} loads "
                             f"unquantized (quantize=None)")
        model.params = quantize_params(model.params, quantize, arena)
    # Last, so the arena holds the weights the steps will read (a quantized model's codes, not
    # floats); what the loader already wrote there stays in place.
    model.params = place_in_arena(model.params, arena)
    # Build (or find) the native kernels now, not in the middle of the first step.
    kernels.quant_linear_available()
    return model


# "owner/name" (optionally "@revision"): what the Hub calls a repository id.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def refuse_hub_id(path) -> None:
    text = os.fspath(path)
    if not os.path.exists(text) and _HUB_ID.match(text):
        raise ValueError(f"{text!r} is not a local path; it looks like a Hugging Face Hub id, and hub downloads are "
                         f"not supported by "
                         f"genfn.load: download it first (e.g. `huggingface-cli download {text} --local-dir "
                         f"./{text.split('/')[-1]}`) and pass the local directory: genfn.load('./{text.split('/')[-1]}')")
