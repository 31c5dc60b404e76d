"""The quantized KV cache: integer keys/values with per-group scales, recent tokens in full precision.

transformers' ``QuantizedCache`` (``cache_implementation="quantized"``, the KIVI-style cache), with
genfn's own quantizer (no quanto/HQQ dependency). Settings come from ``cache_config``:

``nbits`` (2, 4 or 8; default 4), ``q_group_size`` (default 64, or the largest divisor of
``head_dim`` below it; must divide ``head_dim``),
``residual_length`` (default 128), ``axis_key``/``axis_value`` (0 only), ``backend`` ("quanto" or
"hqq", accepted for transformers configs; both select this quantizer).

Storage per layer: the quantized part ``[B, Hkv, Tq, D * nbits / 8]`` (uint8, ``8 / nbits`` codes
per byte) with a float32 scale and zero point (the group minimum) per group of ``q_group_size``
channels of one token and head (asymmetric, ``x ~ code * scale + zero``), followed by the residual
window ``[B, Hkv, Tr, D]`` in the model's dtype. Grouping along the head dimension makes every
token quantizable on its own, so flushing the residual *appends* codes and never re-quantizes old
ones (transformers re-quantizes the whole cache at every flush).

Timeline (the attention sees the same data as transformers' at every step): the newest tokens go
into the residual window; once it holds ``residual_length`` tokens, the next ``advance`` moves all
of them into the quantized part. A prefill at least ``residual_length`` long is attended in full
precision and quantized by the next step, as in transformers; a shorter prompt stays in full
precision until the window fills (transformers quantizes every prompt at once).

``write_layer`` returns the dequantized part followed by the residual, so every step dequantizes
the cache (O(cache), as transformers does). This is a dynamic cache: it runs on the eager path.
"""

from __future__ import annotations

import torch

from genfn.cache.base import CacheBase, end_slots, rows_selected, valid_below
from genfn.cache.dynamic import appended_slots
from genfn.state.base import pytree_dataclass, static_field

__all__ = [
    "ALLOWED_NBITS",
    "QUANTIZED_CONFIG_DEFAULTS",
    "QuantizedCache",
    "dequantize",
    "init_quantized_cache",
    "quantize",
    "validate_quantized_config",
]

ALLOWED_NBITS = (2, 4, 8)
ALLOWED_BACKENDS = ("quanto", "hqq")
QUANTIZED_CONFIG_DEFAULTS = {"backend": "quanto", "nbits": 4, "axis_key": 0, "axis_value": 0, "q_group_size": 64,
                             "residual_length": 128}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_quantized_config(cache_config: dict | None, head_dim: int) -> dict:
    """``cache_config`` completed with the defaults, or a ValueError naming the bad field."""
    config = dict(QUANTIZED_CONFIG_DEFAULTS)
    given = dict(cache_config or {})
    given.pop("config", None)  # transformers puts the model config here; genfn has the spec
    unknown = sorted(set(given) - set(config))
    if unknown:
        raise ValueError(f"cache_config has keys {unknown} that cache_implementation='quantized' does not use; "
                         f"allowed keys: {sorted(config)}")
    config.update({k: v for k, v in given.items() if v is not None})
    if given.get("q_group_size") is None:
        # Unset: transformers' 64, or the largest divisor of head_dim below it.
        config["q_group_size"] = max(d for d in range(1, min(64, head_dim) + 1) if head_dim % d == 0)
    if config["backend"] not in ALLOWED_BACKENDS:
        raise ValueError(f"cache_config['backend'] must be one of {ALLOWED_BACKENDS} (both select genfn's integer "
                         f"quantizer); got {config['backend']!r}")
    if not _is_int(config["nbits"]) or config["nbits"] not in ALLOWED_NBITS:
        raise ValueError(f"cache_config['nbits'] must be one of {ALLOWED_NBITS}; got {config['nbits']!r}")
    for axis in ("axis_key", "axis_value"):
        if config[axis] != 0 or not _is_int(config[axis]):
            raise ValueError(f"cache_config[{axis!r}] must be 0 (groups run along the head dimension of each "
                             f"token); got {config[axis]!r}")
    group = config["q_group_size"]
    if not _is_int(group) or group <= 0 or head_dim % group:
        divisors = [d for d in range(1, head_dim + 1) if head_dim % d == 0]
        raise ValueError(f"cache_config['q_group_size'] must be a positive divisor of the model's head_dim "
                         f"({head_dim}): one of {divisors}; got {group!r}")
    if (head_dim * config["nbits"]) % 8:
        raise ValueError(f"cache_config['nbits'] = {config['nbits']} cannot pack the model's head_dim ({head_dim}) "
                         f"into whole bytes; use nbits=8")
    if not _is_int(config["residual_length"]) or config["residual_length"] < 0:
        raise ValueError(f"cache_config['residual_length'] must be an integer >= 0; got "
                         f"{config['residual_length']!r}")
    return config


