"""The cache of an encoder-decoder model: the decoder's self-attention cache plus the cross-attention
keys/values, which are computed once from the encoder output and then only read.

``EncoderDecoderCache`` speaks the same cache protocol as the caches it wraps (``slots``,
``advance``, ``write_layer``, ``rewind``, ``reorder``, ``with_rows``, ``valid``, ``length``), so the
decoder-only strategies carry it in their state unchanged: it is the field of the decode state where
the encoder's contribution lives. The self-attention part is any genfn cache (static or dynamic per
``cache_implementation``).
"""

from __future__ import annotations

from typing import Any

import torch

from genfn.cache.base import CacheBase, as_device, as_row_index
from genfn.state.base import pytree_dataclass

__all__ = ["EncoderDecoderCache"]


@pytree_dataclass
class EncoderDecoderCache(CacheBase):
    self_attention: Any  # the decoder's self-attention cache (StaticCache, DynamicCache, ...)
    cross_keys: torch.Tensor  # [L, B, H, S_enc, D]
    cross_values: torch.Tensor  # [L, B, H, S_enc, D]
    encoder_valid: torch.Tensor  # [B, S_enc] bool: real encoder tokens (cross-attention may see them)
    # What the encoder reported, kept for the output (None unless output_hidden_states/attentions).
    encoder_hidden_states: tuple | None = None
    encoder_attentions: tuple | None = None
    # output_attentions: the decoder's latest cross-attention maps per layer ([B, H, 1, S_enc]),
    # which the decoder writes here, and the prefill's, which steps carry unchanged.
    cross_attentions: tuple | None = None
    prefill_cross_attentions: tuple | None = None

    @property
    def valid(self) -> torch.Tensor:
        return self.self_attention.valid

    @property
    def length(self) -> torch.Tensor:
        return self.self_attention.length

    @property
    def max_cache_len(self) -> int:
        return self.self_attention.max_cache_len

    def attend_len(self) -> int:
        inner = self.self_attention
        return inner.attend_len() if hasattr(inner, "attend_len") else inner.max_cache_len

    def with_span(self, num_slots: int, *, dynamic: bool = True) -> "EncoderDecoderCache":
        inner = self.self_attention
        if not hasattr(inner, "with_span"):
            return self
        return self.replace(self_attention=inner.with_span(num_slots, dynamic=dynamic))

    def slots(self, num_new: int) -> torch.Tensor:
        return self.self_attention.slots(num_new)

    def advance(self, slots: torch.Tensor, new_valid: torch.Tensor) -> "EncoderDecoderCache":
        return self.replace(self_attention=self.self_attention.advance(slots, new_valid))

    def write_layer(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        return self.self_attention.write_layer(layer, slots, k, v)

    def cross_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cross-attention keys/values ``[B, H, S_enc, D]`` of decoder layer ``layer``."""
        return self.cross_keys[layer], self.cross_values[layer]

    def rewind(self, lengths: torch.Tensor) -> "EncoderDecoderCache":
        return self.replace(self_attention=self.self_attention.rewind(lengths))

    def reorder(self, beam_idx: torch.Tensor) -> "EncoderDecoderCache":
        # Beam search only moves rows among the beams of one prompt, and those beams share one
        # encoder output, so the cross-attention rows are already where they belong.
        return self.replace(self_attention=self.self_attention.reorder(beam_idx))

    def with_rows(self, rows, other: "EncoderDecoderCache") -> "EncoderDecoderCache":
        if other.cross_keys.shape[3] != self.cross_keys.shape[3]:
            raise ValueError(f"cannot insert rows whose encoder input has {other.cross_keys.shape[3]} tokens into a "
                             f"batch whose encoder input has {self.cross_keys.shape[3]}: pad the encoder inputs "
                             f"to one length")
        index = as_row_index(rows, self.cross_keys.device)
        return self.replace(
            self_attention=self.self_attention.with_rows(rows, other.self_attention),
            cross_keys=self.cross_keys.index_copy(1, index, other.cross_keys.to(self.cross_keys.dtype)),
            cross_values=self.cross_values.index_copy(1, index, other.cross_values.to(self.cross_values.dtype)),
            encoder_valid=self.encoder_valid.index_copy(0, index, other.encoder_valid),
        )

    def nbytes(self, device=None) -> int:
        wanted = None if device is None else as_device(device)
        cross = sum(t.numel() * t.element_size() for t in (self.cross_keys, self.cross_values, self.encoder_valid)
                    if wanted is None or t.device.type == wanted.type)
        return self.self_attention.nbytes(device) + cross
