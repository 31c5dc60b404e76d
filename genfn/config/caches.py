"""Cache-implementation names, defined once for the config's validation and the cache factory.

The names and their grouping follow transformers v5, so a ``generation_config.json`` naming any of
them loads in both libraries.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = [
    "CACHE_IMPLEMENTATIONS",
    "COMPILABLE_CACHES",
    "STATIC_CACHE_IMPLEMENTATIONS",
    "DYNAMIC_CACHE_IMPLEMENTATIONS",
    "DEPRECATED_CACHE_IMPLEMENTATIONS",
    "DEPRECATED_STATIC_CACHE_IMPLEMENTATIONS",
    "ALL_STATIC_CACHE_IMPLEMENTATIONS",
    "ALL_CACHE_IMPLEMENTATIONS",
    "VALID_CACHE_IMPLEMENTATIONS",
]

# The caches genfn builds (genfn.cache.factory), in the order its error messages list them.
CACHE_IMPLEMENTATIONS = ("dynamic", "static", "offloaded", "offloaded_static", "quantized")
# Preallocated to max_cache_len, so one compiled decode step serves every step.
COMPILABLE_CACHES = ("static", "offloaded_static")
STATIC_CACHE_IMPLEMENTATIONS = COMPILABLE_CACHES
DYNAMIC_CACHE_IMPLEMENTATIONS = tuple(name for name in CACHE_IMPLEMENTATIONS if name not in COMPILABLE_CACHES)
# Accepted for files written by older transformers, which built its static cache (offloaded when
# the name says so) for them; the layer types are now inferred from the model. Old name -> the
# implementation that replaces it.
DEPRECATED_CACHE_IMPLEMENTATIONS: Mapping[str, str] = MappingProxyType(
    {
        "sliding_window": "static",
        "hybrid": "static",
        "hybrid_chunked": "static",
        "offloaded_hybrid": "offloaded_static",
        "offloaded_hybrid_chunked": "offloaded_static",
    }
)
DEPRECATED_STATIC_CACHE_IMPLEMENTATIONS = tuple(DEPRECATED_CACHE_IMPLEMENTATIONS)
ALL_STATIC_CACHE_IMPLEMENTATIONS = STATIC_CACHE_IMPLEMENTATIONS + DEPRECATED_STATIC_CACHE_IMPLEMENTATIONS
ALL_CACHE_IMPLEMENTATIONS = ALL_STATIC_CACHE_IMPLEMENTATIONS + DYNAMIC_CACHE_IMPLEMENTATIONS
# "paged" is valid too: it routes `generate` to continuous batching.
VALID_CACHE_IMPLEMENTATIONS = ALL_CACHE_IMPLEMENTATIONS + ("paged",)
