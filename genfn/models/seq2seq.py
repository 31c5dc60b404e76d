"""The layers the native encoder-decoder families (T5, BART) share: the encoder output, the
attention masks, the attention itself, activations and state-dict helpers.

A family module provides pure functions over ``(spec, params)``:

``encode(spec, params, input_ids [B, S], attention_mask [B, S], *, output_hidden_states, output_attentions)``
    -> ``EncoderOutput`` (run once per generation, in the strategy's ``init``);
``cross_attention_kv(spec, params, encoder_hidden [B, S, d])`` -> ``(K, V)`` ``[L, B, H, S, D]``
    (the cross-attention keys/values of every decoder layer, also computed once);
``apply(spec, params, tokens, positions, cache, attention_mask=None, *, logits_to_keep, attend_len,
output_hidden_states, output_attentions)``
    the decoder, with the llama ``apply`` signature; ``cache`` is an ``EncoderDecoderCache``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = ["EncoderOutput", "DecoderOutput", "causal_mask", "padding_mask", "attend",
           "activation", "split_heads", "merge_heads", "get_tensor", "check_shape"]


@dataclasses.dataclass
class EncoderOutput:
    last_hidden_state: torch.Tensor  # [B, S, d]
    hidden_states: tuple[torch.Tensor, ...] | None = None  # embeddings + every layer (last one normed)
    attentions: tuple[torch.Tensor, ...] | None = None  # [B, H, S, S] per layer


@dataclasses.dataclass
class DecoderOutput:
    """What the decoder's ``apply`` returns when hidden states or attentions are asked for."""

    logits: torch.Tensor
    cache: Any
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    cross_attentions: tuple[torch.Tensor, ...] | None = None


def causal_mask(cache, slots: torch.Tensor, attend_len: int) -> torch.Tensor:
    """Boolean ``[B, 1, S, attend_len]``: query ``i`` of row ``b`` (at slot ``slots[b, i]``) sees the
    filled slots up to its own. A query always sees its own slot, so a padding query's softmax
    stays finite (its output is never read)."""
    j = torch.arange(attend_len, device=slots.device).view(1, 1, attend_len)
    query_slots = slots.unsqueeze(2)
    mask = (j <= query_slots) & cache.valid[:, :attend_len].unsqueeze(1)
    return (mask | (j == query_slots)).unsqueeze(1)


def padding_mask(valid: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, 1, 1, S]``: every query may see the real (non-padding) keys."""
    return valid.to(torch.bool)[:, None, None, :]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scale: float,
           bias: torch.Tensor | None = None, want_weights: bool = False):
    """Softmax attention of ``q [B, H, S, D]`` over ``k, v [B, H, T, D]`` with ``mask`` (bool,
    broadcast to ``[B, H, S, T]``) and an additive ``bias``; softmax in float32, as transformers'
    eager attention. Returns ``(out [B, H, S, D], weights or None)``."""
    scores = torch.matmul(q, k.transpose(-1, -2))
    if scale != 1.0:
        scores = scores * scale
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(weights, v), (weights if want_weights else None)


_ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}") from None


def split_heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """``[B, S, H * D]`` -> ``[B, H, S, D]``."""
    batch, seq = x.shape[0], x.shape[1]
    return x.view(batch, seq, num_heads, head_dim).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` -> ``[B, S, H * D]``."""
    batch, heads, seq, dim = x.shape
    return x.transpose(1, 2).reshape(batch, seq, heads * dim)


def get_tensor(state_dict, *names: str, dtype=None) -> torch.Tensor:
    """The first of ``names`` present in ``state_dict`` (tied weights are saved under one name)."""
    for name in names:
        if name in state_dict:
            tensor = state_dict[name]
            return tensor if dtype is None else tensor.to(dtype)
    raise ValueError(f"checkpoint is missing the tensor {names[0]!r}")


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {list(tensor.shape)}, but the config implies {list(shape)}")
    return tensor



