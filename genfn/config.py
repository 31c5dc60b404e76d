"""Generation configuration: what to generate and how, in the shape transformers users know.

Why this module looks the way it does:

* :class:`GenerationConfig` reads and writes the same ``generation_config.json`` as transformers
  v5 (same field names, same JSON), so one checkpoint directory serves both libraries.
* As in transformers v5, ``__init__`` stores every field the caller did not set as ``None``, and
  library defaults (:data:`DEFAULT_GENERATION_PARAMS`) are applied later
  (:meth:`GenerationConfig.with_defaults`, :func:`resolve_generation_config`). Keeping "unset"
  apart from "set to the default value" is what lets a model's ``generation_config.json`` fill
  only what the user left open, and what makes an unset ``max_length`` mean "20 *new* tokens"
  (:func:`resolve_lengths`) rather than an absolute 20.
* :meth:`GenerationConfig.validate` mirrors transformers' ``validate`` (the same contradictions
  warn, the same ones raise) and adds type and range checks for values transformers rejects only
  deep inside ``generate`` (or never). Every error is a ``TypeError`` or ``ValueError`` naming the
  field and what it accepts; warnings are ``UserWarning``.
* Pure Python: nothing here imports torch or transformers, so configs load anywhere, fast.
"""

from __future__ import annotations

import abc

import copy
import dataclasses
import json
import math
import numbers
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any, NoReturn

__all__ = [
    "GENERATION_CONFIG_NAME",
    "STATIC_CACHE_IMPLEMENTATIONS",
    "DYNAMIC_CACHE_IMPLEMENTATIONS",
    "DEPRECATED_STATIC_CACHE_IMPLEMENTATIONS",
    "ALL_CACHE_IMPLEMENTATIONS",
    "VALID_CACHE_IMPLEMENTATIONS",
    "GENERATION_CONFIG_FIELDS",
    "DEPRECATED_FIELDS",
    "DEFAULT_GENERATION_PARAMS",
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

GENERATION_CONFIG_NAME = "generation_config.json"

STATIC_CACHE_IMPLEMENTATIONS = ("static", "offloaded_static")
DYNAMIC_CACHE_IMPLEMENTATIONS = ("dynamic", "offloaded", "quantized")
# Accepted for files written by older transformers; the layer types are now inferred from the model.
DEPRECATED_STATIC_CACHE_IMPLEMENTATIONS = (
    "sliding_window",
    "hybrid",
    "hybrid_chunked",
    "offloaded_hybrid",
    "offloaded_hybrid_chunked",
)
ALL_STATIC_CACHE_IMPLEMENTATIONS = STATIC_CACHE_IMPLEMENTATIONS + DEPRECATED_STATIC_CACHE_IMPLEMENTATIONS
ALL_CACHE_IMPLEMENTATIONS = ALL_STATIC_CACHE_IMPLEMENTATIONS + DYNAMIC_CACHE_IMPLEMENTATIONS
# "paged" is valid too: it routes `generate` to continuous batching.
VALID_CACHE_IMPLEMENTATIONS = ALL_CACHE_IMPLEMENTATIONS + ("paged",)

# Bookkeeping keys that may appear in a generation_config.json but are not generation parameters.
METADATA_FIELDS = ("_from_model_config", "_commit_hash", "_original_object_hash", "transformers_version")
_STORED_METADATA = ("_from_model_config", "transformers_version")

# Arguments of `generate()` that users sometimes put into the config by mistake.
_GENERATE_ONLY_ARGUMENTS = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
)


# --------------------------------------------------------------------------------------------
# Generation modes
# --------------------------------------------------------------------------------------------


class GenerationMode(str, Enum):
    """The decoding strategy a config selects (``str`` values equal transformers')."""

    GREEDY_SEARCH = "greedy_search"
    SAMPLE = "sample"
    BEAM_SEARCH = "beam_search"
    BEAM_SAMPLE = "beam_sample"
    ASSISTED_GENERATION = "assisted_generation"
    # transformers moved these to Hub repositories. genfn names them so that `generate` can say
    # so clearly; it never runs them.
    CONTRASTIVE_SEARCH = "contrastive_search"
    DOLA_GENERATION = "dola_generation"
    CONSTRAINED_BEAM_SEARCH = "constrained_beam_search"
    GROUP_BEAM_SEARCH = "group_beam_search"

    def __str__(self) -> str:
        return self.value


# Where transformers sends the modes it no longer implements itself.
HUB_GENERATION_MODES: Mapping[GenerationMode, str] = MappingProxyType(
    {
        GenerationMode.DOLA_GENERATION: "transformers-community/dola",
        GenerationMode.CONTRASTIVE_SEARCH: "transformers-community/contrastive-search",
        GenerationMode.GROUP_BEAM_SEARCH: "transformers-community/group-beam-search",
        GenerationMode.CONSTRAINED_BEAM_SEARCH: "transformers-community/constrained-beam-search",
    }
)


# --------------------------------------------------------------------------------------------
# Value checks. Each checker is `check(name, value)`: it returns None or raises TypeError (wrong
# kind of value) / ValueError (right kind, outside the allowed set), always naming the field.
# --------------------------------------------------------------------------------------------

Checker = Callable[[str, Any], None]


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _type_error(name: str, expected: str, value: Any) -> NoReturn:
    raise TypeError(f"`{name}` must be {expected}, got {_show(value)} (type {type(value).__name__}).")


def _value_error(name: str, expected: str, value: Any) -> NoReturn:
    raise ValueError(f"`{name}` must be {expected}, got {_show(value)}.")


def _is_int(value: Any) -> bool:
    """Integers, numpy integers included; never bools (``True`` is not a token count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """Ints or floats (JSON writes ``1.0`` as ``1`` at times); never bools."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        _type_error(name, "a bool (True or False)", value)


def _check_optional_bool(name: str, value: Any) -> None:
    if value is not None:
        _check_bool(name, value)


def _int_check(minimum: int | None = None, maximum: int | None = None) -> Checker:
    if minimum is not None and maximum is not None:
        expected = f"an int in [{minimum}, {maximum}]"
    elif minimum is not None:
        expected = f"an int >= {minimum}"
    else:
        expected = "an int"

    def check(name: str, value: Any) -> None:
        if not _is_int(value):
            _type_error(name, expected, value)
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            _value_error(name, expected, value)

    return check


