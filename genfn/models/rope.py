"""Rotary position embeddings: inverse frequencies per rope type, and their application."""

from __future__ import annotations

import math

import torch

from genfn.kernels.invariant import batch_invariant

__all__ = ["inverse_frequencies", "long_inverse_frequencies", "attention_factor", "rope_cos_sin", "apply_rope",
           "SUPPORTED_ROPE_TYPES"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def inverse_frequencies(head_dim: int, theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """float32 ``[head_dim // 2]`` inverse frequencies, scaled as ``rope_scaling`` says."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, rope_scaling)
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(head_dim, theta, rope_scaling)
    if rope_type == "longrope":  # the short factors: what a forward within the original context uses
        return _longrope_inverse_frequencies(head_dim, theta, rope_scaling["short_factor"])
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's scheme: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def long_inverse_frequencies(head_dim: int, theta: float, rope_scaling: dict | None) -> torch.Tensor | None:
    """LongRoPE's long-context inverse frequencies (None for every other rope type)."""
    if (rope_scaling or {}).get("rope_type") != "longrope":
        return None
    return _longrope_inverse_frequencies(head_dim, theta, rope_scaling["long_factor"])


def attention_factor(rope_scaling: dict | None, max_position_embeddings: int) -> float:
    """The factor YaRN and LongRoPE multiply cos and sin by (1.0 for the other rope types)."""
    scaling = rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original
    if kind == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inverse_frequencies(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: interpolated (divided by ``factor``) below a band of dimensions, extrapolated (kept)
    above it, a linear ramp across the band set by ``beta_fast``/``beta_slow`` rotations."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension_of(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def _longrope_inverse_frequencies(dim: int, theta: float, factors) -> torch.Tensor:
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**shape)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0,
                 long_inv_freq: torch.Tensor | None = None, original_context: int = 0,
                 furthest: torch.Tensor | None = None):
    """cos, sin ``[B, S, rotary_dim]`` for integer ``positions [B, S]``, computed in float32.

    ``scale`` multiplies both (YaRN's and LongRoPE's attention factor). With ``long_inv_freq``
    (LongRoPE), a forward whose furthest position lies past ``original_context`` rotates every
    position by the long factors, as transformers decides per forward (a tensor choice: no sync).
    ``furthest`` (shaped as ``positions``): each position's own "furthest position of its forward"
    instead, for a packed batch of many requests, each of which decides for itself."""
    if long_inv_freq is not None:
        furthest = positions.max() if furthest is None else furthest.unsqueeze(-1)
        inv_freq = torch.where(furthest + 1 > original_context, long_inv_freq, inv_freq)
    if batch_invariant():
        # Inductor's cos/sin are not eager's to the last bit (5.96e-8 apart): in the mode the
        # compiled step calls the eager ones, so eager and compiled rotate alike.
        cos, sin = eager_cos_sin(inv_freq, positions, float(scale))
    else:
        cos, sin = _cos_sin(inv_freq, positions, scale)
    return cos.to(dtype), sin.to(dtype)


def _cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scale: float):
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin


@torch.library.custom_op("genfn_invariant::eager_cos_sin", mutates_args=())
def eager_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_cos_sin``'s float32 cos and sin as an op ``torch.compile`` does not look into."""
    return _cos_sin(inv_freq, positions, scale)


@eager_cos_sin.register_fake
def _(inv_freq, positions, scale):
    shape = (*positions.shape, 2 * inv_freq.shape[-1])
    return positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, S, D]`` by ``cos, sin [B, S, R]``: all of ``D`` when ``R == D``, else (partial
    rotary, Phi-4-mini) its first ``R`` dimensions, the rest passing through."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary = cos.shape[-1]
    if rotary != x.shape[-1]:
        head, tail = x[..., :rotary], x[..., rotary:]
        return torch.cat((head * cos + _rotate_half(head) * sin, tail), dim=-1)
    return x * cos + _rotate_half(x) * sin
