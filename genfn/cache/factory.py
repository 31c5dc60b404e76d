"""``make_cache``: a cache from transformers' ``cache_implementation`` and ``cache_config``."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from genfn.cache.base import default_copy
from genfn.cache.dynamic import init_dynamic_cache
from genfn.cache.offloaded import init_offloaded_cache
from genfn.cache.offloaded_static import init_offloaded_static_cache
from genfn.cache.quantized import init_quantized_cache
from genfn.cache.static import init_static_cache
from genfn.config.caches import CACHE_IMPLEMENTATIONS, DEPRECATED_CACHE_IMPLEMENTATIONS
from genfn.config.caches import COMPILABLE_CACHES as COMPILABLE_CACHE_IMPLEMENTATIONS

__all__ = [
    "CACHE_IMPLEMENTATIONS",
    "COMPILABLE_CACHE_IMPLEMENTATIONS",
    "DEPRECATED_CACHE_IMPLEMENTATIONS",
    "make_cache",
    "resolve_cache_implementation",
]

_OFFLOAD_KEYS = ("offload_device",)
_CONFIG_KEYS = {"dynamic": (), "static": (), "offloaded": _OFFLOAD_KEYS, "offloaded_static": _OFFLOAD_KEYS}


def resolve_cache_implementation(implementation: str | None) -> str:
    """The canonical name: None -> "dynamic" (transformers' default); deprecated names mapped with a warning."""
    if implementation is None:
        return "dynamic"
    if implementation in CACHE_IMPLEMENTATIONS:
        return implementation
    if implementation in DEPRECATED_CACHE_IMPLEMENTATIONS:
        target = DEPRECATED_CACHE_IMPLEMENTATIONS[implementation]
        warnings.warn(f"cache_implementation={implementation!r} is deprecated (as in transformers); using "
                      f"{target!r}, which handles sliding-window layers itself", FutureWarning, stacklevel=3)
        return target
    if implementation == "paged":
        raise ValueError("cache_implementation='paged' is the continuous-batching cache: it is used by "
                         "generate_batch / the batching manager, not by generate's strategies; choose one of "
                         f"{CACHE_IMPLEMENTATIONS}")
    raise ValueError(f"unknown cache_implementation {implementation!r}; valid implementations: "
                     f"{CACHE_IMPLEMENTATIONS} (deprecated, mapped: {tuple(DEPRECATED_CACHE_IMPLEMENTATIONS)})")


def _check_config_keys(implementation: str, cache_config: dict) -> None:
    allowed = _CONFIG_KEYS[implementation]
    unknown = sorted(set(cache_config) - set(allowed))
    if unknown:
        hint = ""
        if "max_cache_len" in unknown:
            hint = " (set the cache size with GenerationConfig.max_cache_len)"
        raise ValueError(f"cache_config has keys {unknown} that cache_implementation={implementation!r} does not "
                         f"use; allowed keys: {list(allowed)}{hint}")


def make_cache(
    implementation: str | None,
    spec: Any,
    batch_size: int,
    max_cache_len: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    cache_config: dict | None = None,
):
    """A fresh cache for a model described by ``spec`` (``num_layers``, ``num_kv_heads``, ``head_dim``).

    ``implementation`` is ``GenerationConfig.cache_implementation`` (None: "dynamic"). Dynamic caches
    ignore ``max_cache_len`` (they grow); static ones allocate it. ``cache_config`` holds the
    implementation's settings: the quantized cache's (see ``genfn.cache.quantized``) or the
    offloaded caches' ``offload_device`` (default "cpu"); unknown keys raise a ValueError.
    """
    implementation = resolve_cache_implementation(implementation)
    if cache_config is not None and not isinstance(cache_config, dict):
        raise ValueError(f"cache_config must be a dict, got {type(cache_config).__name__}")
    cache_config = dict(cache_config or {})
    dims = (spec.num_layers, batch_size, spec.num_kv_heads)
    if implementation == "quantized":
        return init_quantized_cache(*dims, spec.head_dim, dtype=dtype, device=device, cache_config=cache_config)
    _check_config_keys(implementation, cache_config)
    if implementation == "dynamic":
        return init_dynamic_cache(*dims, spec.head_dim, dtype=dtype, device=device)
    if implementation in COMPILABLE_CACHE_IMPLEMENTATIONS and not (
            isinstance(max_cache_len, int) and not isinstance(max_cache_len, bool) and max_cache_len >= 1):
        raise ValueError(f"max_cache_len must be an integer >= 1 for cache_implementation={implementation!r}; "
                         f"got {max_cache_len!r}")
    if implementation == "static":
        return init_static_cache(*dims, max_cache_len, spec.head_dim, dtype=dtype, device=device)
    offload_device = cache_config.get("offload_device", "cpu")
    try:
        offload_device = torch.device(offload_device)
    except (RuntimeError, TypeError):
        raise ValueError(f"cache_config['offload_device'] must name a torch device (e.g. 'cpu'); "
                         f"got {offload_device!r}") from None
    if implementation == "offloaded":
        return init_offloaded_cache(*dims, spec.head_dim, dtype=dtype, device=device,
                                    offload_device=offload_device, copy_fn=default_copy)
    return init_offloaded_static_cache(*dims, max_cache_len, spec.head_dim, dtype=dtype, device=device,
                                       offload_device=offload_device, copy_fn=default_copy)
