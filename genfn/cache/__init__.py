"""KV caches as pytrees with pure (donating) updates: static, dynamic, offloaded, offloaded_static, quantized.

``make_cache(cache_implementation, spec, batch_size, max_cache_len, dtype, device, cache_config)``
builds one; ``genfn.cache.base`` describes the interface they all share.
"""

from genfn.cache.dynamic import DynamicCache, init_dynamic_cache
from genfn.cache.factory import (
           CACHE_IMPLEMENTATIONS,
           COMPILABLE_CACHE_IMPLEMENTATIONS,
           make_cache,
)
from genfn.cache.offloaded import OffloadedCache, init_offloaded_cache
from genfn.cache.offloaded_static import (
           OffloadedStaticCache,
           init_offloaded_static_cache,
)
from genfn.cache.quantized import QuantizedCache, init_quantized_cache
from genfn.cache.static import StaticCache, init_static_cache

__all__ = [
           "CACHE_IMPLEMENTATIONS",
           "COMPILABLE_CACHE_IMPLEMENTATIONS",
           "DynamicCache",
           "OffloadedCache",
           "OffloadedStaticCache",
           "QuantizedCache",
           "StaticCache",
           "init_dynamic_cache",
           "init_offloaded_cache",
           "init_offloaded_static_cache",
           "init_quantized_cache",
           "init_static_cache",
           "make_cache",
]
