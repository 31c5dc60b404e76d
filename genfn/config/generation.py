"""GenerationConfig: everything ``generate`` needs to know besides the model and the prompt.

* It reads and writes the same ``generation_config.json`` as transformers v5 (same field names,
  same JSON), so one checkpoint directory serves both libraries.
* As in transformers v5, ``__init__`` stores every field the caller did not set as ``None``, and
  library defaults (:data:`DEFAULT_GENERATION_PARAMS`) are applied later
  (:meth:`GenerationConfig.with_defaults`, :func:`genfn.config.resolve_generation_config`). Keeping
  "unset" apart from "set to the default value" is what lets a model's ``generation_config.json``
  fill only what the user left open, and what makes an unset ``max_length`` mean "20 *new* tokens".
"""

from __future__ import annotations

import copy
import json
import logging
import os
import warnings
from collections.abc import Mapping
from typing import Any

from . import validation
from .compile import CompileConfig
from .fields import (
    DEFAULT_GENERATION_PARAMS,
    DEPRECATED_FIELDS,
    FIELD_SET,
    GENERATION_CONFIG_FIELDS,
    METADATA_FIELDS,
    STORED_METADATA,
    coerce_field,
    default_generation_params,
)
from .files import (
    GENERATION_CONFIG_NAME,
    HUB_ONLY_KWARGS,
    decoder_config_as_dict,
    dtypes_to_names,
    find_local_config_file,
    model_config_as_dict,
    plain_data,
    read_json_file,
    string_keys,
)
from .modes import GenerationMode, generation_mode
from .watermarking import BaseWatermarkingConfig

__all__ = ["GenerationConfig"]

logger = logging.getLogger(__name__)


class GenerationConfig:
    """Everything ``generate`` needs to know besides the model and the prompt.

    Construct with keyword arguments named like transformers' ``GenerationConfig`` fields (see
    :data:`GENERATION_CONFIG_FIELDS`); fields not given stay ``None`` ("unset") until
    :meth:`with_defaults` or :func:`resolve_generation_config` fills them. Unknown keyword
    arguments are kept as extra attributes and written to JSON (model-specific settings live
    there), as in transformers. The constructor validates: hard errors raise, questionable
    combinations are logged (see :meth:`validate`).
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
    response_format: dict[str, Any] | None
    grammar_engine: str | None
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
    batch_invariant: bool | None
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
            setattr(self, name, coerce_field(name, kwargs.pop(name, None)))
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
            validation.log_once(
                logger,
                logging.WARNING,
                f"`force_bos_token_to_be_generated` is deprecated: the generation config should set "
                f"`forced_bos_token_id={self.bos_token_id}`.",
            )
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
            key in FIELD_SET
            or key in DEPRECATED_FIELDS
            or key in STORED_METADATA
            or (key in self.__dict__ and key not in self._PRIVATE_ATTRIBUTES)
        )

    def _custom_entries(self) -> dict[str, Any]:
        hidden = FIELD_SET | set(DEPRECATED_FIELDS) | set(STORED_METADATA) | self._PRIVATE_ATTRIBUTES
        return {key: value for key, value in self.__dict__.items() if key not in hidden}

    # ----------------------------------------------------------------------------------------
    # Validation and strategy (the rules live in validation.py and modes.py)
    # ----------------------------------------------------------------------------------------

    def validate(self, strict: bool = False, user_set_attributes: set[str] | None = None) -> None:
        """Check the config; raise on errors, log contradictions (raise them too if ``strict``).

        Errors (always raised): a field of the wrong type (TypeError) or outside its allowed
        values (ValueError); ``num_return_sequences`` the strategy cannot produce; a forced token
        that is also suppressed; ``temperature=0`` with sampling; ``generate()`` arguments stored in
        the config. Contradictions (the same list as transformers: sampling-only flags without
        ``do_sample=True``, beam-only flags with one beam, cache settings with ``use_cache=False``,
        ``output_*`` flags without ``return_dict_in_generate``, a negative ``pad_token_id``) are
        logged on the ``genfn.config.validation`` logger as transformers logs them -- a WARNING
        naming the flags, an INFO with the details, each once per process -- or raised as one
        ValueError if ``strict``.

        ``user_set_attributes``: names the caller set explicitly; contradictions involving only
        values inherited from elsewhere (a model's generation_config.json) are not reported.
        ``None`` means every set value counts as the caller's.
        """
        validation.raise_on_invalid(self)
        issues = validation.minor_issues(self, user_set_attributes)
        validation.warn_unused_max_cache_len(self)
        validation.report_minor_issues(issues, strict)

    def get_generation_mode(self, assistant_model: Any = None) -> GenerationMode:
        """The decoding strategy these settings select (see :func:`genfn.config.modes.generation_mode`)."""
        return generation_mode(self, assistant_model)

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
                    setattr(self, key, coerce_field(key, value))
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
        for name in STORED_METADATA:
            if self.__dict__.get(name) is not None:
                items[name] = self.__dict__[name]
        return copy.deepcopy(items)

    def to_dict(self) -> dict[str, Any]:
        """All fields (unset ones as None), extra entries and set metadata, as plain data.

        Nested configs become dicts and torch dtypes become their names, so the result is what
        ends up in JSON.
        """
        output = plain_data(self._attribute_items())
        dtypes_to_names(output)
        return output

    def to_diff_dict(self) -> dict[str, Any]:
        """Only what differs from ``GenerationConfig()`` (i.e. everything set): what gets saved."""
        output = self.to_dict()
        return {key: value for key, value in output.items() if key not in FIELD_SET or value is not None}

    def _json_dict(self, use_diff: bool, ignore_metadata: bool, keys_to_pop: list[str] | None) -> dict[str, Any]:
        config_dict = self.to_diff_dict() if use_diff else self.to_dict()
        for key in keys_to_pop or ():
            config_dict.pop(key, None)
        if ignore_metadata:
            for key in METADATA_FIELDS:
                config_dict.pop(key, None)
        return string_keys(config_dict)

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
        top = model_config_as_dict(model_config)
        top.pop("_from_model_config", None)
        present = {key: value for key, value in top.items() if value is not None}
        config = cls.from_dict(present, _from_model_config=True)
        decoder = decoder_config_as_dict(model_config, top)
        unset = cls()
        for name in (*GENERATION_CONFIG_FIELDS, *DEPRECATED_FIELDS, *STORED_METADATA):
            if name in decoder and getattr(config, name) == getattr(unset, name):
                setattr(config, name, coerce_field(name, copy.deepcopy(decoder[name])))
        if not config.return_dict_in_generate and any(getattr(config, f) for f in cls.extra_output_flags):
            config.return_dict_in_generate = True  # asking for extra outputs implies getting a dict back
        validation.raise_on_invalid(config)
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
        for key in HUB_ONLY_KWARGS:
            kwargs.pop(key, None)
        if revision not in (None, "main"):
            raise ValueError(
                f"`revision={revision!r}`: genfn loads local files only, which have no revisions; "
                "download that revision and pass its directory."
            )
        path = find_local_config_file(pretrained_model_name, subfolder, config_file_name or GENERATION_CONFIG_NAME)
        config_dict = read_json_file(path)
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
        settings should not be published. One saved unchanged only logs its issues, so that any loaded
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
