"""Explicit, counter-based randomness.

A key is an int64 tensor ``[..., 2]`` holding two 32-bit words. Noise is a pure hash of
(key, counter, index): the noise a row sees depends only on its own key, the decoding step and
the vocabulary index, never on batch size, batch position, device or what else runs. That is
what makes a sampled request reproduce to the token alone or batched, eager or compiled.

All arithmetic is on int64 lanes that hold values in ``[0, 2**32)``, and every product is kept
below ``2**63``: compiled C++ treats signed overflow as undefined behaviour, so relying on
wrap-around would make eager and compiled noise differ.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["key", "fold_in", "split", "random_bits", "uniform", "gumbel", "as_row_keys"]

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``x`` in ``[0, 2**32)`` without leaving int64's range."""
    lo, hi = c & _MASK16, c >> 16
    return (x * lo + (((x * hi) & _MASK16) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche permutation (the "lowbias32" finalizer)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _as_int64(data, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        data = torch.tensor(data, dtype=torch.int64, device=like.device)
    return data.to(torch.int64) & _MASK32


def key(seed: int) -> torch.Tensor:
    """A fresh key from an integer seed (any Python int; 64 bits are used).

    A key is an int64 tensor of two 32-bit words; the same seed always gives the same key.

    >>> k = key(0)
    >>> k.shape, k.dtype
    (torch.Size([2]), torch.int64)
    >>> bool((key(0) == k).all()), bool((key(1) == k).all())
    (True, False)
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    seed &= (1 << 64) - 1
    words = torch.tensor([seed & _MASK32, seed >> 32], dtype=torch.int64)
    a = _mix32(words[0] ^ _mix32(words[1] + 0x3C6EF372 & _MASK32))
    b = _mix32(words[1] ^ _mix32(a + _GOLDEN & _MASK32))
    return torch.stack([a, b])


def fold_in(key: torch.Tensor, data) -> torch.Tensor:
    """A new key from ``key`` and integer ``data`` (broadcasts: ``key [..., 2]`` with ``data [...]``)."""
    data = _as_int64(data, key)
    k0, k1 = key[..., 0], key[..., 1]
    a = _mix32(k0 ^ _mix32((data + _GOLDEN) & _MASK32))
    b = _mix32(k1 ^ _mix32((a + data * 0 + 0x85EBCA6B) & _MASK32))
    a, b = torch.broadcast_tensors(a, b)
    return torch.stack([a, b], dim=-1)


def split(key: torch.Tensor, num: int = 2) -> torch.Tensor:
    """``num`` independent keys ``[num, 2]`` derived from ``key``.

    >>> keys = split(key(0), 3)
    >>> keys.shape, len({tuple(k.tolist()) for k in keys})
    (torch.Size([3, 2]), 3)
    """
    return fold_in(key.unsqueeze(0), torch.arange(num, device=key.device) + 0x51ED27)


def as_row_keys(key: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Per-row keys ``[B, 2]``: one key means row ``i`` uses ``fold_in(key, i)``; ``[B, 2]`` is kept.

    So a row's noise depends on its key and its index alone, not on the batch around it:

    >>> rows = as_row_keys(key(7), 4)
    >>> bool((rows[2] == fold_in(key(7), 2)).all())
    True
    >>> bool((as_row_keys(rows, 4) == rows).all())
    True
    """
    if not isinstance(key, torch.Tensor) or key.dtype != torch.int64 or key.shape[-1:] != (2,):
        raise TypeError("key must be a genfn key: an int64 tensor of shape [2] or [batch, 2] "
                        "(make one with genfn.random.key(seed))")
    if key.dim() == 1:
        return fold_in(key.unsqueeze(0), torch.arange(batch_size, device=key.device))
    if key.dim() == 2 and key.shape[0] == batch_size:
        return key
    raise ValueError(f"key must have shape [2] or [{batch_size}, 2] for a batch of {batch_size}, "
                     f"got {list(key.shape)}")


def _mix32_uint32(x: np.ndarray) -> np.ndarray:
    """``_mix32`` on uint32 lanes, where wrap-around multiplication is defined (numpy)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def _eager_on_host(*tensors: torch.Tensor) -> bool:
    """Plain CPU tensors outside any trace or transform: safe to hand to numpy."""
    if torch.compiler.is_compiling():
        return False
    return all(type(t) is torch.Tensor and t.device.type == "cpu" and not t.requires_grad
               and not torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)


def _index_bits_uint32(row_a: torch.Tensor, row_b: torch.Tensor, size: int) -> np.ndarray:
    # The eager path of the per-vocabulary-entry hash: on uint32 lanes a multiply is one op
    # instead of int64's six, which makes eager sampling over a 49k vocabulary ~30x cheaper.
    a = row_a.numpy().astype(np.uint32)
    b = row_b.numpy().astype(np.uint32)
    index = np.arange(size, dtype=np.uint32)
    return _mix32_uint32(_mix32_uint32(index ^ a) ^ b)


def _row_words(keys: torch.Tensor, counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    counter = counter.to(torch.int64) & _MASK32
    row_a = _mix32(keys[:, 0] ^ _mix32((counter + 0x2545F491) & _MASK32)).unsqueeze(1)
    row_b = _mix32(keys[:, 1] ^ _mix32((counter * 0 + row_a.squeeze(1) + _GOLDEN) & _MASK32)).unsqueeze(1)
    return row_a, row_b


def random_bits(keys: torch.Tensor, counter: torch.Tensor, size: int) -> torch.Tensor:
    """32 random bits ``[B, size]`` (int64) for rows ``keys [B, 2]`` at step ``counter [B]``."""
    row_a, row_b = _row_words(keys, counter)
    if _eager_on_host(row_a, row_b):
        return torch.from_numpy(_index_bits_uint32(row_a, row_b, size).astype(np.int64))
    return _index_bits(row_a, row_b, size)


def _index_bits(row_a: torch.Tensor, row_b: torch.Tensor, size: int) -> torch.Tensor:
    index = torch.arange(size, device=row_a.device, dtype=torch.int64)
    return _mix32(_mix32(index ^ row_a) ^ row_b)


def uniform(keys: torch.Tensor, counter: torch.Tensor, size: int) -> torch.Tensor:
    """Uniform float32 noise in the open interval (0, 1), ``[B, size]``.

    24 bits of the hash, centred in their bucket: exactly representable, never 0 or 1.
    """
    row_a, row_b = _row_words(keys, counter)
    if _eager_on_host(row_a, row_b):  # the same float32 operations, each exact, on the host path
        bits = _index_bits_uint32(row_a, row_b, size) >> np.uint32(8)
        return torch.from_numpy((bits.astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / (1 << 24)))
    bits = _index_bits(row_a, row_b, size) >> 8
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def gumbel(keys: torch.Tensor, counter: torch.Tensor, size: int) -> torch.Tensor:
    """Standard Gumbel noise ``[B, size]`` (float32): ``argmax(logits + gumbel)`` samples softmax(logits).

    The logs run in float64 and round once to float32, so the 1-ulp differences between eager
    and vectorized compiled ``log`` kernels vanish in the rounding: eager and compiled draw the
    same noise bit for bit.
    """
    # The top bucket's centre, 1 - 2**-25, rounds to 1.0 in float32, where the noise would be +inf
    # (and -inf + inf = NaN would pick a token a mask or top-k had ruled out): it is kept just below 1.
    u = uniform(keys, counter, size).to(torch.float64).clamp(max=1.0 - 2.0**-25)
    return (-torch.log(-torch.log(u))).to(torch.float32)
