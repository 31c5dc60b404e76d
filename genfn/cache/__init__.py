"""KV caches as pytrees with pure (donating) updates."""

from genfn.cache.static import StaticCache, init_static_cache

__all__ = ["StaticCache", "init_static_cache"]
