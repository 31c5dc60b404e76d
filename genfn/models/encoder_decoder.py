"""The native encoder-decoder families and how a checkpoint picks one (``genfn.models.model`` builds
the ``EncoderDecoderModel`` from the parts).

``FAMILIES`` maps a checkpoint's ``architectures`` entry to the module implementing it; each family
module has ``spec_from_config``, ``params_from_state_dict``, ``encode``, ``cross_attention_kv``,
``apply`` (the decoder) and ``init_cache`` (see ``genfn.models.seq2seq``).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from genfn.models import bart, t5

__all__ = ["FAMILIES", "is_encoder_decoder_config", "family_parts"]

FAMILIES = {
    **{arch: t5 for arch in t5.SUPPORTED_ARCHITECTURES},
    **{arch: bart for arch in bart.SUPPORTED_ARCHITECTURES},
}
_MODEL_TYPES = {"t5": "T5ForConditionalGeneration", "mt5": "MT5ForConditionalGeneration",
                "bart": "BartForConditionalGeneration"}


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


def family_parts(config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor], dtype=torch.float32) -> dict:
    """``spec``, ``params`` and the family's pure functions for a checkpoint: the keyword arguments of
    ``EncoderDecoderModel``."""
    arch = _architecture(config)
    if arch is None:
        raise ValueError(f"not an encoder-decoder architecture: {config.get('architectures')}; supported: "
                         f"{sorted(FAMILIES)}")
    family = FAMILIES[arch]
    spec = family.spec_from_config(config)
    return dict(spec=spec, params=family.params_from_state_dict(spec, state_dict, dtype=dtype),
                apply_fn=family.apply, init_cache_fn=family.init_cache, encode_fn=family.encode,
                cross_kv_fn=family.cross_attention_kv)
