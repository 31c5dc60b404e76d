"""``Model``: a model as a value (static spec + params pytree + pure apply), plus conveniences.

A ``Model`` bundles what a checkpoint brings: the spec, the params, the pure ``apply`` function,
the tokenizer and the generation defaults. Its methods are thin: ``model.apply(...)`` is
``apply_fn(spec, params, ...)`` and ``model.generate(...)`` is ``genfn.generate(model, ...)``.
The only thing a Model keeps besides its value is the table of compiled steps, which belongs to
the model because the compiled code closes over its weights.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from genfn.models import llama
from genfn.models.functional import FunctionalModel

__all__ = ["Model", "load", "from_hf_state_dict"]


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

    @property
    def dtype(self) -> torch.dtype:
        return self.params["embed"].dtype

    @property
    def device(self) -> torch.device:
        return self.params["embed"].device

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def max_position_embeddings(self) -> int | None:
        return getattr(self.spec, "max_position_embeddings", None)

    def apply(self, tokens, positions, cache, attention_mask=None, **kwargs):
        return self.apply_fn(self.spec, self.params, tokens, positions, cache, attention_mask, **kwargs)

    def functional(self) -> FunctionalModel:
        """The value a step function receives (eager and compiled alike): spec, params, apply."""
        return FunctionalModel(self.spec, self.params, self.apply_fn)

    def init_cache(self, batch_size: int, max_cache_len: int, implementation: str | None = "static",
                   cache_config: dict | None = None):
        """A fresh cache; ``implementation`` as ``GenerationConfig.cache_implementation`` (None: "dynamic")."""
        if implementation == "static" and not cache_config:
            return self.init_cache_fn(self.spec, batch_size, max_cache_len, dtype=self.dtype, device=self.device)
        from genfn.cache.factory import make_cache

        return make_cache(implementation, self.spec, batch_size, max_cache_len, dtype=self.dtype,
                          device=self.device, cache_config=cache_config)

    def generate(self, input_ids=None, generation_config=None, **kwargs):
        from genfn.generation import generate

        return generate(self, input_ids, generation_config, **kwargs)

    # Continuous batching (transformers' ContinuousMixin); imported on use so models/ does not
    # depend on the batching package.
    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, workload_hints=None,
                                 **manager_options):
        from genfn.batching.api import init_continuous_batching

        return init_continuous_batching(self, generation_config, continuous_batching_config, workload_hints,
                                        **manager_options)

    def continuous_batching_context_manager(self, generation_config=None, block=True, timeout=None,
                                            continuous_batching_config=None, persistent_manager=False, warmup=True,
                                            workload_hints=None, **manager_options):
        from genfn.batching.api import continuous_batching_context_manager

        return continuous_batching_context_manager(self, generation_config, block, timeout, continuous_batching_config,
                                                   persistent_manager, warmup, workload_hints, **manager_options)

    def generate_batch(self, inputs, generation_config=None, continuous_batching_config=None, record_timestamps=False,
                       progress_bar=False, persistent_manager=False, warmup=True, **kwargs):
        from genfn.batching.api import generate_batch

        return generate_batch(self, inputs, generation_config, continuous_batching_config, record_timestamps,
                              progress_bar, persistent_manager, warmup, **kwargs)

    def destroy_cached_continuous_batching_manager(self) -> None:
        from genfn.batching.api import destroy_cached_continuous_batching_manager

        destroy_cached_continuous_batching_manager(self)

    def compute_transition_scores(self, sequences, scores, beam_indices=None, normalize_logits=False):
        from genfn.scores import compute_transition_scores

        return compute_transition_scores(sequences, scores, beam_indices, normalize_logits)

    def __repr__(self) -> str:
        return f"Model({self.spec!r}, dtype={self.dtype}, source={self.source!r})"


def _check_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype, dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be one of float32, bfloat16, float16; got {dtype!r}")
    return dtype


def from_hf_state_dict(config: dict, state_dict: dict, *, dtype=torch.float32, tokenizer=None,
                       generation_config=None, source: str | None = None) -> Model:
    """A native ``Model`` from a Hugging Face config dict and state dict (any supported architecture)."""
    from genfn.config import GenerationConfig

    dtype = _check_dtype(dtype)
    spec = llama.spec_from_config(config)
    params = llama.params_from_state_dict(spec, state_dict, dtype=dtype)
    if isinstance(generation_config, dict):
        generation_config = GenerationConfig.from_dict(generation_config)
    if generation_config is None:
        generation_config = GenerationConfig.from_model_config(config)
    return Model(spec, params, llama.apply, llama.init_cache, tokenizer=tokenizer,
                 generation_config=generation_config, config=dict(config), source=source)


def load(path: str | os.PathLike | None = None, *, dtype=torch.float32) -> Model:
    """Load a Hugging Face directory or a GGUF file; ``None`` loads the embedded default (SmolLM2)."""
    from genfn.models.loaders import load_checkpoint

    if path is None:
        from genfn.default_model import default_model_path

        path = default_model_path()
    dtype = _check_dtype(dtype)
    ckpt = load_checkpoint(path, dtype=dtype)
    return from_hf_state_dict(ckpt.config, ckpt.state_dict, dtype=dtype, tokenizer=ckpt.tokenizer,
                              generation_config=ckpt.generation_config, source=ckpt.source)
