"""Encoder-decoder models as values: ``EncoderDecoderModel`` and the native families that load as one.

``FAMILIES`` maps a checkpoint's ``architectures`` entry to the module implementing it; each family
module has ``spec_from_config``, ``params_from_state_dict``, ``encode``, ``cross_attention_kv``,
``apply`` (the decoder) and ``init_cache`` (see ``genfn.models.seq2seq``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from genfn.models import bart, t5
from genfn.models.model import Model
from genfn.models.seq2seq import EncoderOutput

__all__ = ["EncoderDecoderModel", "FAMILIES", "is_encoder_decoder_config", "from_hf_state_dict"]

FAMILIES = {
    **{arch: t5 for arch in t5.SUPPORTED_ARCHITECTURES},
    **{arch: bart for arch in bart.SUPPORTED_ARCHITECTURES},
}
_MODEL_TYPES = {"t5": "T5ForConditionalGeneration", "mt5": "MT5ForConditionalGeneration",
                "bart": "BartForConditionalGeneration"}


class EncoderDecoderModel(Model):
    """A ``Model`` whose ``apply`` is the decoder, with a pure encoder beside it.

    ``generate`` runs ``encode`` once per call (in the strategy's ``init``) and keeps the
    cross-attention keys/values in the decode state's cache.
    """

    is_encoder_decoder = True

    def __init__(self, spec, params, apply_fn: Callable, init_cache_fn: Callable, *, encode_fn: Callable,
                 cross_kv_fn: Callable, **kwargs):
        super().__init__(spec, params, apply_fn, init_cache_fn, **kwargs)
        self.encode_fn = encode_fn
        self.cross_kv_fn = cross_kv_fn

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
               output_hidden_states: bool = False, output_attentions: bool = False) -> EncoderOutput:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self.encode_fn(self.spec, self.params, input_ids, attention_mask,
                              output_hidden_states=output_hidden_states, output_attentions=output_attentions)

    def cross_attention_kv(self, encoder_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K, V)`` ``[L, B, H, S_enc, D]``: every decoder layer's cross-attention keys/values."""
        return self.cross_kv_fn(self.spec, self.params, encoder_hidden)


def _architecture(config: Mapping[str, Any]) -> str | None:
    for arch in config.get("architectures") or []:
        if arch in FAMILIES:
            return arch
    if not config.get("architectures"):
        return _MODEL_TYPES.get(config.get("model_type"))
    return None


def is_encoder_decoder_config(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` (a ``config.json`` dict) names a native encoder-decoder architecture."""
    return _architecture(config) is not None


def from_hf_state_dict(config: dict, state_dict: dict, *, dtype=torch.float32, tokenizer=None,
                       generation_config=None, source: str | None = None) -> EncoderDecoderModel:
    arch = _architecture(config)
    if arch is None:
        raise ValueError(f"not an encoder-decoder architecture: {config.get('architectures')}; supported: "
                         f"{sorted(FAMILIES)}")
    family = FAMILIES[arch]
    spec = family.spec_from_config(config)
    params = family.params_from_state_dict(spec, state_dict, dtype=dtype)
    return EncoderDecoderModel(spec, params, family.apply, family.init_cache, encode_fn=family.encode,
                               cross_kv_fn=family.cross_attention_kv, tokenizer=tokenizer,
                               generation_config=generation_config, config=dict(config), source=source)
