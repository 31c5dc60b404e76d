"""What ``generate`` runs with: the layered config (call > passed > model > library defaults) and
the lengths in total tokens for a given prompt.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

from .checks import int_check, optional
from .fields import DEFAULT_GENERATION_PARAMS
from .generation import GenerationConfig

__all__ = ["resolve_generation_config", "resolve_lengths"]

logger = logging.getLogger(__name__)


def resolve_generation_config(
    model_config: GenerationConfig | Mapping[str, Any] | None,
    passed_config: GenerationConfig | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> tuple[GenerationConfig, dict[str, Any]]:
    """The config ``generate`` runs with, and the kwargs that are not generation settings.

    Precedence, highest first: ``kwargs`` > ``passed_config`` > ``model_config`` (the model's
    generation_config.json, as a GenerationConfig or its dict) > :data:`DEFAULT_GENERATION_PARAMS`.
    A lower layer only fills fields a higher one left unset (None). The unused kwargs go to the
    model. Nothing passed in is modified.
    """
    if passed_config is not None and not isinstance(passed_config, GenerationConfig):
        raise TypeError(f"`generation_config` must be a GenerationConfig, got {type(passed_config).__name__}.")
    config = passed_config.copy() if passed_config is not None else GenerationConfig()
    model_generation_config = _as_generation_config(model_config)
    if model_generation_config is not None:
        config._update(model_generation_config._attribute_items(), defaults_only=True, allow_custom_entries=True)
    config = config.with_defaults()
    unused = config._update(dict(kwargs or {}), defaults_only=False, allow_custom_entries=False)
    if config.cache_implementation == "hybrid":
        # Old Hub configs forced the static sliding-window cache; the default cache handles it now.
        config.cache_implementation = None
    return config, unused


def _as_generation_config(model_config: Any) -> GenerationConfig | None:
    if model_config is None or isinstance(model_config, GenerationConfig):
        return model_config
    if isinstance(model_config, Mapping):
        return GenerationConfig.from_dict(model_config)
    raise TypeError(
        "`model_config` must be the model's GenerationConfig, its generation_config.json dict, or None; "
        f"got {type(model_config).__name__}."
    )


def resolve_lengths(
    config: GenerationConfig, prompt_len: int, max_position_embeddings: int | None = None
) -> tuple[int, int]:
    """``(max_length, min_length)`` in total tokens (prompt included) for a prompt of ``prompt_len`` tokens.

    ``max_new_tokens`` wins over ``max_length``, ``min_new_tokens`` over ``min_length``. A
    ``max_length`` nobody set (None, or filled by :meth:`GenerationConfig.with_defaults`) means
    20 *new* tokens, capped at ``max_position_embeddings``; a chosen one is absolute. Raises
    ValueError when the prompt leaves no room to generate; warns on infeasible minimum lengths.
    """
    int_check(minimum=0)("prompt_len", prompt_len)
    optional(int_check(minimum=1))("max_position_embeddings", max_position_embeddings)
    has_default_max = config.max_length is None or "max_length" in config.defaulted_fields
    max_length = _resolve_max_length(config, prompt_len, has_default_max, max_position_embeddings)
    min_length = _resolve_min_length(config, prompt_len)
    _check_generated_length(config, prompt_len, max_length, min_length, has_default_max)
    return max_length, min_length


def _resolve_max_length(
    config: GenerationConfig, prompt_len: int, has_default_max: bool, max_position_embeddings: int | None
) -> int:
    if config.max_new_tokens is not None:
        if not has_default_max:
            # transformers logs this one and warns (UserWarning) about the others below.
            logger.warning(
                "Both `max_new_tokens` (=%s) and `max_length` (=%s) are set; `max_new_tokens` takes precedence.",
                config.max_new_tokens,
                config.max_length,
            )
        return config.max_new_tokens + prompt_len
    if not has_default_max:
        return config.max_length
    base = DEFAULT_GENERATION_PARAMS["max_length"] if config.max_length is None else config.max_length
    max_length = base + prompt_len
    if max_position_embeddings is not None:
        max_length = min(max_length, max_position_embeddings)
    return max_length


def _resolve_min_length(config: GenerationConfig, prompt_len: int) -> int:
    has_default_min = config.min_length is None or "min_length" in config.defaulted_fields
    if config.min_new_tokens is not None:
        if not has_default_min:
            logger.warning(
                "Both `min_new_tokens` (=%s) and `min_length` (=%s) are set; `min_new_tokens` takes precedence.",
                config.min_new_tokens,
                config.min_length,
            )
        return config.min_new_tokens + prompt_len
    return DEFAULT_GENERATION_PARAMS["min_length"] if config.min_length is None else config.min_length


def _check_generated_length(
    config: GenerationConfig, prompt_len: int, max_length: int, min_length: int, has_default_max: bool
) -> None:
    if has_default_max and config.max_new_tokens is None:
        warnings.warn(
            f"Using the model-agnostic default `max_length` (={max_length} tokens, prompt included) to control the "
            "generation length; set `max_new_tokens` to choose it.",
            UserWarning,
            stacklevel=3,
        )
    if prompt_len >= max_length:
        raise ValueError(
            f"The prompt has {prompt_len} tokens but `max_length` is {max_length}: nothing can be generated. "
            "Increase `max_length`, or better, set `max_new_tokens`."
        )
    if min_length > max_length:
        source = "min_new_tokens` + prompt length" if config.min_new_tokens is not None else "min_length`"
        warnings.warn(
            f"Unfeasible length constraints: `{source} ({min_length}) is larger than the maximum length "
            f"({max_length}); generation will stop at the maximum length.",
            UserWarning,
            stacklevel=3,
        )
