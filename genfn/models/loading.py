"""``genfn.load``: native families first, transformers for every other architecture.

A Hugging Face directory whose architecture has an entry in ``genfn.models.registry`` (and every
GGUF file) loads natively; any other directory is loaded by transformers (an optional import) and
wrapped by ``genfn.from_module``. A Hub id is refused with the steps to a local directory.
"""

from __future__ import annotations

import os

import torch

from genfn.models import model as native
from genfn.models import encoder_decoder, registry
from genfn.models.adapter import from_module

__all__ = ["load"]


def load(path: str | os.PathLike | None = None, *, dtype=torch.float32, quantize: str | None = None,
         tensor_shard=None) -> native.Model:
    """Load a Hugging Face directory or a GGUF file; ``None`` loads the embedded default (SmolLM2).

    Architectures genfn implements natively (``genfn.models.registry.ARCHITECTURES``) load into
    its own pure functions; others load through transformers as wrapped modules. Hub ids are not
    downloaded: pass a local directory. ``quantize`` and ``tensor_shard`` (native families only): see
    ``genfn.models.model.load``.
    """
    if path is not None:
        native.refuse_hub_id(path)
        if _needs_transformers(path):
            if quantize is not None or tensor_shard is not None:
                option = f"quantize={quantize!r}" if quantize is not None else "tensor parallelism"
                raise ValueError(f"{option} needs a native architecture "
                                 f"({', '.join(registry.ARCHITECTURES)}); {os.fspath(path)} loads through transformers")
            return _load_with_transformers(os.fspath(path), native._check_dtype(dtype))
    return native.load(path, dtype=dtype, quantize=quantize, tensor_shard=tensor_shard)


def _needs_transformers(path) -> bool:
    """Whether ``path`` is a Hugging Face directory of an architecture genfn has no native family for."""
    from genfn.models.loaders import find_checkpoint_format
    from genfn.models.loaders.hf import read_json

    kind, resolved = find_checkpoint_format(path)
    if kind != "hf":
        return False
    config = read_json(os.path.join(resolved, "config.json"), "config.json")
    return registry.family_or_none(config) is None and not encoder_decoder.is_encoder_decoder_config(config)


def _load_with_transformers(directory: str, dtype: torch.dtype) -> native.Model:
    """A directory of a non-native architecture, loaded by transformers and wrapped by ``from_module``."""
    try:
        import transformers
    except ImportError:
        from genfn.models.loaders.hf import read_json

        arch = registry.architecture_of(read_json(os.path.join(directory, "config.json"), "config.json"))
        raise ImportError(f"{directory}: genfn has no native implementation of {arch} (native: "
                          f"{', '.join(registry.ARCHITECTURES)}); loading it needs transformers: "
                          f"pip install transformers") from None
    module = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    tokenizer = None
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        from genfn.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_pretrained(directory)
    return from_module(module, tokenizer=tokenizer, source=directory)
