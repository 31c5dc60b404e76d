"""The GenerationConfig field table: every field's name, group and check, the library defaults, and
how nested configs given as dicts are rebuilt. One table is the single source of truth for names and
checks, so a new field cannot be declared without being validated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .caches import VALID_CACHE_IMPLEMENTATIONS
from .checks import (
    Checker,
    Interval,
    check_bad_words_ids,
    check_bool,
    check_early_stopping,
    check_exponential_decay,
    check_mapping,
    check_sequence_bias,
    check_stop_strings,
    check_token_id,
    check_token_ids,
    check_token_list,
    choice_check,
    int_check,
    nested_check,
    real_check,
)
from .compile import CompileConfig
from .response_format import check_response_format
from .watermarking import SynthIDTextWatermarkingConfig, WatermarkingConfig, watermarking_config_from_dict

__all__ = [
    "GENERATION_CONFIG_FIELDS",
    "GENFN_ONLY_FIELDS",
    "DEPRECATED_FIELDS",
    "DEFAULT_GENERATION_PARAMS",
    "METADATA_FIELDS",
    "default_generation_params",
]

# Bookkeeping keys that may appear in a generation_config.json but are not generation parameters.
METADATA_FIELDS = ("_from_model_config", "_commit_hash", "_original_object_hash", "transformers_version")
# The bookkeeping keys a config keeps and writes back.
STORED_METADATA = ("_from_model_config", "transformers_version")


@dataclass(frozen=True)
class _Field:
    name: str
    group: str
    check: Checker


def _check_temperature(name: str, value: Any) -> None:
    # 0 is allowed on its own (greedy configs ship it); with do_sample=True it is rejected later.
    real_check(Interval(0.0))(name, value)


_POSITIVE = Interval(0.0, low_open=True)
_UNIT = Interval(0.0, 1.0)

FIELD_SPECS: tuple[_Field, ...] = (
    # length
    _Field("max_length", "length", int_check(minimum=1)),
    _Field("max_new_tokens", "length", int_check(minimum=1)),
    _Field("min_length", "length", int_check(minimum=0)),
    _Field("min_new_tokens", "length", int_check(minimum=0)),
    _Field("early_stopping", "length", check_early_stopping),
    # 0 is legal: the time budget is checked after each step, so it means "stop after one step".
    _Field("max_time", "length", real_check(Interval(0.0), allow_inf=True)),
    _Field("stop_strings", "length", check_stop_strings),
    # strategy
    _Field("do_sample", "strategy", check_bool),
    _Field("num_beams", "strategy", int_check(minimum=1)),
    _Field("use_mtp", "strategy", check_bool),
    # cache
    _Field("use_cache", "cache", check_bool),
    _Field("cache_implementation", "cache", choice_check(VALID_CACHE_IMPLEMENTATIONS)),
    _Field("cache_config", "cache", check_mapping),
    _Field("max_cache_len", "cache", int_check(minimum=1)),
    # logits
    _Field("temperature", "logits", _check_temperature),
    _Field("top_k", "logits", int_check(minimum=0)),
    _Field("top_p", "logits", real_check(_UNIT)),
    _Field("min_p", "logits", real_check(_UNIT)),
    _Field("top_h", "logits", real_check(Interval(0.0, 1.0, low_open=True))),
    _Field("typical_p", "logits", real_check(Interval(0.0, 1.0, low_open=True))),
    _Field("epsilon_cutoff", "logits", real_check(Interval(0.0, 1.0, high_open=True))),
    _Field("eta_cutoff", "logits", real_check(Interval(0.0, 1.0, high_open=True))),
    _Field("repetition_penalty", "logits", real_check(_POSITIVE)),
    _Field("encoder_repetition_penalty", "logits", real_check(_POSITIVE)),
    _Field("length_penalty", "logits", real_check()),
    _Field("no_repeat_ngram_size", "logits", int_check(minimum=0)),
    _Field("bad_words_ids", "logits", check_bad_words_ids),
    _Field("renormalize_logits", "logits", check_bool),
    _Field("forced_bos_token_id", "logits", check_token_id),
    _Field("forced_eos_token_id", "logits", check_token_ids),
    _Field("remove_invalid_values", "logits", check_bool),
    _Field("exponential_decay_length_penalty", "logits", check_exponential_decay),
    _Field("suppress_tokens", "logits", check_token_list),
    _Field("begin_suppress_tokens", "logits", check_token_list),
    _Field("sequence_bias", "logits", check_sequence_bias),
    _Field("token_healing", "logits", check_bool),
    _Field("guidance_scale", "logits", real_check()),
    # structured outputs (genfn): a JSON schema, regex, grammar or choice list the output must match
    _Field("response_format", "logits", check_response_format),
    # which grammar engine compiles it (None: genfn.structured.DEFAULT_ENGINE, llguidance)
    _Field("grammar_engine", "logits", choice_check(("llguidance", "xgrammar"))),
    _Field(
        "watermarking_config",
        "logits",
        nested_check(
            (WatermarkingConfig, SynthIDTextWatermarkingConfig),
            "a WatermarkingConfig, a SynthIDTextWatermarkingConfig or a dict",
        ),
    ),
    # outputs
    _Field("num_return_sequences", "outputs", int_check(minimum=1)),
    _Field("output_attentions", "outputs", check_bool),
    _Field("output_hidden_states", "outputs", check_bool),
    _Field("output_scores", "outputs", check_bool),
    _Field("output_logits", "outputs", check_bool),
    _Field("return_dict_in_generate", "outputs", check_bool),
    # special tokens
    _Field("pad_token_id", "special_tokens", check_token_id),
    _Field("bos_token_id", "special_tokens", check_token_id),
    _Field("eos_token_id", "special_tokens", check_token_ids),
    # encoder-decoder
    _Field("encoder_no_repeat_ngram_size", "encoder_decoder", int_check(minimum=0)),
    _Field("decoder_start_token_id", "encoder_decoder", check_token_ids),
    # assisted generation
    _Field("is_assistant", "assistant", check_bool),
    _Field("num_assistant_tokens", "assistant", int_check(minimum=1)),
    _Field(
        "num_assistant_tokens_schedule",
        "assistant",
        choice_check(("constant", "heuristic", "heuristic_transient")),
    ),
    _Field("assistant_confidence_threshold", "assistant", real_check(_UNIT)),
    _Field("prompt_lookup_num_tokens", "assistant", int_check(minimum=1)),
    _Field("max_matching_ngram_size", "assistant", int_check(minimum=1)),
    _Field("assistant_early_exit", "assistant", int_check(minimum=1)),
    _Field("assistant_lookbehind", "assistant", int_check(minimum=0)),
    _Field("target_lookbehind", "assistant", int_check(minimum=0)),
    _Field("assistant_ensemble_weight", "assistant", real_check(Interval(0.0, 1.0, True, True))),
    _Field("speculation_type", "assistant", choice_check(("dflash",))),
    # performance
    _Field("compile_config", "performance", nested_check((CompileConfig,), "a CompileConfig or a dict")),
    _Field("disable_compile", "performance", check_bool),
    _Field("prefill_chunk_size", "performance", int_check(minimum=1)),
    # genfn: the batch-invariant mode (genfn.deterministic): bitwise logits whatever the batch
    _Field("batch_invariant", "performance", check_bool),
)

GENERATION_CONFIG_FIELDS: tuple[str, ...] = tuple(spec.name for spec in FIELD_SPECS)
# The fields genfn adds to transformers' set (structured outputs, the batch-invariant mode); every other field is transformers'.
GENFN_ONLY_FIELDS: tuple[str, ...] = ("response_format", "grammar_engine", "batch_invariant")
FIELD_SET = frozenset(GENERATION_CONFIG_FIELDS)

# transformers v5 still carries these, but only for modes it moved to the Hub (or, for
# `continuous_batching_config`, a deprecated way of passing batching settings). genfn does not
# declare them as fields: they never appear in its JSON unless set, and are read only by
# `get_generation_mode`, so that a config asking for a Hub mode is recognised as such.
DEPRECATED_FIELDS: tuple[str, ...] = (
    "continuous_batching_config",
    "low_memory",
    "penalty_alpha",
    "dola_layers",
    "diversity_penalty",
    "num_beam_groups",
    "constraints",
    "force_words_ids",
)

# Applied to fields the user and the model left unset, so `generate` works with no arguments.
# Same table as transformers' `_get_default_generation_params` (minus the deprecated
# `num_beam_groups` and `diversity_penalty`).
DEFAULT_GENERATION_PARAMS: Mapping[str, Any] = MappingProxyType(
    {
        "max_length": 20,
        "min_length": 0,
        "do_sample": False,
        "use_cache": True,
        "early_stopping": False,
        "num_beams": 1,
        "temperature": 1.0,
        "top_k": 50,
        "top_p": 1.0,
        "typical_p": 1.0,
        "repetition_penalty": 1.0,
        "length_penalty": 1.0,
        "no_repeat_ngram_size": 0,
        "encoder_no_repeat_ngram_size": 0,
        "bad_words_ids": None,
        "num_return_sequences": 1,
        "output_scores": False,
        "return_dict_in_generate": False,
        "forced_bos_token_id": None,
        "forced_eos_token_id": None,
        "remove_invalid_values": False,
        "exponential_decay_length_penalty": None,
        "suppress_tokens": None,
        "begin_suppress_tokens": None,
        "epsilon_cutoff": 0.0,
        "eta_cutoff": 0.0,
        "encoder_repetition_penalty": 1.0,
        "num_assistant_tokens": 20,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.4,
        "assistant_lookbehind": 10,
        "target_lookbehind": 10,
    }
)


def default_generation_params() -> dict[str, Any]:
    """A fresh copy of :data:`DEFAULT_GENERATION_PARAMS` (safe to modify)."""
    return dict(DEFAULT_GENERATION_PARAMS)


# Nested configs given as dicts (JSON) or as another library's objects (e.g. transformers' own
# WatermarkingConfig, which has the same fields) are rebuilt as genfn's classes.
_NESTED_CONFIGS: Mapping[str, tuple[tuple[type, ...], Callable[[Mapping[str, Any]], Any]]] = MappingProxyType(
    {
        "watermarking_config": ((WatermarkingConfig, SynthIDTextWatermarkingConfig), watermarking_config_from_dict),
        "compile_config": ((CompileConfig,), CompileConfig.from_dict),
    }
)


def coerce_field(name: str, value: Any) -> Any:
    """Build nested config objects from dicts or foreign config objects, naming the field on error.
    A numpy scalar (``np.int64(8)``, ``np.float32(0.7)``, ``np.bool_``) becomes the Python value it
    holds, as transformers' users pass them: the config then serializes and compares as plain JSON."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        value = value.item()
    if name not in _NESTED_CONFIGS or value is None:
        return value
    classes, from_dict = _NESTED_CONFIGS[name]
    if isinstance(value, classes):
        return value
    if not isinstance(value, Mapping) and callable(getattr(value, "to_dict", None)):
        value = value.to_dict()
    if not isinstance(value, Mapping):
        return value  # left for validate() to reject with a TypeError
    try:
        return from_dict(value)
    except (TypeError, ValueError) as err:
        raise type(err)(f"Invalid `{name}`: {err}") from err