@dataclass(frozen=True)
class _Interval:
    """A real interval, printed the way the error messages show it: ``(0.0, 1.0]``."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def contains(self, x: float) -> bool:
        above = x > self.low if self.low_open else x >= self.low
        below = x < self.high if self.high_open else x <= self.high
        return above and below

    def describe(self) -> str:
        """``a number in (0.0, 1.0]``, ``a number > 0.0``... for error messages."""
        if math.isinf(self.low) and math.isinf(self.high):
            return "a number"
        if math.isinf(self.high):
            return f"a number {'>' if self.low_open else '>='} {self.low}"
        if math.isinf(self.low):
            return f"a number {'<' if self.high_open else '<='} {self.high}"
        left = "(" if self.low_open else "["
        right = ")" if self.high_open else "]"
        return f"a number in {left}{self.low}, {self.high}{right}"


def _real_check(interval: _Interval = _Interval(), allow_inf: bool = False) -> Checker:
    expected = interval.describe() if allow_inf else interval.describe().replace("a number", "a finite number")

    def check(name: str, value: Any) -> None:
        if not _is_real(value):
            _type_error(name, expected, value)
        try:
            x = float(value)
        except OverflowError:
            _value_error(name, expected, value)
        if math.isnan(x) or (math.isinf(x) and not allow_inf) or not interval.contains(x):
            _value_error(name, expected, value)

    return check


def _optional(check: Checker) -> Checker:
    def optional_check(name: str, value: Any) -> None:
        if value is not None:
            check(name, value)

    return optional_check


def _choice_check(choices: tuple[str, ...]) -> Checker:
    expected = "one of " + ", ".join(repr(choice) for choice in choices)

    def check(name: str, value: Any) -> None:
        if not isinstance(value, str):
            _type_error(name, expected, value)
        if value not in choices:
            _value_error(name, expected, value)

    return check


def _check_mapping(name: str, value: Any) -> None:
    if not isinstance(value, Mapping):
        _type_error(name, "a dict", value)


def _check_token_id(name: str, value: Any) -> None:
    if not _is_int(value):
        _type_error(name, "a token id (int)", value)


def _check_token_ids(name: str, value: Any) -> None:
    """One token id, or a non-empty list of them (several EOS tokens, per-row start tokens)."""
    expected = "a token id (int) or a non-empty list of token ids"
    if _is_int(value):
        return
    if not _is_sequence(value) or not all(_is_int(token) for token in value):
        _type_error(name, expected, value)
    if len(value) == 0:
        _value_error(name, expected, value)


def _check_token_list(name: str, value: Any) -> None:
    """A possibly empty list of token ids (suppression lists)."""
    if not _is_sequence(value) or not all(_is_int(token) for token in value):
        _type_error(name, "a list of token ids (ints)", value)


def _check_bad_words_ids(name: str, value: Any) -> None:
    expected = "a non-empty list of non-empty lists of token ids (ints >= 0)"
    if not _is_sequence(value) or not all(
        _is_sequence(words) and all(_is_int(token) for token in words) for words in value
    ):
        _type_error(name, expected, value)
    if len(value) == 0 or any(len(words) == 0 or min(words) < 0 for words in value):
        _value_error(name, expected, value)


_TUPLE_KEY = re.compile(r"^\(\s*(\d+\s*(,\s*\d+\s*)*,?\s*)?\)$")


def _sequence_key(key: Any) -> tuple[int, ...] | None:
    """A ``sequence_bias`` key as a tuple of ints, or None if it is not one.

    JSON cannot hold tuple keys, so transformers writes ``{(1, 2): b}`` as ``{"(1, 2)": b}``;
    accepting that spelling is what lets such a file load again.
    """
    if isinstance(key, tuple):
        return key if all(_is_int(token) for token in key) else None
    if isinstance(key, str) and _TUPLE_KEY.match(key):
        return tuple(int(part) for part in key.strip("() ").split(",") if part.strip())
    return None


def normalize_sequence_bias(sequence_bias: Any, name: str = "sequence_bias") -> dict[tuple[int, ...], float]:
    """``sequence_bias`` in any accepted spelling, as ``{tuple of token ids: float bias}``.

    Accepted spellings: ``{(1, 2): 1.5}``, ``{"(1, 2)": 1.5}`` (what JSON round trips make of it),
    and ``[[[1, 2], 1.5], ...]`` (transformers' JSON-friendly list form). Raises TypeError /
    ValueError naming ``name`` for anything else, so processors can rely on the result.
    """
    expected = (
        "a non-empty dict {tuple of token ids: float} or a non-empty list of "
        "[list of token ids, float] pairs, with token ids >= 0"
    )
    if isinstance(sequence_bias, Mapping):
        pairs = [(_sequence_key(key), bias) for key, bias in sequence_bias.items()]
    elif _is_sequence(sequence_bias) and all(_is_sequence(item) and len(item) == 2 for item in sequence_bias):
        pairs = [
            (tuple(item[0]) if _is_sequence(item[0]) and all(_is_int(t) for t in item[0]) else None, item[1])
            for item in sequence_bias
        ]
    else:
        _type_error(name, expected, sequence_bias)
    if any(tokens is None or not _is_real(bias) for tokens, bias in pairs):
        _type_error(name, expected, sequence_bias)
    if (
        len(pairs) == 0
        or any(len(tokens) == 0 or min(tokens) < 0 for tokens, _ in pairs)
        or any(not math.isfinite(float(bias)) for _, bias in pairs)
    ):
        _value_error(name, expected, sequence_bias)
    return {tuple(int(t) for t in tokens): float(bias) for tokens, bias in pairs}


def _check_sequence_bias(name: str, value: Any) -> None:
    normalize_sequence_bias(value, name)


def _check_exponential_decay(name: str, value: Any) -> None:
    expected = "a (start_index, decay_factor) pair of an int >= 0 and a finite number"
    if not _is_sequence(value) or len(value) != 2 or not _is_int(value[0]) or not _is_real(value[1]):
        _type_error(name, expected, value)
    if value[0] < 0 or not math.isfinite(float(value[1])):
        _value_error(name, expected, value)


def _check_stop_strings(name: str, value: Any) -> None:
    expected = "a non-empty string or a non-empty list of non-empty strings"
    strings = [value] if isinstance(value, str) else value
    if not _is_sequence(strings) or not all(isinstance(s, str) for s in strings):
        _type_error(name, expected, value)
    if len(strings) == 0 or not all(strings):
        _value_error(name, expected, value)


def _check_early_stopping(name: str, value: Any) -> None:
    expected = "True, False or 'never'"
    if isinstance(value, bool) or (isinstance(value, str) and value == "never"):
        return
    if isinstance(value, str):
        _value_error(name, expected, value)
    _type_error(name, expected, value)


def _nested_check(classes: tuple[type, ...], expected: str) -> Checker:
    """Nested configs: the right class, and valid themselves (errors name the outer field too)."""

    def check(name: str, value: Any) -> None:
        if not isinstance(value, classes):
            _type_error(name, expected, value)
        try:
            value.validate()
        except (TypeError, ValueError) as err:
            raise type(err)(f"Invalid `{name}`: {err}") from err

    return check


def _check_no_unknown_keys(cls: type, config_dict: Mapping[str, Any]) -> None:
    known = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(str(key) for key in config_dict if key not in known)
    if unknown:
        raise TypeError(f"{cls.__name__} got unknown keys {unknown}; known keys are {sorted(known)}.")


# --------------------------------------------------------------------------------------------
# Nested configs
# --------------------------------------------------------------------------------------------

_COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class CompileConfig:
    """How the driver ``torch.compile``\\ s the decode step (transformers' fields and defaults).

    ``fullgraph``: refuse graph breaks. ``dynamic``: dynamic-shape graphs (None lets torch decide).
    ``backend``: a backend name or callable. ``mode``: a ``torch.compile`` mode
    (``"reduce-overhead"`` = CUDA graphs). ``options``: backend options; torch refuses ``mode``
    and ``options`` together, so pass ``mode=None`` with ``options``.
    """

    fullgraph: bool = False
    dynamic: bool | None = None
    backend: str | Callable[..., Any] = "inductor"
    mode: str | None = "reduce-overhead"
    options: dict[str, Any] | None = None

    # Class-level switch, not a field and never serialized (as in transformers): lets `generate`
    # compile on devices where it would not by default, e.g. CPU in tests.
    _compile_all_devices = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise TypeError/ValueError now for what ``torch.compile`` would reject later."""
        _check_bool("fullgraph", self.fullgraph)
        _check_optional_bool("dynamic", self.dynamic)
        if not ((isinstance(self.backend, str) and self.backend) or callable(self.backend)):
            _type_error("backend", "a backend name (non-empty str) or a callable", self.backend)
        if self.mode is not None and not isinstance(self.mode, str):
            _type_error("mode", f"one of {_COMPILE_MODES}", self.mode)
        if self.mode not in _COMPILE_MODES:
            _value_error("mode", f"one of {_COMPILE_MODES}", self.mode)
        if self.options is not None:
            _check_mapping("options", self.options)
            if self.mode is not None:
                raise ValueError(
                    f"`mode` ({self.mode!r}) and `options` cannot both be set: torch.compile accepts only one. "
                    "Pass mode=None together with options."
                )

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (the keyword arguments of ``torch.compile``)."""
        return {field.name: copy.deepcopy(getattr(self, field.name)) for field in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, config_dict: Mapping[str, Any]) -> CompileConfig:
        _check_no_unknown_keys(cls, config_dict)
        return cls(**config_dict)


class BaseWatermarkingConfig(abc.ABC):
    """Shared (de)serialization of the watermarking configs (subclasses are dataclasses).

    Both configs validate on construction: a watermark that silently does nothing, or crashes in
    the middle of generation, is worse than an error at the line that built it.
    """

    @abc.abstractmethod
    def validate(self) -> None:
        """Raise ValueError naming the field when a setting is out of range."""

    @classmethod
    def from_dict(cls, config_dict: Mapping[str, Any], **kwargs: Any) -> BaseWatermarkingConfig:
        """Build from a dict; ``kwargs`` override known keys (unknown kwargs are ignored, as in transformers)."""
        _check_no_unknown_keys(cls, config_dict)
        config = cls(**config_dict)
        config.update(**kwargs)
        return config

    def to_dict(self) -> dict[str, Any]:
        return {field.name: copy.deepcopy(getattr(self, field.name)) for field in dataclasses.fields(self)}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_json_file(self, json_file_path: str | os.PathLike) -> None:
        with open(json_file_path, "w", encoding="utf-8") as writer:
            writer.write(self.to_json_string())

    def update(self, **kwargs: Any) -> dict[str, Any]:
        """Set the known keys, validate, and return the unknown ones."""
        known = {field.name for field in dataclasses.fields(self)}
        for key, value in kwargs.items():
            if key in known:
                setattr(self, key, value)
        self.validate()
        return {key: value for key, value in kwargs.items() if key not in known}

    def __iter__(self):
        yield from self.to_dict().items()


@dataclass
class WatermarkingConfig(BaseWatermarkingConfig):
    """Green-list watermarking (Kirchenbauer et al., 2023): bias a pseudo-random "green" token subset.

    ``greenlist_ratio``: share of the vocabulary that is green. ``bias``: added to green logits.
    ``hashing_key``: seeds the green-list hash. ``seeding_scheme``: ``"lefthash"`` (seed from the
    previous tokens) or ``"selfhash"`` (also from the candidate token). ``context_width``: how many
    previous tokens seed the hash.
    """

    greenlist_ratio: float = 0.25
    bias: float = 2.0
    hashing_key: int = 15485863
    seeding_scheme: str = "lefthash"
    context_width: int = 1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _real_check(_Interval(0.0, 1.0))("greenlist_ratio", self.greenlist_ratio)
        _real_check()("bias", self.bias)
        _int_check()("hashing_key", self.hashing_key)
        _choice_check(("lefthash", "selfhash"))("seeding_scheme", self.seeding_scheme)
        _int_check(minimum=1)("context_width", self.context_width)


@dataclass
class SynthIDTextWatermarkingConfig(BaseWatermarkingConfig):
    """SynthID Text watermarking (Dathathri et al., Nature 2024): tournament sampling keyed by n-grams.

    ``ngram_len``: n-gram length used for keying. ``keys``: one watermarking key per tournament
    layer. ``context_history_size``: how many seen contexts are remembered. ``sampling_table_seed``
    and ``sampling_table_size`` (at most 2**24): the pseudo-random sampling table.
    ``skip_first_ngram_calls``: leave the first n-gram steps unwatermarked. ``debug_mode``: make
    the logits uniform before watermarking, to test the implementation.
    """

    ngram_len: int
    keys: list[int]
    context_history_size: int = 1024
    sampling_table_seed: int = 0
    sampling_table_size: int = 2**16
    skip_first_ngram_calls: bool = False
    debug_mode: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _int_check(minimum=1)("ngram_len", self.ngram_len)
        if not _is_sequence(self.keys) or not all(_is_int(key) for key in self.keys):
            _type_error("keys", "a non-empty list of ints", self.keys)
        if len(self.keys) == 0:
            _value_error("keys", "a non-empty list of ints", self.keys)
        _int_check(minimum=1)("context_history_size", self.context_history_size)
        _int_check()("sampling_table_seed", self.sampling_table_seed)
        _int_check(minimum=1, maximum=2**24)("sampling_table_size", self.sampling_table_size)
        _check_bool("skip_first_ngram_calls", self.skip_first_ngram_calls)
        _check_bool("debug_mode", self.debug_mode)


def _watermarking_config_from_dict(config_dict: Mapping[str, Any]) -> BaseWatermarkingConfig:
    """A watermarking config from its JSON dict, picking the class from the keys.

    transformers always builds a ``WatermarkingConfig`` here, so a saved SynthID config cannot be
    loaded back there; dispatching on SynthID's own keys fixes that.
    """
    if "ngram_len" in config_dict or "keys" in config_dict:
        return SynthIDTextWatermarkingConfig.from_dict(config_dict)
    return WatermarkingConfig.from_dict(config_dict)


_SCHEDULER_TYPES = ("fifo", "prefill_first")


@dataclass
class ContinuousBatchingConfig:
    """Settings of continuous batching (``generate_batch``, the batching manager): transformers' fields.

    Storage and validation only; what each knob does lives with the batching code. Memory
    related fields left as ``None`` are inferred at runtime from the device.
    """

    page_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_memory_percent: float | None = None
    max_requests_per_batch: int | None = None
    max_blocks_per_request: int | None = None
    allow_block_sharing: bool = True
    use_async_batching: bool | None = None
    use_cuda_graph: bool | tuple[bool, bool] | None = None
    q_padding_interval_size: int = 0
    kv_padding_interval_size: int = 0
    varlen_compile_config: CompileConfig | None = None
    decode_compile_config: CompileConfig | None = None
    default_compile_level: int = 0
    scheduler_type: str = "fifo"
    safety_margin: float | None = None
    return_logprobs: bool = False
    seed: int | None = None
    auto_switch_to_flash: bool = True
    cpu_offload_space: float | None = 0.0
    cpu_offload_space_safety_threshold: float = 0.8
    max_queue_size: int = 0
    per_request_processors: bool = False
    drop_unsupported_processors: bool = True
    disable_nccl_graph_mixing: bool = True
    cpu_group_timeout: float | None = 300.0
    # Deprecated in transformers; still read so that old call sites keep working.
    use_default_compile_configs: bool | None = None
    max_cached_graphs: int | None = None
    block_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("varlen_compile_config", "decode_compile_config"):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                setattr(self, name, CompileConfig.from_dict(value))
        self._apply_deprecated_fields()
        self.validate()

    def _apply_deprecated_fields(self) -> None:
        """Translate deprecated knobs into their replacements, warning like transformers does."""
        if self.use_default_compile_configs is not None:
            _check_bool("use_default_compile_configs", self.use_default_compile_configs)
            self.default_compile_level = 3 if self.use_default_compile_configs else 0
            warnings.warn(
                "`use_default_compile_configs` is deprecated, use `default_compile_level` instead; "
                f"setting default_compile_level={self.default_compile_level}.",
                FutureWarning,
                stacklevel=4,
            )
        if self.max_cached_graphs is not None:
            warnings.warn("`max_cached_graphs` is deprecated and has no effect.", FutureWarning, stacklevel=4)
        if self.block_size is not None:
            _int_check(minimum=4)("block_size", self.block_size)
            self.page_size = self.block_size
            warnings.warn(
                "`block_size` is deprecated, use `page_size` instead; using it as the page size.",
                FutureWarning,
                stacklevel=4,
            )

    def validate(self) -> None:
        _int_check(minimum=4)("page_size", self.page_size)
        for name in ("num_blocks", "max_batch_tokens", "max_requests_per_batch"):
            _optional(_int_check(minimum=1))(name, getattr(self, name))
        _optional(_real_check(_Interval(0.0, 1.0, low_open=True)))("max_memory_percent", self.max_memory_percent)
        _optional(_int_check(minimum=0))("max_blocks_per_request", self.max_blocks_per_request)
        self._validate_cuda_graph()
        for name in ("q_padding_interval_size", "kv_padding_interval_size", "max_queue_size"):
            _int_check(minimum=0)(name, getattr(self, name))
        for name in ("varlen_compile_config", "decode_compile_config"):
            _optional(_nested_check((CompileConfig,), "a CompileConfig or a dict"))(name, getattr(self, name))
        _int_check(minimum=0, maximum=3)("default_compile_level", self.default_compile_level)
        _choice_check(_SCHEDULER_TYPES)("scheduler_type", self.scheduler_type)
        _optional(_real_check(_Interval(0.0, 1.0)))("safety_margin", self.safety_margin)
        _optional(_int_check())("seed", self.seed)
        _optional(_real_check(_Interval(0.0)))("cpu_offload_space", self.cpu_offload_space)
        _real_check(_Interval(0.0, 1.0))("cpu_offload_space_safety_threshold", self.cpu_offload_space_safety_threshold)
        _optional(_real_check(_Interval(0.0, low_open=True), allow_inf=True))(
            "cpu_group_timeout", self.cpu_group_timeout
        )
        for name in (
            "allow_block_sharing",
            "return_logprobs",
            "auto_switch_to_flash",
            "per_request_processors",
            "drop_unsupported_processors",
            "disable_nccl_graph_mixing",
        ):
            _check_bool(name, getattr(self, name))
        _check_optional_bool("use_async_batching", self.use_async_batching)
        _optional(_int_check(minimum=0))("max_cached_graphs", self.max_cached_graphs)

    def _validate_cuda_graph(self) -> None:
        value = self.use_cuda_graph
        if value is None or isinstance(value, bool):
            return
        if not (_is_sequence(value) and len(value) == 2 and all(isinstance(flag, bool) for flag in value)):
            _type_error("use_cuda_graph", "None, a bool, or a (varlen, decode) pair of bools", value)

    @property
    def cuda_graph_booleans(self) -> tuple[bool, bool]:
        """Whether CUDA graphs are on for the (varlen, decode) paths; None means off until decided."""
        if self.use_cuda_graph is None:
            return False, False
        if isinstance(self.use_cuda_graph, bool):
            return self.use_cuda_graph, self.use_cuda_graph
        return tuple(self.use_cuda_graph)

    @property
    def fallback_max_blocks_per_request(self) -> int:
        """The block-table width used when nothing hints at a better one."""
        return 32

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = value.to_dict() if isinstance(value, CompileConfig) else copy.deepcopy(value)
        return out

    @classmethod
    def from_dict(cls, config_dict: Mapping[str, Any]) -> ContinuousBatchingConfig:
        _check_no_unknown_keys(cls, config_dict)
        return cls(**config_dict)


# --------------------------------------------------------------------------------------------
# GenerationConfig fields: one table is the single source of truth for names and checks.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Field:
    name: str
    group: str
    check: Checker


def _check_temperature(name: str, value: Any) -> None:
    # 0 is allowed on its own (greedy configs ship it); with do_sample=True it is rejected later.
    _real_check(_Interval(0.0))(name, value)


_POSITIVE = _Interval(0.0, low_open=True)
_UNIT = _Interval(0.0, 1.0)

_FIELD_SPECS: tuple[_Field, ...] = (
    # length
    _Field("max_length", "length", _int_check(minimum=1)),
    _Field("max_new_tokens", "length", _int_check(minimum=1)),
    _Field("min_length", "length", _int_check(minimum=0)),
    _Field("min_new_tokens", "length", _int_check(minimum=0)),
    _Field("early_stopping", "length", _check_early_stopping),
    # 0 is legal: the time budget is checked after each step, so it means "stop after one step".
    _Field("max_time", "length", _real_check(_Interval(0.0), allow_inf=True)),
    _Field("stop_strings", "length", _check_stop_strings),
    # strategy
    _Field("do_sample", "strategy", _check_bool),
    _Field("num_beams", "strategy", _int_check(minimum=1)),
    _Field("use_mtp", "strategy", _check_bool),
    # cache
    _Field("use_cache", "cache", _check_bool),
    _Field("cache_implementation", "cache", _choice_check(VALID_CACHE_IMPLEMENTATIONS)),
    _Field("cache_config", "cache", _check_mapping),
    _Field("max_cache_len", "cache", _int_check(minimum=1)),
    # logits
    _Field("temperature", "logits", _check_temperature),
    _Field("top_k", "logits", _int_check(minimum=0)),
    _Field("top_p", "logits", _real_check(_UNIT)),
    _Field("min_p", "logits", _real_check(_UNIT)),
    _Field("top_h", "logits", _real_check(_Interval(0.0, 1.0, low_open=True))),
    _Field("typical_p", "logits", _real_check(_Interval(0.0, 1.0, low_open=True))),
    _Field("epsilon_cutoff", "logits", _real_check(_Interval(0.0, 1.0, high_open=True))),
    _Field("eta_cutoff", "logits", _real_check(_Interval(0.0, 1.0, high_open=True))),
    _Field("repetition_penalty", "logits", _real_check(_POSITIVE)),
    _Field("encoder_repetition_penalty", "logits", _real_check(_POSITIVE)),
    _Field("length_penalty", "logits", _real_check()),
    _Field("no_repeat_ngram_size", "logits", _int_check(minimum=0)),
    _Field("bad_words_ids", "logits", _check_bad_words_ids),
    _Field("renormalize_logits", "logits", _check_bool),
    _Field("forced_bos_token_id", "logits", _check_token_id),
    _Field("forced_eos_token_id", "logits", _check_token_ids),
    _Field("remove_invalid_values", "logits", _check_bool),
    _Field("exponential_decay_length_penalty", "logits", _check_exponential_decay),
    _Field("suppress_tokens", "logits", _check_token_list),
    _Field("begin_suppress_tokens", "logits", _check_token_list),
    _Field("sequence_bias", "logits", _check_sequence_bias),
    _Field("token_healing", "logits", _check_bool),
    _Field("guidance_scale", "logits", _real_check()),
    _Field(
        "watermarking_config",
        "logits",
        _nested_check(
            (WatermarkingConfig, SynthIDTextWatermarkingConfig),
            "a WatermarkingConfig, a SynthIDTextWatermarkingConfig or a dict",
        ),
    ),
    # outputs
    _Field("num_return_sequences", "outputs", _int_check(minimum=1)),
    _Field("output_attentions", "outputs", _check_bool),
    _Field("output_hidden_states", "outputs", _check_bool),
    _Field("output_scores", "outputs", _check_bool),
    _Field("output_logits", "outputs", _check_bool),
    _Field("return_dict_in_generate", "outputs", _check_bool),
    # special tokens
    _Field("pad_token_id", "special_tokens", _check_token_id),
    _Field("bos_token_id", "special_tokens", _check_token_id),
    _Field("eos_token_id", "special_tokens", _check_token_ids),
    # encoder-decoder
    _Field("encoder_no_repeat_ngram_size", "encoder_decoder", _int_check(minimum=0)),
    _Field("decoder_start_token_id", "encoder_decoder", _check_token_ids),
    # assisted generation
    _Field("is_assistant", "assistant", _check_bool),
    _Field("num_assistant_tokens", "assistant", _int_check(minimum=1)),
    _Field(
        "num_assistant_tokens_schedule",
        "assistant",
        _choice_check(("constant", "heuristic", "heuristic_transient")),
    ),
    _Field("assistant_confidence_threshold", "assistant", _real_check(_UNIT)),
    _Field("prompt_lookup_num_tokens", "assistant", _int_check(minimum=1)),
    _Field("max_matching_ngram_size", "assistant", _int_check(minimum=1)),
    _Field("assistant_early_exit", "assistant", _int_check(minimum=1)),
    _Field("assistant_lookbehind", "assistant", _int_check(minimum=0)),
    _Field("target_lookbehind", "assistant", _int_check(minimum=0)),
    _Field("assistant_ensemble_weight", "assistant", _real_check(_Interval(0.0, 1.0, True, True))),
    _Field("speculation_type", "assistant", _choice_check(("dflash",))),
    # performance
    _Field("compile_config", "performance", _nested_check((CompileConfig,), "a CompileConfig or a dict")),
    _Field("disable_compile", "performance", _check_bool),
    _Field("prefill_chunk_size", "performance", _int_check(minimum=1)),
)

GENERATION_CONFIG_FIELDS: tuple[str, ...] = tuple(spec.name for spec in _FIELD_SPECS)
_FIELD_SET = frozenset(GENERATION_CONFIG_FIELDS)

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
        "watermarking_config": ((WatermarkingConfig, SynthIDTextWatermarkingConfig), _watermarking_config_from_dict),
        "compile_config": ((CompileConfig,), CompileConfig.from_dict),
    }
)


def _coerce_field(name: str, value: Any) -> Any:
    """Build nested config objects from dicts or foreign config objects, naming the field on error."""
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


# Flags that only matter when sampling, with the value at which they are inert (None: any value
# counts as set). Warned about when do_sample is not True, as transformers does.
_SAMPLING_ONLY_FLAGS: tuple[tuple[str, Any], ...] = (
    ("temperature", 1.0),
    ("top_p", 1.0),
    ("min_p", None),
    ("top_h", None),
    ("typical_p", 1.0),
    ("top_k", 50),
    ("epsilon_cutoff", 0.0),
    ("eta_cutoff", 0.0),
)
_BEAM_ONLY_FLAGS: tuple[tuple[str, Any], ...] = (("early_stopping", False), ("length_penalty", 1.0))


def _counts_as_conflict(outer: str, inner: str, user_set: set[str] | None) -> bool:
    """Whether a flag combination should be reported, given which attributes the caller set.

    A sampling flag inherited from a model's generation_config.json is harmless when the caller
    explicitly asked for greedy decoding: report only if the caller set the inner flag, or did
    not set the outer one (or if provenance is unknown).
    """
    if user_set is None:
        return True
    return inner in user_set or outer not in user_set


def _is_flag_active(value: Any, inert: Any) -> bool:
    return value is not None and (inert is None or value != inert)


class GenerationConfig:
    """Everything ``generate`` needs to know besides the model and the prompt.

    Construct with keyword arguments named like transformers' ``GenerationConfig`` fields (see
    :data:`GENERATION_CONFIG_FIELDS`); fields not given stay ``None`` ("unset") until
    :meth:`with_defaults` or :func:`resolve_generation_config` fills them. Unknown keyword
    arguments are kept as extra attributes and written to JSON (model-specific settings live
    there), as in transformers. The constructor validates: hard errors raise, questionable
    combinations warn (see :meth:`validate`).
    """

    # length
    max_length: int | None
    max_new_tokens: int | None
    min_length: int | None
    min_new_tokens: int | None
    early_stopping: bool | str | None
    max_time: float | None
    stop_strings: str | list[str] | None
    # strategy
    do_sample: bool | None
    num_beams: int | None
    use_mtp: bool | None
    # cache
    use_cache: bool | None
    cache_implementation: str | None
    cache_config: dict[str, Any] | None
    max_cache_len: int | None
    # logits
    temperature: float | None
    top_k: int | None
    top_p: float | None
    min_p: float | None
    top_h: float | None
    typical_p: float | None
    epsilon_cutoff: float | None
    eta_cutoff: float | None
    repetition_penalty: float | None
    encoder_repetition_penalty: float | None
    length_penalty: float | None
    no_repeat_ngram_size: int | None
    bad_words_ids: list[list[int]] | None
    renormalize_logits: bool | None
    forced_bos_token_id: int | None
    forced_eos_token_id: int | list[int] | None
    remove_invalid_values: bool | None
    exponential_decay_length_penalty: tuple[int, float] | None
    suppress_tokens: list[int] | None
    begin_suppress_tokens: list[int] | None
    sequence_bias: dict[tuple[int, ...], float] | list[list[Any]] | None
    token_healing: bool | None
    guidance_scale: float | None
    watermarking_config: BaseWatermarkingConfig | None
    # outputs
    num_return_sequences: int | None
    output_attentions: bool | None
    output_hidden_states: bool | None
    output_scores: bool | None
    output_logits: bool | None
    return_dict_in_generate: bool | None
    # special tokens
    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    # encoder-decoder
    encoder_no_repeat_ngram_size: int | None
    decoder_start_token_id: int | list[int] | None
    # assisted generation
    is_assistant: bool | None
    num_assistant_tokens: int | None
    num_assistant_tokens_schedule: str | None
    assistant_confidence_threshold: float | None
    prompt_lookup_num_tokens: int | None
    max_matching_ngram_size: int | None
    assistant_early_exit: int | None
    assistant_lookbehind: int | None
    target_lookbehind: int | None
    assistant_ensemble_weight: float | None
    speculation_type: str | None
    # performance
    compile_config: CompileConfig | None
    disable_compile: bool | None
    prefill_chunk_size: int | None
    # metadata (written to JSON when set)
    transformers_version: str | None
    _from_model_config: bool | None

    extra_output_flags = ("output_attentions", "output_hidden_states", "output_scores", "output_logits")

    # Deprecated fields read as None until set (see DEPRECATED_FIELDS).
    continuous_batching_config = None
    low_memory = None
    penalty_alpha = None
    dola_layers = None
    diversity_penalty = None
    num_beam_groups = None
    constraints = None
    force_words_ids = None

    # Private bookkeeping, never serialized: which fields `with_defaults` filled from the library
    # table (so `resolve_lengths` can tell a default max_length from a chosen one), and a hash of
    # the config as loaded (so `save_pretrained` only demands strictness from edited configs).
    _defaulted_fields: frozenset[str] = frozenset()
    _original_object_hash: int | None = None
    _PRIVATE_ATTRIBUTES = frozenset({"_defaulted_fields", "_original_object_hash"})

    def __init__(self, **kwargs: Any) -> None:
        user_set_attributes = set(kwargs)
        kwargs.pop("_commit_hash", None)  # written by old transformers versions; meaningless here
        from_model_config = kwargs.pop("_from_model_config", None)
        transformers_version = kwargs.pop("transformers_version", None)
        for name in GENERATION_CONFIG_FIELDS:
            setattr(self, name, _coerce_field(name, kwargs.pop(name, None)))
        self._set_deprecated_fields(kwargs)
        self._from_model_config = from_model_config
        self.transformers_version = transformers_version
        # A config built from a model's config.json keeps only generation fields: the rest of
        # config.json (hidden sizes, architectures...) is not generation state.
        if not from_model_config:
            for key, value in kwargs.items():
                self._set_custom_entry(key, value)
        elif kwargs.get("force_bos_token_to_be_generated", False):
            # Old model configs asked for the BOS token to be forced this way.
            self.forced_bos_token_id = self.bos_token_id
        self.validate(user_set_attributes=user_set_attributes)

    def _set_deprecated_fields(self, kwargs: dict[str, Any]) -> None:
        for name in DEPRECATED_FIELDS:
            if name in kwargs:
                setattr(self, name, kwargs.pop(name))
        if self.continuous_batching_config is not None:
            warnings.warn(
                "Passing `continuous_batching_config` through GenerationConfig is deprecated (as in transformers); "
                "pass it to the batching API directly.",
                FutureWarning,
                stacklevel=4,
            )

    def _set_custom_entry(self, key: Any, value: Any) -> None:
        """Store a non-field entry, refusing names that would shadow the class's own attributes."""
        if not isinstance(key, str):
            raise TypeError(f"GenerationConfig entry names must be strings, got {key!r}.")
        if hasattr(type(self), key) and key not in DEPRECATED_FIELDS:
            raise TypeError(f"`{key}` is a GenerationConfig attribute, not a generation parameter; it cannot be set.")
        setattr(self, key, value)

    def _has_entry(self, key: str) -> bool:
        """Whether ``update`` may set ``key`` without ``allow_custom_entries`` (transformers' hasattr)."""
        return (
            key in _FIELD_SET
            or key in DEPRECATED_FIELDS
            or key in _STORED_METADATA
            or (key in self.__dict__ and key not in self._PRIVATE_ATTRIBUTES)
        )

    def _custom_entries(self) -> dict[str, Any]:
        hidden = _FIELD_SET | set(DEPRECATED_FIELDS) | set(_STORED_METADATA) | self._PRIVATE_ATTRIBUTES
        return {key: value for key, value in self.__dict__.items() if key not in hidden}

    # ----------------------------------------------------------------------------------------
    # Validation
    # ----------------------------------------------------------------------------------------

    def validate(self, strict: bool = False, user_set_attributes: set[str] | None = None) -> None:
        """Check the config; raise on errors, warn on contradictions (raise them too if ``strict``).

        Errors (always raised): a field of the wrong type (TypeError) or outside its allowed
        values (ValueError); ``num_return_sequences`` the strategy cannot produce; a forced token
        that is also suppressed; ``temperature=0`` with sampling; ``generate()`` arguments stored in
        the config. Contradictions (a ``UserWarning``, or a ValueError if ``strict``): sampling-only
        flags without ``do_sample=True``, beam-only flags with one beam, cache settings with
        ``use_cache=False``, ``output_*`` flags without ``return_dict_in_generate``, a negative
        ``pad_token_id`` -- the same list as transformers.

        ``user_set_attributes``: names the caller set explicitly; contradictions involving only
        values inherited from elsewhere (a model's generation_config.json) are not reported.
        ``None`` means every set value counts as the caller's.
        """
        self._raise_on_invalid()
        minor_issues = self._minor_issues(user_set_attributes)
        self._warn_unused_max_cache_len()
        _report_minor_issues(minor_issues, strict)

    def _raise_on_invalid(self) -> None:
        # Single values first, combinations after: the first error then points at the root cause.
        self._check_field_values()
        self._check_no_generate_arguments()
        self._check_num_return_sequences()
        self._check_forced_tokens_not_suppressed()
        self._check_sampling_temperature()

    def _check_field_values(self) -> None:
        for spec in _FIELD_SPECS:
            value = getattr(self, spec.name)
            if value is not None:
                spec.check(spec.name, value)

    def _check_num_return_sequences(self) -> None:
        n = self.num_return_sequences
        if n is None or n <= 1:
            return
        if self.num_beams is None or self.num_beams == 1:
            if not self.do_sample:
                raise ValueError(
                    f"`num_return_sequences` ({n}) must be 1 for greedy decoding (do_sample != True, one beam): "
                    "every sequence would be the same. Set do_sample=True or num_beams >= num_return_sequences."
                )
        elif n > self.num_beams:
            raise ValueError(
                f"`num_return_sequences` ({n}) must be <= `num_beams` ({self.num_beams}): "
                "beam search can only return the beams it keeps."
            )

    def _check_forced_tokens_not_suppressed(self) -> None:
        # Forcing a token that is also suppressed leaves only -inf logits at that step: NaN probabilities.
        if self.suppress_tokens is None:
            return
        suppressed = set(self.suppress_tokens)
        for name in ("forced_bos_token_id", "forced_eos_token_id"):
            forced = getattr(self, name)
            if forced is None:
                continue
            forced = {forced} if _is_int(forced) else set(forced)
            if forced and forced <= suppressed:
                raise ValueError(
                    f"Every token in `{name}` ({sorted(forced)}) is also in `suppress_tokens`: forcing a suppressed "
                    "token leaves no finite logit at that step. Remove the overlap (to delay EOS, use min_new_tokens)."
                )

    def _check_sampling_temperature(self) -> None:
        if self.do_sample is True and self.temperature is not None and self.temperature == 0:
            raise ValueError(
                "`temperature` must be > 0 when do_sample=True (0 would divide the logits by zero). "
                "For greedy decoding set do_sample=False."
            )

    def _check_no_generate_arguments(self) -> None:
        for name in _GENERATE_ONLY_ARGUMENTS:
            if name in self.__dict__:
                raise ValueError(
                    f"`{name}` is an argument of `generate()`, not a GenerationConfig field; "
                    "pass it to generate directly."
                )

    def _minor_issues(self, user_set: set[str] | None) -> dict[str, str]:
        issues: dict[str, str] = {}
        if self.pad_token_id is not None and self.pad_token_id < 0:
            issues["pad_token_id"] = (
                f"`pad_token_id` should be >= 0 but is {self.pad_token_id}; batched generation with padding will fail."
            )
        issues.update(self._sampling_only_issues(user_set))
        issues.update(self._beam_only_issues(user_set))
        issues.update(self._no_cache_issues())
        issues.update(self._output_flag_issues())
        return issues

    def _sampling_only_issues(self, user_set: set[str] | None) -> dict[str, str]:
        if self.do_sample is True:
            return {}
        return {
            name: (
                f"`do_sample` is not True, but `{name}` is {getattr(self, name)!r}; it only affects sampling. "
                f"Set do_sample=True or unset `{name}`."
            )
            for name, inert in _SAMPLING_ONLY_FLAGS
            if _is_flag_active(getattr(self, name), inert) and _counts_as_conflict("do_sample", name, user_set)
        }

    def _beam_only_issues(self, user_set: set[str] | None) -> dict[str, str]:
        if self.num_beams is not None and self.num_beams != 1:
            return {}
        return {
            name: (
                f"`num_beams` is {self.num_beams}, but `{name}` is {getattr(self, name)!r}; it only affects beam "
                f"search. Set num_beams>1 or unset `{name}`."
            )
            for name, inert in _BEAM_ONLY_FLAGS
            if _is_flag_active(getattr(self, name), inert) and _counts_as_conflict("num_beams", name, user_set)
        }

    def _no_cache_issues(self) -> dict[str, str]:
        if self.use_cache is not False:
            return {}
        return {
            name: f"`use_cache` is False, so `{name}` ({getattr(self, name)!r}) has no effect."
            for name in ("cache_implementation", "cache_config")
            if getattr(self, name) is not None
        }

    def _output_flag_issues(self) -> dict[str, str]:
        if self.return_dict_in_generate is True:
            return {}
        return {
            name: f"`return_dict_in_generate` is not True, so `{name}` is ignored."
            for name in self.extra_output_flags
            if getattr(self, name) is True
        }

    def _warn_unused_max_cache_len(self) -> None:
        # genfn's default cache (cache_implementation=None) is static, so only an explicitly
        # dynamic choice makes max_cache_len pointless.
        if self.max_cache_len is not None and self.cache_implementation in DYNAMIC_CACHE_IMPLEMENTATIONS + ("paged",):
            warnings.warn(
                f"`max_cache_len` is only used by static caches; it is ignored with "
                f"cache_implementation={self.cache_implementation!r}.",
                UserWarning,
                stacklevel=4,
            )

    # ----------------------------------------------------------------------------------------
    # Strategy
    # ----------------------------------------------------------------------------------------

    def get_generation_mode(self, assistant_model: Any = None) -> GenerationMode:
        """The decoding strategy these settings select (the same decision table as transformers).

        Passing ``assistant_model``, or setting ``use_mtp``, ``prompt_lookup_num_tokens`` or
        ``assistant_early_exit``, turns greedy search and sampling into assisted generation.
        Modes transformers moved to the Hub are returned by name (see HUB_GENERATION_MODES).
        """
        mode = self._base_generation_mode()
        assisted = (
            assistant_model is not None
            or bool(self.use_mtp)
            or self.prompt_lookup_num_tokens is not None
            or self.assistant_early_exit is not None
        )
        if assisted:
            trigger = "an assistant (or use_mtp/prompt lookup/early exit)"
            mode = _extend_mode(mode, GenerationMode.ASSISTED_GENERATION, trigger)
        if self.dola_layers is not None:
            mode = _extend_mode(mode, GenerationMode.DOLA_GENERATION, "`dola_layers`")
        return mode

    def _base_generation_mode(self) -> GenerationMode:
        if self.constraints is not None or self.force_words_ids is not None:
            return GenerationMode.CONSTRAINED_BEAM_SEARCH
        if self.num_beams is None or self.num_beams == 1:
            if self.do_sample is True:
                return GenerationMode.SAMPLE
            contrastive = (
                self.top_k is not None and self.top_k > 1 and self.penalty_alpha is not None and self.penalty_alpha > 0
            )
            return GenerationMode.CONTRASTIVE_SEARCH if contrastive else GenerationMode.GREEDY_SEARCH
        if self.num_beam_groups is not None and self.num_beam_groups > 1:
            return GenerationMode.GROUP_BEAM_SEARCH
        return GenerationMode.BEAM_SAMPLE if self.do_sample is True else GenerationMode.BEAM_SEARCH

    # ----------------------------------------------------------------------------------------
    # Defaults and updates
    # ----------------------------------------------------------------------------------------

    @staticmethod
    def default_generation_params() -> dict[str, Any]:
        """The library defaults table (see :data:`DEFAULT_GENERATION_PARAMS`)."""
        return default_generation_params()

    # The transformers spelling, for code written against it.
    _get_default_generation_params = default_generation_params

    @property
    def defaulted_fields(self) -> frozenset[str]:
        """Fields that hold a library default because nobody set them (filled by :meth:`with_defaults`)."""
        return self._defaulted_fields

    def with_defaults(self) -> GenerationConfig:
        """A copy whose unset fields hold the library defaults; ``self`` is unchanged.

        The copy remembers which fields were filled (:attr:`defaulted_fields`): an unset
        ``max_length`` becomes 20 but still means "20 new tokens" to :func:`resolve_lengths`.
        """
        resolved = self.copy()
        filled = {
            name
            for name, value in DEFAULT_GENERATION_PARAMS.items()
            if value is not None and getattr(resolved, name) is None
        }
        resolved._update(DEFAULT_GENERATION_PARAMS, defaults_only=True, allow_custom_entries=False)
        resolved._defaulted_fields = frozenset(resolved._defaulted_fields | filled)
        return resolved

    def update(self, defaults_only: bool = False, allow_custom_entries: bool = False, **kwargs: Any) -> dict[str, Any]:
        """Set the entries of ``kwargs`` that are config attributes; return the others, unused.

        ``defaults_only``: only fill attributes that are still ``None``. ``allow_custom_entries``:
        also store keys that are not attributes yet (instead of returning them as unused). The
        result is validated with the applied keys as the caller's; if validation raises, the
        config is left exactly as it was.
        """
        return self._update(kwargs, defaults_only=defaults_only, allow_custom_entries=allow_custom_entries)

    def _update(self, kwargs: Mapping[str, Any], defaults_only: bool, allow_custom_entries: bool) -> dict[str, Any]:
        snapshot = dict(self.__dict__)
        applied: list[str] = []
        try:
            for key, value in kwargs.items():
                if self._has_entry(key):
                    if defaults_only and getattr(self, key) is not None:
                        continue
                    setattr(self, key, _coerce_field(key, value))
                elif allow_custom_entries:
                    self._set_custom_entry(key, value)
                else:
                    continue
                applied.append(key)
            self.validate(user_set_attributes=set(applied))
        except Exception:
            self.__dict__.clear()
            self.__dict__.update(snapshot)
            raise
        if self._defaulted_fields & set(applied):
            self._defaulted_fields = self._defaulted_fields - set(applied)
        return {key: value for key, value in kwargs.items() if key not in applied}

    def replace(self, **changes: Any) -> GenerationConfig:
        """A validated copy with ``changes`` applied (the functional spelling of ``update``).

        Unlike ``update``, a key that is not a field (nor an existing entry) is a TypeError:
        silently dropping a misspelt setting is never what a caller of ``replace`` wants.
        """
        new = self.copy()
        unused = new._update(changes, defaults_only=False, allow_custom_entries=False)
        if unused:
            raise TypeError(f"GenerationConfig.replace got unknown fields {sorted(unused)}.")
        return new

    # ----------------------------------------------------------------------------------------
    # Serialization
    # ----------------------------------------------------------------------------------------

    def _attribute_items(self) -> dict[str, Any]:
        """Every entry that serializes, with nested configs still as objects (deep-copied)."""
        items: dict[str, Any] = {name: getattr(self, name) for name in GENERATION_CONFIG_FIELDS}
        for name in DEPRECATED_FIELDS:
            if getattr(self, name) is not None:
                items[name] = getattr(self, name)
        items.update(self._custom_entries())
        for name in _STORED_METADATA:
            if self.__dict__.get(name) is not None:
                items[name] = self.__dict__[name]
        return copy.deepcopy(items)

    def to_dict(self) -> dict[str, Any]:
        """All fields (unset ones as None), extra entries and set metadata, as plain data.

        Nested configs become dicts and torch dtypes become their names, so the result is what
        ends up in JSON.
        """
        output = _plain_data(self._attribute_items())
        _dtypes_to_names(output)
        return output

    def to_diff_dict(self) -> dict[str, Any]:
        """Only what differs from ``GenerationConfig()`` (i.e. everything set): what gets saved."""
        output = self.to_dict()
        return {key: value for key, value in output.items() if key not in _FIELD_SET or value is not None}

    def _json_dict(self, use_diff: bool, ignore_metadata: bool, keys_to_pop: list[str] | None) -> dict[str, Any]:
        config_dict = self.to_diff_dict() if use_diff else self.to_dict()
        for key in keys_to_pop or ():
            config_dict.pop(key, None)
        if ignore_metadata:
            for key in METADATA_FIELDS:
                config_dict.pop(key, None)
        return _string_keys(config_dict)

    def to_json_string(
        self, use_diff: bool = True, ignore_metadata: bool = False, keys_to_pop: list[str] | None = None
    ) -> str:
        """The config as JSON, keys sorted (``use_diff``: only set entries, like generation_config.json)."""
        return json.dumps(self._json_dict(use_diff, ignore_metadata, keys_to_pop), indent=2, sort_keys=True) + "\n"

    def to_json_file(
        self, json_file_path: str | os.PathLike, use_diff: bool = True, keys_to_pop: list[str] | None = None
    ) -> None:
        with open(json_file_path, "w", encoding="utf-8") as writer:
            writer.write(self.to_json_string(use_diff=use_diff, keys_to_pop=keys_to_pop))

    def _canonical_json(self, use_diff: bool) -> str:
        # For __eq__/__hash__/__repr__: must not fail on values JSON cannot hold (a callable backend).
        return json.dumps(self._json_dict(use_diff, True, None), sort_keys=True, default=repr)

    @classmethod
    def from_dict(
        cls, config_dict: Mapping[str, Any], return_unused_kwargs: bool = False, **kwargs: Any
    ) -> GenerationConfig | tuple[GenerationConfig, dict[str, Any]]:
        """Build from a dict (e.g. a parsed generation_config.json); ``kwargs`` override its entries.

        As in transformers, unknown keys are kept as extra attributes, so the unused kwargs are
        empty unless the dict comes from a model config (``_from_model_config``), whose non-generation
        keys are dropped and reported.
        """
        kwargs.pop("_from_auto", None)
        kwargs.pop("_from_pipeline", None)
        config = cls(**{**copy.deepcopy(dict(config_dict)), **kwargs})
        unused = config._update(kwargs, defaults_only=False, allow_custom_entries=False)
        return (config, unused) if return_unused_kwargs else config

    @classmethod
    def from_model_config(cls, model_config: Any) -> GenerationConfig:
        """Generation settings found in a model's config (a config.json dict, or an object with ``to_dict``).

        Takes every generation field present (notably bos/eos/pad/decoder_start token ids), then
        fills still-unset ones from the decoder's own config (``decoder``, ``generator`` or
        ``text_config`` sub-config) -- where multi-part models keep them.
        """
        top = _model_config_as_dict(model_config)
        top.pop("_from_model_config", None)
        present = {key: value for key, value in top.items() if value is not None}
        config = cls.from_dict(present, _from_model_config=True)
        decoder = _decoder_config_as_dict(model_config, top)
        unset = cls()
        for name in (*GENERATION_CONFIG_FIELDS, *DEPRECATED_FIELDS, *_STORED_METADATA):
            if name in decoder and getattr(config, name) == getattr(unset, name):
                setattr(config, name, _coerce_field(name, copy.deepcopy(decoder[name])))
        if not config.return_dict_in_generate and any(getattr(config, f) for f in cls.extra_output_flags):
            config.return_dict_in_generate = True  # asking for extra outputs implies getting a dict back
        config._raise_on_invalid()
        config._original_object_hash = hash(config)
        return config

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name: str | os.PathLike,
        config_file_name: str | os.PathLike | None = None,
        return_unused_kwargs: bool = False,
        *,
        subfolder: str = "",
        revision: str | None = None,
        **kwargs: Any,
    ) -> GenerationConfig | tuple[GenerationConfig, dict[str, Any]]:
        """Load a generation config from a local directory (or a JSON file path).

        genfn never downloads: a Hub model id must be downloaded first and passed as a directory.
        ``kwargs`` override loaded values. Hub-only options of transformers (``cache_dir``,
        ``token``, ``force_download``...) are accepted and ignored; a ``revision`` other than
        ``"main"`` is refused, since a local directory has only one.
        """
        for key in _HUB_ONLY_KWARGS:
            kwargs.pop(key, None)
        if revision not in (None, "main"):
            raise ValueError(
                f"`revision={revision!r}`: genfn loads local files only, which have no revisions; "
                "download that revision and pass its directory."
            )
        path = _find_local_config_file(pretrained_model_name, subfolder, config_file_name or GENERATION_CONFIG_NAME)
        config_dict = _read_json_file(path)
        try:
            if kwargs.pop("_from_model_config", False):
                config = cls.from_model_config(config_dict)
                unused = config._update(kwargs, defaults_only=False, allow_custom_entries=False)
            else:
                config, unused = cls.from_dict(config_dict, return_unused_kwargs=True, **kwargs)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{err} (in {path})") from err
        config._original_object_hash = hash(config)
        return (config, unused) if return_unused_kwargs else config

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        config_file_name: str | os.PathLike | None = None,
        push_to_hub: bool = False,
        **kwargs: Any,
    ) -> str:
        """Write ``generation_config.json`` (only set entries) into ``save_directory``; return its path.

        A config edited since it was loaded must pass ``validate(strict=True)``: contradictory
        settings should not be published. One saved unchanged only warns, so that any loaded
        config can be written back. ``compile_config`` is not saved (it may hold callables).
        """
        if push_to_hub:
            raise ValueError("genfn is offline: push_to_hub is not supported. Upload the saved directory yourself.")
        was_modified = self._original_object_hash != hash(self)
        try:
            self.validate(strict=was_modified)
        except ValueError as err:
            raise ValueError(f"{err}\n\nFix these issues to save the configuration.") from err
        if os.path.isfile(save_directory):
            raise NotADirectoryError(f"`save_directory` ({os.fspath(save_directory)!r}) is a file, not a directory.")
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, config_file_name or GENERATION_CONFIG_NAME)
        self.to_json_file(path, use_diff=True, keys_to_pop=["compile_config"])
        return path

    # ----------------------------------------------------------------------------------------
    # Python protocol
    # ----------------------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GenerationConfig):
            return NotImplemented
        return self._canonical_json(use_diff=False) == other._canonical_json(use_diff=False)

    def __hash__(self) -> int:
        return hash(self._canonical_json(use_diff=True))

    def __repr__(self) -> str:
        return f"{type(self).__name__} {json.dumps(json.loads(self._canonical_json(use_diff=True)), indent=2)}"

    def __deepcopy__(self, memo: dict[int, Any]) -> GenerationConfig:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def copy(self) -> GenerationConfig:
        """An independent deep copy."""
        return copy.deepcopy(self)