def quantize(x: torch.Tensor, nbits: int, group_size: int):
    """``x [..., D]`` -> ``(codes [..., D * nbits / 8] uint8, scale [..., D / g], zero [..., D / g])``.

    Asymmetric min/max quantization per group of ``group_size`` consecutive channels, in float32.
    """
    *lead, dim = x.shape
    groups = x.to(torch.float32).reshape(*lead, dim // group_size, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)
    levels = 2**nbits - 1
    scale = ((hi - lo) / levels).clamp_min(torch.finfo(torch.float32).tiny)
    codes = torch.round((groups - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, levels).to(torch.uint8)
    return _pack(codes.reshape(*lead, dim), nbits), scale, lo


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, nbits: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of ``quantize`` (up to rounding), as ``dtype``."""
    values = _unpack(codes, nbits).to(torch.float32)
    *lead, dim = values.shape
    groups = scale.shape[-1]
    values = values.reshape(*lead, groups, dim // groups) * scale.unsqueeze(-1) + zero.unsqueeze(-1)
    return values.reshape(*lead, dim).to(dtype)


def _shifts(nbits: int, device) -> torch.Tensor:
    return torch.arange(0, 8, nbits, dtype=torch.uint8, device=device)


def _pack(codes: torch.Tensor, nbits: int) -> torch.Tensor:
    if nbits == 8:
        return codes
    per_byte = 8 // nbits
    *lead, dim = codes.shape
    codes = codes.reshape(*lead, dim // per_byte, per_byte)
    return (codes << _shifts(nbits, codes.device)).sum(-1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, nbits: int) -> torch.Tensor:
    if nbits == 8:
        return packed
    mask = (1 << nbits) - 1
    codes = (packed.unsqueeze(-1) >> _shifts(nbits, packed.device)) & mask
    return codes.flatten(-2)


@pytree_dataclass
class QuantizedCache(CacheBase):
    qkeys: torch.Tensor  # [L, B, Hkv, Tq, D * nbits / 8] uint8
    kscale: torch.Tensor  # [L, B, Hkv, Tq, D / q_group_size] float32
    kzero: torch.Tensor  # [L, B, Hkv, Tq, D / q_group_size] float32
    qvalues: torch.Tensor
    vscale: torch.Tensor
    vzero: torch.Tensor
    rkeys: torch.Tensor  # [L, B, Hkv, Tr, D] residual window, full precision
    rvalues: torch.Tensor
    valid: torch.Tensor  # [B, Tq + Tr] bool
    length: torch.Tensor  # [B] int64: each row's next write slot (the capacity for every row)
    nbits: int = static_field(default=4)
    q_group_size: int = static_field(default=64)
    residual_length: int = static_field(default=128)

    @property
    def max_cache_len(self) -> int:
        return self.quantized_len + self.residual_len

    @property
    def quantized_len(self) -> int:
        return self.qkeys.shape[3]

    @property
    def residual_len(self) -> int:
        return self.rkeys.shape[3]

    def slots(self, num_new: int) -> torch.Tensor:
        return end_slots(self.max_cache_len, self.batch_size, num_new, self.valid.device)

    def rewind(self, lengths: torch.Tensor) -> QuantizedCache:
        """Truncate to the longest row (one host read: this cache runs eagerly); mask shorter rows' tails.

        Inside the residual window it is a pointer move on full-precision tokens; below it, whole
        quantized tokens are dropped (codes are per token, nothing is re-quantized)."""
        keep = int(lengths.max()) if lengths.numel() else 0
        valid = valid_below(self.valid[:, :keep], lengths)
        length = torch.full_like(self.length, keep)
        if keep >= self.quantized_len:
            residual = keep - self.quantized_len
            return self.replace(rkeys=self.rkeys[:, :, :, :residual].clone(),
                                rvalues=self.rvalues[:, :, :, :residual].clone(), valid=valid, length=length)
        cut = {name: getattr(self, name)[:, :, :, :keep].clone()
               for name in ("qkeys", "kscale", "kzero", "qvalues", "vscale", "vzero")}
        empty = self.rkeys.narrow(3, 0, 0).clone()
        return self.replace(**cut, rkeys=empty, rvalues=empty.clone(), valid=valid, length=length)

    def with_rows(self, rows, other) -> QuantizedCache:
        raise ValueError("inserting rows into a running batch needs cache_implementation 'static', "
                         "'offloaded_static' or 'dynamic'; the quantized cache does not support it")

    def advance(self, slots: torch.Tensor, new_valid: torch.Tensor) -> QuantizedCache:
        """Flush a full residual window into the quantized part, then make room for the new tokens."""
        cache = self
        if self.residual_len and self.residual_len >= self.residual_length:
            cache = self._flush()
        rkeys, rvalues, valid = appended_slots(cache.rkeys, cache.rvalues, cache.valid, new_valid.to(torch.bool))
        return cache.replace(rkeys=rkeys, rvalues=rvalues, valid=valid,
                             length=torch.full_like(cache.length, cache.max_cache_len + slots.shape[1]))

    def _flush(self) -> QuantizedCache:
        qk, ks, kz = quantize(self.rkeys, self.nbits, self.q_group_size)
        qv, vs, vz = quantize(self.rvalues, self.nbits, self.q_group_size)
        empty = self.rkeys.narrow(3, 0, 0)
        return self.replace(
            qkeys=torch.cat([self.qkeys, qk], dim=3), kscale=torch.cat([self.kscale, ks], dim=3),
            kzero=torch.cat([self.kzero, kz], dim=3),
            qvalues=torch.cat([self.qvalues, qv], dim=3), vscale=torch.cat([self.vscale, vs], dim=3),
            vzero=torch.cat([self.vzero, vz], dim=3),
            rkeys=empty.clone(), rvalues=empty.clone(),
        )

    def write_layer(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store the new tokens in the residual window; return dequantized part + residual."""
        rkeys, rvalues = self.rkeys[layer], self.rvalues[layer]
        num_new = k.shape[2]
        rkeys.narrow(2, rkeys.shape[2] - num_new, num_new).copy_(k)
        rvalues.narrow(2, rvalues.shape[2] - num_new, num_new).copy_(v)
        if self.quantized_len == 0:
            return rkeys, rvalues
        keys = dequantize(self.qkeys[layer], self.kscale[layer], self.kzero[layer], self.nbits, rkeys.dtype)
        values = dequantize(self.qvalues[layer], self.vscale[layer], self.vzero[layer], self.nbits, rvalues.dtype)
        return torch.cat([keys, rkeys], dim=2), torch.cat([values, rvalues], dim=2)

    def reorder(self, beam_idx: torch.Tensor) -> QuantizedCache:
        """Row ``i`` becomes old row ``beam_idx[i]``: codes and scales move as they are (no requantization)."""
        per_row = ("qkeys", "kscale", "kzero", "qvalues", "vscale", "vzero", "rkeys", "rvalues")
        return self.replace(**rows_selected(self, per_row, beam_idx))


def init_quantized_cache(
    num_layers: int,
    batch_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    cache_config: dict | None = None,
) -> QuantizedCache:
    """An empty quantized cache; ``cache_config`` is validated (see the module docstring)."""
    config = validate_quantized_config(cache_config, head_dim)
    nbits, group = config["nbits"], config["q_group_size"]
    lead = (num_layers, batch_size, num_kv_heads, 0)

    def codes():
        return torch.zeros(lead + (head_dim * nbits // 8,), dtype=torch.uint8, device=device)

    def group_params():
        return torch.zeros(lead + (head_dim // group,), dtype=torch.float32, device=device)

    def residual():
        return torch.zeros(lead + (head_dim,), dtype=dtype, device=device)

    return QuantizedCache(
        qkeys=codes(), kscale=group_params(), kzero=group_params(),
        qvalues=codes(), vscale=group_params(), vzero=group_params(),
        rkeys=residual(), rvalues=residual(),
        valid=torch.zeros(batch_size, 0, dtype=torch.bool, device=device),
        length=torch.zeros(batch_size, dtype=torch.int64, device=device),
        nbits=nbits, q_group_size=group, residual_length=config["residual_length"],
    )
