"""The architecture registry: which native family implements a Hugging Face architecture.

A family is a module with ``spec_from_config(config)``, ``params_from_state_dict(spec, state_dict,
dtype)``, ``apply`` and ``init_cache``. Adding a native family is one entry in ``ARCHITECTURES``
(and, for configs without ``architectures``, one in ``MODEL_TYPES``). Architectures with no entry
load through transformers and ``genfn.from_module`` instead.

A family that runs in continuous batching declares its *packed forward* in ``PACKED_FORWARDS``:
the module (keyed by the module that defines the family's spec class) with
``apply_packed(spec, params, inputs, cache, plan=None) -> (logits [R, V], cache)`` over the paged
cache (``genfn.batching.inputs.BatchInputs``, ``genfn.cache.paged``), ``init_packed_cache(spec,
num_blocks, block_size, dtype=, device=)`` and ``pack_params(params)`` (the eager forward's weights,
e.g. prepacked for the GEMM; return ``params`` when nothing is to be done); ``COMPILES = False``
when the forward must run eagerly (the batching manager then never compiles it). The cache has
``copy_blocks(pairs)`` (a forked beam's partial block) and ``clear_blocks(blocks)`` (a failed
request's), each in place, returning the cache.
``packed_forward(model)`` finds it; the batching manager refuses a model whose family has none.

A family may declare ``step_params(spec, params)``: the params as generate's steps read them (eager
and compiled), with values derived from them once instead of every step (Llama: the native decode
stack's table of weights). ``step_params(spec, params)`` here applies it.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, Mapping

__all__ = ["ARCHITECTURES", "MODEL_TYPES", "PACKED_FORWARDS", "architecture_of", "native_family", "family_or_none",
           "packed_forward", "step_params"]

# Hugging Face architecture name -> the genfn module implementing it.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "genfn.models.llama",
    "MistralForCausalLM": "genfn.models.llama",
    "Qwen2ForCausalLM": "genfn.models.llama",
    "Qwen3ForCausalLM": "genfn.models.llama",
    "SmolLM3ForCausalLM": "genfn.models.llama",
    "Olmo2ForCausalLM": "genfn.models.llama",
    "Phi3ForCausalLM": "genfn.models.llama",
    "Qwen3MoeForCausalLM": "genfn.models.llama",
    "MixtralForCausalLM": "genfn.models.llama",
    "OlmoeForCausalLM": "genfn.models.llama",
    "Gemma2ForCausalLM": "genfn.models.gemma",
    "Gemma3ForCausalLM": "genfn.models.gemma",
    "GptOssForCausalLM": "genfn.models.gpt_oss",
}

# config.json ``model_type`` -> architecture, for configs that name no architecture.
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}

# The module of a family's spec class -> the module holding its packed forward over the paged cache.
PACKED_FORWARDS: dict[str, str] = {
    "genfn.models.llama": "genfn.models.packed",  # Llama, Mistral (sliding window), Qwen2 (q/k/v bias), LongRoPE
    "genfn.models.gemma": "genfn.models.gemma_packed",  # Gemma 2 / Gemma 3 (text)
    "genfn.models.gpt_oss": "genfn.models.gpt_oss_packed",  # GPT-OSS (sinks: the reference attention paths)
    "genfn.models.adapter": "genfn.models.module_packed",  # any wrapped module: a key/value slot per request
}


def packed_forward(model) -> ModuleType | None:
    """The packed-forward module of ``model``'s family (see the module docstring), or None."""
    name = PACKED_FORWARDS.get(type(getattr(model, "spec", None)).__module__)
    return None if name is None else importlib.import_module(name)


def step_params(spec, params):
    """``params`` as generate's steps read them: the ``step_params`` of the family that defines
    ``spec``'s class (see the module docstring), else ``params`` as they are."""
    prepare = getattr(sys.modules.get(type(spec).__module__), "step_params", None)
    return params if prepare is None else prepare(spec, params)


def architecture_of(config: Mapping[str, Any]) -> str | None:
    """The first of the config's architectures genfn implements natively, else its first one (or
    the one its ``model_type`` implies); None when the config names neither."""
    archs = list(config.get("architectures") or [])
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    if archs:
        return archs[0]
    return MODEL_TYPES.get(config.get("model_type"))


def family_or_none(config: Mapping[str, Any]) -> ModuleType | None:
    """The native family module for ``config``, or None when genfn has none."""
    arch = architecture_of(config)
    if arch not in ARCHITECTURES:
        return None
    return importlib.import_module(ARCHITECTURES[arch])


def native_family(config: Mapping[str, Any]) -> ModuleType:
    """The native family module for ``config``; a ValueError naming the supported ones otherwise."""
    family = family_or_none(config)
    if family is None:
        found = config.get("architectures") or [config.get("model_type")]
        raise ValueError(f"unsupported architecture {found}; native architectures: {', '.join(ARCHITECTURES)} "
                         f"(others load through transformers: genfn.load(directory) or genfn.from_module(module))")
    return family