def _extend_mode(mode: GenerationMode, extended: GenerationMode, trigger: str) -> GenerationMode:
    """Assisted and DoLa decoding extend greedy search and sampling only; anything else keeps its mode."""
    if mode in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return extended
    warnings.warn(
        f"{trigger} asks for {extended.value}, which only extends greedy search and sampling; the base mode is "
        f"{mode.value}, so the flags requesting {extended.value} are ignored.",
        UserWarning,
        stacklevel=3,
    )
    return mode


def _report_minor_issues(issues: dict[str, str], strict: bool) -> None:
    if not issues:
        return
    details = "\n".join(f"- `{name}`: {text}" for name, text in issues.items())
    details += (
        "\nIf you're using a pretrained model, some of these values may come from its generation_config.json."
    )
    if strict:
        raise ValueError("GenerationConfig is invalid:\n" + details)
    warnings.warn(
        f"The following generation flags are not valid and may be ignored: {list(issues)}.\n{details}",
        UserWarning,
        stacklevel=4,
    )


def _plain_data(value: Any) -> Any:
    """Nested configs (anything with ``to_dict``) as dicts, recursively through dicts and lists."""
    if hasattr(value, "to_dict") and not isinstance(value, type):
        return _plain_data(value.to_dict())
    if isinstance(value, Mapping):
        return {key: _plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain_data(item) for item in value)
    return value


