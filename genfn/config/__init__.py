"""Generation configuration: what to generate and how, in the shape transformers users know.

Why this package looks the way it does:

* :class:`GenerationConfig` reads and writes the same ``generation_config.json`` as transformers
  v5 (same field names, same JSON), so one checkpoint directory serves both libraries.
* As in transformers v5, unset fields stay ``None`` and library defaults
  (:data:`DEFAULT_GENERATION_PARAMS`) are applied later (:meth:`GenerationConfig.with_defaults`,
  :func:`resolve_generation_config`), so a model's ``generation_config.json`` fills only what the
  user left open, and an unset ``max_length`` means "20 *new* tokens" (:func:`resolve_lengths`).
* :meth:`GenerationConfig.validate` mirrors transformers' ``validate`` (the same contradictions
  are reported, the same ones raise) and adds type and range checks for values transformers
  rejects only deep inside ``generate`` (or never). Every error is a ``TypeError`` or
  ``ValueError`` naming the field and what it accepts.
* Pure Python: nothing here imports torch or transformers, so configs load anywhere, fast.

One idea a module: ``checks`` (value checkers), ``caches`` (cache-implementation names),
``modes`` (GenerationMode and the mode decision), ``compile``, ``watermarking``, ``batching``
(the nested configs), ``fields`` (the GenerationConfig field table and defaults), ``validation``
(what raises and what is reported), ``files`` (JSON and local files), ``generation``
(GenerationConfig), ``resolve`` (the config and lengths ``generate`` runs with).
"""

from __future__ import annotations

from .batching import ContinuousBatchingConfig
from .caches import (
    ALL_CACHE_IMPLEMENTATIONS,
    ALL_STATIC_CACHE_IMPLEMENTATIONS,
    CACHE_IMPLEMENTATIONS,
    COMPILABLE_CACHES,
    DEPRECATED_CACHE_IMPLEMENTATIONS,
    DEPRECATED_STATIC_CACHE_IMPLEMENTATIONS,
    DYNAMIC_CACHE_IMPLEMENTATIONS,
    STATIC_CACHE_IMPLEMENTATIONS,
    VALID_CACHE_IMPLEMENTATIONS,
)
from .checks import normalize_sequence_bias
from .compile import CompileConfig
from .fields import (
    DEFAULT_GENERATION_PARAMS,
    DEPRECATED_FIELDS,
    GENERATION_CONFIG_FIELDS,
    GENFN_ONLY_FIELDS,
    METADATA_FIELDS,
    default_generation_params,
)
from .files import GENERATION_CONFIG_NAME
from .generation import GenerationConfig
from .modes import HUB_GENERATION_MODES, GenerationMode
from .resolve import resolve_generation_config, resolve_lengths
from .watermarking import BaseWatermarkingConfig, SynthIDTextWatermarkingConfig, WatermarkingConfig

__all__ = [
    "GENERATION_CONFIG_NAME",
    "CACHE_IMPLEMENTATIONS",
    "COMPILABLE_CACHES",
    "STATIC_CACHE_IMPLEMENTATIONS",
    "DYNAMIC_CACHE_IMPLEMENTATIONS",
    "DEPRECATED_CACHE_IMPLEMENTATIONS",
    "DEPRECATED_STATIC_CACHE_IMPLEMENTATIONS",
    "ALL_STATIC_CACHE_IMPLEMENTATIONS",
    "ALL_CACHE_IMPLEMENTATIONS",
    "VALID_CACHE_IMPLEMENTATIONS",
    "GENERATION_CONFIG_FIELDS",
    "GENFN_ONLY_FIELDS",
    "DEPRECATED_FIELDS",
    "DEFAULT_GENERATION_PARAMS",
    "METADATA_FIELDS",
    "HUB_GENERATION_MODES",
    "GenerationMode",
    "GenerationConfig",
    "CompileConfig",
    "BaseWatermarkingConfig",
    "WatermarkingConfig",
    "SynthIDTextWatermarkingConfig",
    "ContinuousBatchingConfig",
    "default_generation_params",
    "normalize_sequence_bias",
    "resolve_generation_config",
    "resolve_lengths",
]
