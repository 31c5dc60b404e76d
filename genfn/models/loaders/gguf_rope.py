"""Hugging Face ``rope_scaling`` from a GGUF file: llama.cpp's ``{arch}.rope.scaling.*`` keys, and
Phi-3's LongRoPE factors, which llama.cpp keeps as two tensors."""

from __future__ import annotations

from typing import Any

__all__ = ["longrope_scaling", "rope_scaling_from_metadata"]


def longrope_scaling(gguf, arch: str) -> dict[str, Any] | None:
    """Phi-3's LongRoPE: llama.cpp keeps the per-frequency factors as two tensors."""
    if "rope_factors_long.weight" not in gguf.tensors:
        return None
    md = gguf.metadata
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": gguf.tensor("rope_factors_long.weight").tolist(),
        "short_factor": gguf.tensor("rope_factors_short.weight").tolist(),
        "original_max_position_embeddings": int(md.get(f"{arch}.rope.scaling.original_context_length")
                                                or md.get(f"{arch}.context_length")),
    }
    if f"{arch}.rope.scaling.attn_factor" in md:
        scaling["attention_factor"] = float(md[f"{arch}.rope.scaling.attn_factor"])
    return scaling


def rope_scaling_from_metadata(md: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """HF `rope_scaling` from llama.cpp's `{arch}.rope.scaling.*` keys (None when unscaled)."""
    kind = md.get(f"{arch}.rope.scaling.type")
    factor = md.get(f"{arch}.rope.scale_linear") or md.get(f"{arch}.rope.scaling.factor")
    if kind is None and factor is not None:
        kind = "linear"
    if kind in (None, "none") or (factor in (None, 1.0) and kind == "linear"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor or 1.0)}
    original = md.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for gguf_key, hf_key in (("attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                             ("yarn_beta_slow", "beta_slow")):
        if f"{arch}.rope.scaling.{gguf_key}" in md:
            scaling[hf_key] = float(md[f"{arch}.rope.scaling.{gguf_key}"])
    return scaling