def _dtypes_to_names(config_dict: dict[str, Any]) -> None:
    """``torch.float16`` -> ``"float16"`` under any ``dtype`` key, so cache configs fit in JSON."""
    dtype = config_dict.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        config_dict["dtype"] = str(dtype).split(".")[-1]
    for value in config_dict.values():
        if isinstance(value, dict):
            _dtypes_to_names(value)


def _string_keys(value: Any) -> Any:
    """JSON object keys must be strings: ``(1, 2)`` is written ``"(1, 2)"``, as transformers does."""
    if isinstance(value, Mapping):
        return {str(key): _string_keys(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_string_keys(item) for item in value]
    return value


# --------------------------------------------------------------------------------------------
# Local files
# --------------------------------------------------------------------------------------------

_HUB_ONLY_KWARGS = (
    "cache_dir",
    "force_download",
    "local_files_only",
    "token",
    "proxies",
    "_from_auto",
    "_from_pipeline",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def _find_local_config_file(name: str | os.PathLike, subfolder: str, config_file_name: str | os.PathLike) -> str:
    base = os.fspath(name)
    if subfolder:
        base = os.path.join(base, subfolder)
    if os.path.isfile(base):
        return base
    if os.path.isdir(base):
        path = os.path.join(base, os.fspath(config_file_name))
        if os.path.isfile(path):
            return path
        raise FileNotFoundError(f"The directory {base!r} has no {os.fspath(config_file_name)!r} file.")
    message = f"genfn loads configurations from local paths only (it is offline): {base!r} does not exist."
    if _HUB_ID.match(os.fspath(name)):
        message += (
            f" {os.fspath(name)!r} looks like a Hugging Face Hub model id: download it first "
            f"(e.g. `huggingface-cli download {os.fspath(name)}`) and pass the local directory."
        )
    raise FileNotFoundError(message)


def _read_json_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as reader:
            data = json.load(reader)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise OSError(f"{path!r} is not a valid JSON file: {err}") from err
    if not isinstance(data, dict):
        raise OSError(f"{path!r} must hold a JSON object, got {type(data).__name__}.")
    return data


def _model_config_as_dict(model_config: Any) -> dict[str, Any]:
    if isinstance(model_config, Mapping):
        return copy.deepcopy(dict(model_config))
    if hasattr(model_config, "to_dict"):
        return dict(model_config.to_dict())
    raise TypeError(
        "`model_config` must be a dict (a parsed config.json) or have a to_dict() method, "
        f"got {type(model_config).__name__}."
    )


def _decoder_config_as_dict(model_config: Any, top: dict[str, Any]) -> dict[str, Any]:
    """The sub-config of the part that decodes, where composite models keep their token ids."""
    if not isinstance(model_config, Mapping):
        if hasattr(model_config, "get_text_config"):
            return dict(model_config.get_text_config(decoder=True).to_dict())
        return top
    for name in ("decoder", "generator", "text_config"):
        sub = model_config.get(name)
        if sub:
            return dict(sub) if isinstance(sub, Mapping) else _model_config_as_dict(sub)
    return top


# --------------------------------------------------------------------------------------------
# Resolution used by generate
# --------------------------------------------------------------------------------------------


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
    _int_check(minimum=0)("prompt_len", prompt_len)
    _optional(_int_check(minimum=1))("max_position_embeddings", max_position_embeddings)
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
            warnings.warn(
                f"Both `max_new_tokens` (={config.max_new_tokens}) and `max_length` (={config.max_length}) are set; "
                "`max_new_tokens` takes precedence.",
                UserWarning,
                stacklevel=3,
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
            warnings.warn(
                f"Both `min_new_tokens` (={config.min_new_tokens}) and `min_length` (={config.min_length}) are set; "
                "`min_new_tokens` takes precedence.",
                UserWarning,
                stacklevel=3,
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
