"""Logits processors: pure functions of (logits, LogitsContext)."""

from genfn.processors.context import LogitsContext

__all__ = ["LogitsContext"]
