"""genfn.config against transformers' GenerationConfig, the reference for names, defaults and validation.

transformers is imported here as the oracle only; genfn.config itself must never import it.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import inspect
import json
import logging
import math
import os
import re
import subprocess
import sys
import warnings

import pytest
import transformers
import transformers.utils.logging as transformers_logging
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import CompileConfig as TCompileConfig
from transformers import GenerationConfig as TGenerationConfig
from transformers import SynthIDTextWatermarkingConfig as TSynthIDConfig
from transformers import WatermarkingConfig as TWatermarkingConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig as TContinuousBatchingConfig

import genfn.config as gc
from genfn.config import (
    DEFAULT_GENERATION_PARAMS,
    DEPRECATED_FIELDS,
    GENERATION_CONFIG_FIELDS,
    GENFN_ONLY_FIELDS,
    VALID_CACHE_IMPLEMENTATIONS,
    CompileConfig,
    ContinuousBatchingConfig,
    GenerationConfig,
    GenerationMode,
    SynthIDTextWatermarkingConfig,
    WatermarkingConfig,
    normalize_sequence_bias,
    resolve_generation_config,
    resolve_lengths,
)
from genfn.config.validation import forget_logged_messages

transformers.logging.set_verbosity_error()

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# The transformers fields genfn deliberately does not declare (Hub-moved modes, deprecated CB passing).
EXPECTED_OMITTED = {
    "continuous_batching_config",
    "low_memory",
    "penalty_alpha",
    "dola_layers",
    "diversity_penalty",
    "num_beam_groups",
    "constraints",
    "force_words_ids",
}
METADATA = {"_from_model_config", "transformers_version", "_commit_hash", "_original_object_hash"}


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def outcome(fn):
    """(result, exception) of fn(), warnings silenced."""
    try:
        return quiet(fn), None
    except Exception as err:  # noqa: BLE001 - the caller inspects the type
        return None, err


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


@contextlib.contextmanager
def logs(name: str = "genfn.config"):
    """What the logger ``name`` (and its children) logs at INFO and up, each message fresh.

    Both libraries log a validation message once per process; their once-caches are cleared so that
    a message logged by an earlier test is logged again here. A handler of our own (not caplog)
    because transformers' loggers do not propagate to the root, and hypothesis tests cannot use
    function-scoped fixtures.
    """
    forget_logged_messages()
    transformers_logging.warning_once.cache_clear()
    transformers_logging.info_once.cache_clear()
    handler, target = _Records(), logging.getLogger(name)
    old_level = target.level
    target.addHandler(handler)
    target.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        target.removeHandler(handler)
        target.setLevel(old_level)


OURS_LOGGER = "genfn.config"
THEIRS_LOGGER = "transformers.generation.configuration_utils"


def logged_flags(handler: _Records) -> set[str]:
    """The flags named by the "may be ignored: [...]" warnings (both libraries word it so)."""
    found: set[str] = set()
    for message in handler.messages(logging.WARNING):
        listed = re.search(r"may be ignored: (\[.*?\])", message)
        if listed:
            found |= set(ast.literal_eval(listed.group(1)))
    return found


def ours_data(config: GenerationConfig) -> dict:
    """genfn's full JSON, without its own fields (structured outputs) when unset."""
    data = json.loads(config.to_json_string(use_diff=False, ignore_metadata=True))
    return {k: v for k, v in data.items() if not (k in GENFN_ONLY_FIELDS and v is None)}


def theirs_data(config: TGenerationConfig) -> dict:
    """transformers' full JSON, without the deprecated fields genfn does not declare when unset."""
    data = json.loads(config.to_json_string(use_diff=False, ignore_metadata=True))
    return {k: v for k, v in data.items() if not (k in EXPECTED_OMITTED and v is None)}


def without_deprecated(data: dict) -> dict:
    return {k: v for k, v in data.items() if k not in EXPECTED_OMITTED}


def flagged(message: str) -> set[str]:
    return set(re.findall(r"^- `(\w+)`:", message, flags=re.M))


# ------------------------------------------------------------------------------------------------
# field names and defaults
# ------------------------------------------------------------------------------------------------


def test_config_package_imports_neither_transformers_nor_torch():
    # Load the package on its own, under another name (the genfn package itself imports torch,
    # legitimately): its modules reach each other by relative imports only.
    package_dir = os.path.dirname(gc.__file__)
    code = (
        "import importlib.util, os, sys\n"
        "init = os.path.join(sys.argv[1], '__init__.py')\n"
        "spec = importlib.util.spec_from_file_location('genfn_config_alone', init,\n"
        "                                              submodule_search_locations=[sys.argv[1]])\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules[spec.name] = module\n"
        "spec.loader.exec_module(module)\n"
        "assert module.GenerationConfig(max_new_tokens=3).max_new_tokens == 3\n"
        "loaded = {'torch', 'transformers', 'genfn'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code, package_dir], check=True, timeout=120)
    modules = sorted(name for name in os.listdir(package_dir) if name.endswith(".py"))
    assert "generation.py" in modules and len(modules) > 5
    for name in modules:
        source = open(os.path.join(package_dir, name), encoding="utf-8").read()
        assert not re.search(r"^\s*(import|from)\s+(transformers|torch|genfn)\b", source, flags=re.M), name


def test_field_names_equal_transformers_minus_listed_deprecated():
    theirs = set(TGenerationConfig().to_dict()) - METADATA
    assert set(DEPRECATED_FIELDS) == EXPECTED_OMITTED
    assert set(GENERATION_CONFIG_FIELDS) == (theirs - EXPECTED_OMITTED) | set(GENFN_ONLY_FIELDS)
    assert len(GENERATION_CONFIG_FIELDS) == len(set(GENERATION_CONFIG_FIELDS))


def test_cache_implementation_names_are_defined_once_and_equal_transformers():
    import transformers.generation.configuration_utils as theirs

    from genfn.cache import factory

    for name in ("STATIC", "DYNAMIC", "DEPRECATED_STATIC", "ALL_STATIC", "ALL"):
        assert getattr(gc, f"{name}_CACHE_IMPLEMENTATIONS") == getattr(theirs, f"{name}_CACHE_IMPLEMENTATIONS"), name
    # the factory uses the config's tuples themselves, not copies that could drift
    assert factory.CACHE_IMPLEMENTATIONS is gc.CACHE_IMPLEMENTATIONS
    assert factory.COMPILABLE_CACHE_IMPLEMENTATIONS is gc.COMPILABLE_CACHES == gc.STATIC_CACHE_IMPLEMENTATIONS
    assert factory.DEPRECATED_CACHE_IMPLEMENTATIONS is gc.DEPRECATED_CACHE_IMPLEMENTATIONS
    assert set(gc.CACHE_IMPLEMENTATIONS) == set(gc.STATIC_CACHE_IMPLEMENTATIONS + gc.DYNAMIC_CACHE_IMPLEMENTATIONS)
    # every name the config accepts, the factory builds (or maps), except "paged" (continuous batching)
    for name in VALID_CACHE_IMPLEMENTATIONS:
        if name == "paged":
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            assert factory.resolve_cache_implementation(name) in gc.CACHE_IMPLEMENTATIONS


@pytest.mark.parametrize(
    "config",
    [
        CompileConfig(),
        WatermarkingConfig(),
        SynthIDTextWatermarkingConfig(ngram_len=2, keys=[1, 2]),
        ContinuousBatchingConfig(),
    ],
    ids=lambda config: type(config).__name__,
)
def test_option_dataclasses_compare_by_every_field(config):
    # Equality keys compiled steps and caches: a field it forgot would silently reuse a wrong one.
    assert not hasattr(config, "_key")
    assert config == copy.deepcopy(config)
    for field in dataclasses.fields(config):
        changed = copy.deepcopy(config)
        object.__setattr__(changed, field.name, ("changed", field.name))  # past validation, on purpose
        assert changed != config, field.name


def test_generation_config_equality_and_hash_follow_every_field():
    config = GenerationConfig()
    assert not hasattr(config, "_key")
    for name in GENERATION_CONFIG_FIELDS + DEPRECATED_FIELDS:
        changed = config.copy()
        setattr(changed, name, ("changed", name))  # past validation, on purpose
        assert changed != config and hash(changed) != hash(config), name


def test_class_annotations_list_every_field():
    annotated = set(inspect.get_annotations(GenerationConfig)) - {
        "transformers_version",
        "_from_model_config",
        "_defaulted_fields",
        "_original_object_hash",
    }
    assert annotated == set(GENERATION_CONFIG_FIELDS)


def test_unset_config_equals_transformers_unset_config():
    ours = GenerationConfig().to_dict()
    theirs = TGenerationConfig().to_dict()
    assert set(ours) == set(GENERATION_CONFIG_FIELDS)
    for name in GENERATION_CONFIG_FIELDS:
        assert ours[name] is None and theirs.get(name) is None, name
    assert set(GENERATION_CONFIG_FIELDS) - set(theirs) == set(GENFN_ONLY_FIELDS)


def test_defaults_table_equals_transformers():
    theirs = TGenerationConfig._get_default_generation_params()
    assert dict(DEFAULT_GENERATION_PARAMS) == without_deprecated(theirs)
    assert set(theirs) - set(DEFAULT_GENERATION_PARAMS) == {"num_beam_groups", "diversity_penalty"}
    assert GenerationConfig._get_default_generation_params() == dict(DEFAULT_GENERATION_PARAMS)


def test_with_defaults_fills_every_default_and_remembers_which():
    config = GenerationConfig(max_new_tokens=5, top_k=7, do_sample=True)
    resolved = config.with_defaults()
    for name, value in DEFAULT_GENERATION_PARAMS.items():
        expected = getattr(config, name) if getattr(config, name) is not None else value
        assert getattr(resolved, name) == expected, name
    assert config.max_length is None  # the original is untouched
    assert "max_length" in resolved.defaulted_fields and "top_k" not in resolved.defaulted_fields
    resolved.update(max_length=40)
    assert "max_length" not in resolved.defaulted_fields


def test_nested_config_fields_and_defaults_equal_transformers():
    def dataclass_defaults(cls):
        return {f.name: f.default for f in dataclasses.fields(cls)}

    assert dataclass_defaults(CompileConfig) == dataclass_defaults(TCompileConfig)
    assert CompileConfig().to_dict() == TCompileConfig().to_dict()
    from genfn.config.batching import GENFN_FIELDS

    ours = {k: v for k, v in dataclass_defaults(ContinuousBatchingConfig).items() if k not in GENFN_FIELDS}
    assert ours == dataclass_defaults(TContinuousBatchingConfig)
    assert WatermarkingConfig().to_dict() == TWatermarkingConfig().to_dict()
    ours = SynthIDTextWatermarkingConfig(ngram_len=5, keys=[1, 2]).to_dict()
    assert ours == TSynthIDConfig(ngram_len=5, keys=[1, 2]).to_dict()


def test_generation_mode_values_equal_transformers():
    from transformers.generation.configuration_utils import GenerationMode as TMode

    assert {m.name: m.value for m in GenerationMode} == {m.name: m.value for m in TMode}
    assert str(GenerationMode.SAMPLE) == "sample" and GenerationMode.SAMPLE == "sample"


# ------------------------------------------------------------------------------------------------
# JSON files, both ways
# ------------------------------------------------------------------------------------------------

ROUND_TRIP_CASES = [
    {},
    {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 64},
    {"eos_token_id": [1, 2], "bos_token_id": 1, "pad_token_id": 0, "decoder_start_token_id": [0, 3]},
    {"num_beams": 4, "num_return_sequences": 2, "early_stopping": "never", "length_penalty": 0.8},
    {"bad_words_ids": [[1, 2], [3]], "suppress_tokens": [5], "begin_suppress_tokens": [6, 7]},
    {"sequence_bias": [[[1, 2], 1.5], [[3], -2.0]], "exponential_decay_length_penalty": (5, 1.1)},
    {"sequence_bias": {(1, 2): 1.5}, "stop_strings": ["</s>", "###"]},
    {"watermarking_config": {"bias": 3.0, "seeding_scheme": "selfhash"}, "do_sample": True},
    {"cache_implementation": "static", "max_cache_len": 128, "cache_config": {"x": 1}, "prefill_chunk_size": 16},
    {"prompt_lookup_num_tokens": 3, "max_matching_ngram_size": 2, "num_assistant_tokens_schedule": "heuristic"},
    {"my_model_specific_flag": [1, 2], "another": {"a": 1}},
    {"output_scores": True, "return_dict_in_generate": True, "output_logits": True},
    {"penalty_alpha": 0.6, "num_beam_groups": 2, "num_beams": 4, "diversity_penalty": 0.5, "low_memory": True},
]


@pytest.mark.parametrize("kwargs", ROUND_TRIP_CASES)
def test_transformers_file_loads_in_genfn_with_same_values(tmp_path, kwargs):
    theirs = quiet(TGenerationConfig, **copy.deepcopy(kwargs))
    quiet(theirs.save_pretrained, tmp_path)
    ours = quiet(GenerationConfig.from_pretrained, tmp_path)
    assert ours_data(ours) == theirs_data(theirs)
    # and genfn writes the very same file back
    written = json.loads((tmp_path / "generation_config.json").read_text())
    ours_path = quiet(ours.save_pretrained, tmp_path / "again")
    assert json.loads(open(ours_path).read()) == written


@pytest.mark.parametrize("kwargs", ROUND_TRIP_CASES)
def test_genfn_file_loads_in_transformers_with_same_values(tmp_path, kwargs):
    ours = quiet(GenerationConfig, **copy.deepcopy(kwargs))
    quiet(ours.save_pretrained, tmp_path, config_file_name="my_gen.json")
    theirs = quiet(TGenerationConfig.from_pretrained, tmp_path, "my_gen.json")
    assert theirs_data(theirs) == ours_data(ours)
    assert ours_data(quiet(GenerationConfig.from_pretrained, tmp_path, "my_gen.json")) == ours_data(ours)


def test_hub_style_file_with_from_model_config_drops_unknown_keys_like_transformers(tmp_path):
    data = {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 64,
            "transformers_version": "4.40.0"}
    (tmp_path / "generation_config.json").write_text(json.dumps(data))
    ours = GenerationConfig.from_pretrained(tmp_path)
    theirs = TGenerationConfig.from_pretrained(tmp_path)
    assert ours_data(ours) == theirs_data(theirs)
    assert not hasattr(ours, "hidden_size")
    assert ours._from_model_config is True and ours.transformers_version == "4.40.0"


def test_synthid_watermark_round_trips_through_json(tmp_path):
    # transformers itself cannot read this file back (it always builds a WatermarkingConfig).
    watermark = SynthIDTextWatermarkingConfig(ngram_len=5, keys=[7, 8])
    config = GenerationConfig(do_sample=True, watermarking_config=watermark)
    config.save_pretrained(tmp_path)
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert isinstance(loaded.watermarking_config, SynthIDTextWatermarkingConfig)
    assert loaded == config
    theirs = TGenerationConfig(do_sample=True, watermarking_config=TSynthIDConfig(ngram_len=5, keys=[7, 8]))
    assert json.loads(theirs.to_json_string(ignore_metadata=True)) == json.loads(config.to_json_string())


def test_transformers_nested_config_objects_are_accepted():
    config = GenerationConfig(
        do_sample=True,
        watermarking_config=TWatermarkingConfig(bias=3.0),
        compile_config=TCompileConfig(fullgraph=True),
    )
    assert config.watermarking_config == WatermarkingConfig(bias=3.0)
    assert config.compile_config == CompileConfig(fullgraph=True)
    synthid = GenerationConfig(watermarking_config=TSynthIDConfig(ngram_len=4, keys=[1])).watermarking_config
    assert synthid == SynthIDTextWatermarkingConfig(ngram_len=4, keys=[1])


def test_compile_config_is_not_saved_but_kept_in_memory(tmp_path):
    config = GenerationConfig(compile_config={"fullgraph": True}, cache_implementation="static")
    assert config.compile_config == CompileConfig(fullgraph=True)
    config.save_pretrained(tmp_path)
    assert "compile_config" not in json.loads((tmp_path / "generation_config.json").read_text())


# ------------------------------------------------------------------------------------------------
# from_pretrained / save_pretrained edge cases
# ------------------------------------------------------------------------------------------------


def test_missing_hub_id_raises_offline_error_naming_it():
    with pytest.raises(OSError) as info:
        GenerationConfig.from_pretrained("some-org/some-model-that-is-not-here")
    message = str(info.value)
    assert "some-org/some-model-that-is-not-here" in message
    assert "local" in message and "offline" in message and "download" in message


def test_missing_local_path_and_missing_file_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        GenerationConfig.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="generation_config.json"):
        GenerationConfig.from_pretrained(tmp_path)


def test_invalid_json_and_invalid_values_name_the_file(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(OSError, match="not a valid JSON"):
        GenerationConfig.from_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 3.0}))
    with pytest.raises(ValueError, match=r"top_p.*generation_config\.json"):
        GenerationConfig.from_pretrained(tmp_path)


def test_from_pretrained_accepts_a_file_path_subfolder_and_kwargs(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "generation_config.json").write_text(json.dumps({"top_k": 5, "do_sample": True}))
    by_file = GenerationConfig.from_pretrained(tmp_path / "sub" / "generation_config.json")
    by_sub, unused = GenerationConfig.from_pretrained(
        tmp_path, subfolder="sub", return_unused_kwargs=True, top_k=9, foo=1, cache_dir="/ignored"
    )
    theirs, their_unused = TGenerationConfig.from_pretrained(
        tmp_path, subfolder="sub", return_unused_kwargs=True, top_k=9, foo=1
    )
    assert by_file.top_k == 5 and by_sub.top_k == 9
    assert unused == their_unused
    assert ours_data(by_sub) == theirs_data(theirs)
    with pytest.raises(ValueError, match="revision"):
        GenerationConfig.from_pretrained(tmp_path, subfolder="sub", revision="v2")


@pytest.mark.parametrize(
    "kwargs", [{"temperature": 0.5}, {"output_scores": True}, {"num_beams": 1, "length_penalty": 2.0}]
)
def test_save_refuses_edited_contradictory_configs_like_transformers(tmp_path, kwargs):
    with pytest.raises(ValueError, match="Fix these issues"):
        quiet(quiet(GenerationConfig, **kwargs).save_pretrained, tmp_path / "ours")
    with pytest.raises(ValueError):
        quiet(TGenerationConfig(**kwargs).save_pretrained, tmp_path / "theirs")


def test_save_accepts_unchanged_loaded_config_logging_its_issues(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.5}))
    loaded = quiet(GenerationConfig.from_pretrained, tmp_path)
    with logs() as log:
        loaded.save_pretrained(tmp_path / "out")
    assert logged_flags(log) == {"temperature"}
    loaded.top_k = 3  # now edited: strict
    with pytest.raises(ValueError, match="temperature"):
        quiet(loaded.save_pretrained, tmp_path / "out2")


def test_save_into_a_file_path_or_to_the_hub_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError):
        GenerationConfig().save_pretrained(tmp_path / "f")
    with pytest.raises(ValueError, match="offline"):
        GenerationConfig().save_pretrained(tmp_path, push_to_hub=True)


# ------------------------------------------------------------------------------------------------
# update / from_dict / from_model_config / get_generation_mode against transformers
# ------------------------------------------------------------------------------------------------

UPDATE_CASES = [
    ({}, {"top_k": 3, "foo": 1}, {}),
    ({"do_sample": True}, {"temperature": 0.5, "bar": 2}, {"defaults_only": True}),
    ({"do_sample": True, "temperature": 0.7}, {"temperature": 0.5, "top_p": 0.9}, {"defaults_only": True}),
    ({}, {"foo": 1, "top_k": 3}, {"allow_custom_entries": True}),
    ({"foo": 1}, {"foo": 2, "baz": 3}, {}),
    ({}, {"penalty_alpha": 0.5, "top_k": 4}, {}),
    ({"do_sample": True}, {"watermarking_config": {"bias": 1.0}}, {}),
    ({}, {"transformers_version": "x", "_commit_hash": "y"}, {}),
    ({"eos_token_id": 2}, {"eos_token_id": [2, 3], "pad_token_id": 0}, {"defaults_only": True}),
]


@pytest.mark.parametrize(("initial", "kwargs", "flags"), UPDATE_CASES)
def test_update_returns_unused_like_transformers(initial, kwargs, flags):
    ours = quiet(GenerationConfig, **copy.deepcopy(initial))
    theirs = quiet(TGenerationConfig, **copy.deepcopy(initial))
    ours_unused = quiet(ours.update, **flags, **copy.deepcopy(kwargs))
    theirs_unused = quiet(theirs.update, **flags, **copy.deepcopy(kwargs))
    assert ours_unused == theirs_unused
    assert ours_data(ours) == theirs_data(theirs)


FROM_DICT_CASES = [
    ({"top_k": 5, "do_sample": True}, {"foo": 1, "top_p": 0.5}),
    ({"top_k": 5, "do_sample": True, "_from_model_config": True}, {"foo": 1, "top_p": 0.5}),
    ({"unknown_key": 3}, {}),
    ({}, {"_from_auto": True, "_from_pipeline": "x", "max_new_tokens": 3}),
]


@pytest.mark.parametrize(("config_dict", "kwargs"), FROM_DICT_CASES)
def test_from_dict_returns_unused_like_transformers(config_dict, kwargs):
    ours, ours_unused = quiet(
        GenerationConfig.from_dict, copy.deepcopy(config_dict), return_unused_kwargs=True, **kwargs
    )
    theirs, theirs_unused = quiet(
        TGenerationConfig.from_dict, copy.deepcopy(config_dict), return_unused_kwargs=True, **kwargs
    )
    assert ours_unused == theirs_unused
    assert ours_data(ours) == theirs_data(theirs)
    assert quiet(GenerationConfig.from_dict, config_dict, **kwargs) == ours


MODEL_CONFIGS = [
    {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
     "use_cache": True, "max_position_embeddings": 2048, "torch_dtype": "bfloat16", "transformers_version": "4.40.0"},
    {"model_type": "t5", "decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0, "num_beams": 4,
     "max_length": 200, "early_stopping": True, "task_specific_params": {"summarization": {"num_beams": 4}}},
    {"model_type": "llava", "text_config": {"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 5},
     "image_token_index": 32000},
    {"eos_token_id": 2, "output_attentions": True, "output_hidden_states": False},
    {"bos_token_id": 0, "force_bos_token_to_be_generated": True, "_from_model_config": True},
    {"model_type": "rag", "generator": {"decoder_start_token_id": 2, "bos_token_id": 0}, "eos_token_id": 1},
]


@pytest.mark.parametrize("model_config", MODEL_CONFIGS)
def test_from_model_config_equals_transformers(model_config):
    ours = quiet(GenerationConfig.from_model_config, copy.deepcopy(model_config))
    theirs = quiet(TGenerationConfig.from_model_config, copy.deepcopy(model_config))
    assert ours_data(ours) == theirs_data(theirs)
    assert ours._from_model_config is True


class _ModelConfigObject:
    """Duck-typed PreTrainedConfig (``to_dict``, ``get_text_config``): importing a real one costs seconds."""

    def __init__(self, data, text=None):
        self.data, self.text = data, text

    def to_dict(self):
        return copy.deepcopy(self.data)

    def get_text_config(self, decoder=False):
        return _ModelConfigObject(self.text) if self.text is not None else self


def test_from_model_config_accepts_config_objects():
    model_config = _ModelConfigObject(
        {"model_type": "llava", "bos_token_id": 3, "image_token_index": 9},
        text={"eos_token_id": 4, "pad_token_id": 5, "bos_token_id": 7},
    )
    ours = quiet(GenerationConfig.from_model_config, model_config)
    theirs = quiet(TGenerationConfig.from_model_config, model_config)
    assert ours_data(ours) == theirs_data(theirs)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (3, 4, 5)


MODE_CASES = [
    {},
    {"do_sample": True},
    {"num_beams": 3},
    {"num_beams": 3, "do_sample": True},
    {"do_sample": False, "num_beams": 1},
    {"penalty_alpha": 0.6, "top_k": 4},
    {"penalty_alpha": 0.6, "top_k": 4, "do_sample": True},
    {"penalty_alpha": 0.6, "top_k": 1},
    {"num_beams": 4, "num_beam_groups": 2},
    {"constraints": ["c"]},
    {"force_words_ids": [[1]]},
    {"dola_layers": "high"},
    {"dola_layers": "low", "num_beams": 2},
    {"use_mtp": True},
    {"use_mtp": False},
    {"prompt_lookup_num_tokens": 3},
    {"assistant_early_exit": 2},
    {"prompt_lookup_num_tokens": 3, "num_beams": 2},
    {"prompt_lookup_num_tokens": 3, "do_sample": True},
]


@pytest.mark.parametrize("kwargs", MODE_CASES)
@pytest.mark.parametrize("assistant", [None, object()])
def test_generation_mode_equals_transformers(kwargs, assistant):
    ours = quiet(GenerationConfig, **kwargs)
    theirs = quiet(TGenerationConfig, **kwargs)
    ours_mode = quiet(ours.get_generation_mode, assistant)
    assert isinstance(ours_mode, GenerationMode)
    assert ours_mode.value == quiet(theirs.get_generation_mode, assistant).value


def test_assisted_request_on_beam_search_logs_a_warning():
    config = GenerationConfig(num_beams=2)
    with logs() as log:
        mode = config.get_generation_mode(assistant_model=object())
    assert mode is GenerationMode.BEAM_SEARCH
    assert [r.name for r in log.records] == ["genfn.config.modes"]
    assert "assisted_generation" in log.messages(logging.WARNING)[0]


# ------------------------------------------------------------------------------------------------
# validation: explicit cases
# ------------------------------------------------------------------------------------------------

ERROR_CASES = [
    ({"temperature": -1}, ValueError, ["`temperature`", ">= 0.0"]),
    ({"temperature": float("nan")}, ValueError, ["`temperature`"]),
    ({"top_k": "5"}, TypeError, ["`top_k`", "int"]),
    ({"top_k": -1}, ValueError, ["`top_k`", ">= 0"]),
    ({"top_p": 1.5}, ValueError, ["`top_p`", "[0.0, 1.0]"]),
    ({"min_p": -0.1}, ValueError, ["`min_p`"]),
    ({"typical_p": 0.0}, ValueError, ["`typical_p`", "(0.0, 1.0]"]),
    ({"epsilon_cutoff": 1.0}, ValueError, ["`epsilon_cutoff`", "[0.0, 1.0)"]),
    ({"repetition_penalty": 0.0}, ValueError, ["`repetition_penalty`", "> 0.0"]),
    ({"num_beams": 0}, ValueError, ["`num_beams`", ">= 1"]),
    ({"max_new_tokens": 0}, ValueError, ["`max_new_tokens`", ">= 1"]),
    ({"max_length": True}, TypeError, ["`max_length`"]),
    ({"do_sample": "yes"}, TypeError, ["`do_sample`", "bool"]),
    ({"early_stopping": "always"}, ValueError, ["`early_stopping`", "'never'"]),
    ({"cache_implementation": "foo"}, ValueError, ["`cache_implementation`", "'static'"]),
    ({"eos_token_id": []}, ValueError, ["`eos_token_id`"]),
    ({"eos_token_id": "2"}, TypeError, ["`eos_token_id`"]),
    ({"bad_words_ids": [[-1]]}, ValueError, ["`bad_words_ids`"]),
    ({"bad_words_ids": [1, 2]}, TypeError, ["`bad_words_ids`"]),
    ({"sequence_bias": {}}, ValueError, ["`sequence_bias`"]),
    ({"stop_strings": ""}, ValueError, ["`stop_strings`"]),
    ({"exponential_decay_length_penalty": [1]}, TypeError, ["`exponential_decay_length_penalty`"]),
    ({"do_sample": True, "temperature": 0.0}, ValueError, ["`temperature`", "do_sample"]),
    ({"num_return_sequences": 2}, ValueError, ["`num_return_sequences`"]),
    ({"num_beams": 2, "num_return_sequences": 3}, ValueError, ["`num_return_sequences`", "`num_beams`"]),
    ({"forced_eos_token_id": 2, "suppress_tokens": [2, 3]}, ValueError, ["`forced_eos_token_id`", "`suppress_tokens`"]),
    ({"assistant_ensemble_weight": 1.0}, ValueError, ["`assistant_ensemble_weight`", "(0.0, 1.0)"]),
    ({"speculation_type": "medusa"}, ValueError, ["`speculation_type`", "'dflash'"]),
    ({"compile_config": 5}, TypeError, ["`compile_config`"]),
    ({"compile_config": {"mode": "fast"}}, ValueError, ["`compile_config`", "mode"]),
    ({"watermarking_config": {"greenlist_ratio": 2.0}}, ValueError, ["`watermarking_config`", "`greenlist_ratio`"]),
    ({"watermarking_config": {"nonsense": 1}}, TypeError, ["`watermarking_config`", "nonsense"]),
    ({"streamer": object()}, ValueError, ["`streamer`", "generate"]),
    ({"update": 1}, TypeError, ["`update`"]),
]


@pytest.mark.parametrize(("kwargs", "error", "fragments"), ERROR_CASES)
def test_invalid_values_raise_errors_naming_the_field(kwargs, error, fragments):
    with pytest.raises(error) as info:
        quiet(GenerationConfig, **kwargs).validate()
    for fragment in fragments:
        assert fragment in str(info.value)


def test_validate_checks_values_assigned_after_construction():
    config = GenerationConfig()
    config.temperature = -1
    with pytest.raises(ValueError, match="temperature"):
        config.validate()


def test_update_is_atomic_when_validation_fails():
    config = GenerationConfig(do_sample=True)
    before = config.to_dict()
    with pytest.raises(ValueError, match="top_p"):
        config.update(top_k=3, top_p=2.0)
    assert config.to_dict() == before


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.5},
        {"do_sample": False, "top_p": 0.5},
        {"num_beams": 1, "length_penalty": 2.0},
        {"early_stopping": True},
        {"use_cache": False, "cache_implementation": "static"},
        {"output_scores": True},
        {"pad_token_id": -1},
        {"min_p": 0.1},
    ],
)
def test_contradictions_log_and_raise_when_strict_like_transformers(kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported through logging, never as a Python warning
        with logs() as log:
            config = GenerationConfig(**kwargs)
    (summary,) = log.messages(logging.WARNING)
    (details,) = log.messages(logging.INFO)
    assert "may be ignored" in summary and {r.name for r in log.records} == {"genfn.config.validation"}
    assert logged_flags(log) == flagged(details) == set(kwargs) - {"do_sample", "num_beams", "use_cache"}
    with pytest.raises(ValueError) as ours:
        config.validate(strict=True)
    with pytest.raises(ValueError) as theirs:
        quiet(TGenerationConfig, **kwargs).validate(strict=True)
    assert flagged(str(ours.value)) == flagged(str(theirs.value)) != set()


def test_inherited_sampling_flags_are_not_reported_when_user_chose_greedy():
    config = quiet(GenerationConfig, do_sample=True, temperature=0.6)
    with logs() as log:
        config.update(do_sample=False)  # temperature came from elsewhere: not reported
    assert log.records == []
    with logs() as log:
        config.validate()  # provenance unknown: reported
    assert logged_flags(log) == {"temperature"}


def test_a_minor_issue_is_logged_once_per_process_like_transformers_warning_once():
    with logs() as log:
        GenerationConfig(temperature=0.5)
        GenerationConfig(temperature=0.5)
        GenerationConfig(temperature=0.25)  # another message: logged
    assert len(log.messages(logging.WARNING)) == 1  # the summary names the flags, not their values
    assert len(log.messages(logging.INFO)) == 2
    forget_logged_messages()


def test_a_message_filtered_out_by_level_is_not_spent():
    target = logging.getLogger(OURS_LOGGER)
    old_level = target.level
    forget_logged_messages()
    target.setLevel(logging.ERROR)
    try:
        GenerationConfig(top_k=7)  # nothing logged at ERROR
    finally:
        target.setLevel(old_level)
    with contextlib.ExitStack() as stack:
        handler = _Records()
        target.addHandler(handler)
        stack.callback(target.removeHandler, handler)
        target.setLevel(logging.INFO)
        stack.callback(target.setLevel, old_level)
        GenerationConfig(top_k=7)
    assert logged_flags(handler) == {"top_k"}
    forget_logged_messages()


def _behaviour(build, logger_name: str) -> tuple:
    """("raises", exception type) or ("logs", levels logged, flags named) for one way to misconfigure."""
    with logs(logger_name) as log:
        try:
            build()
        except (TypeError, ValueError) as err:
            return "raises", type(err).__name__
    return "logs", sorted({record.levelname for record in log.records}), logged_flags(log)


# (genfn's classes, transformers' classes) -> the same misconfiguration, built with either.
MISCONFIGURATIONS = {
    "sampling flag, greedy": lambda g, b: g(temperature=0.5),
    "two sampling flags": lambda g, b: g(do_sample=False, top_k=5, top_p=0.9),
    "beam flag, one beam": lambda g, b: g(num_beams=1, early_stopping=True),
    "cache config, no cache": lambda g, b: g(use_cache=False, cache_config={"nbits": 4}),
    "output flag, no dict": lambda g, b: g(output_logits=True),
    "negative pad token": lambda g, b: g(pad_token_id=-1),
    "max_cache_len, dynamic cache": lambda g, b: g(max_cache_len=64, cache_implementation="dynamic"),
    "assistant on beam search": lambda g, b: g(num_beams=2).get_generation_mode(assistant_model=object()),
    "deprecated batching field": lambda g, b: b(block_size=64),
    "strict on a minor issue": lambda g, b: g(temperature=0.5).validate(strict=True),
    "greedy, two sequences": lambda g, b: g(num_return_sequences=2),
    "more sequences than beams": lambda g, b: g(num_beams=2, num_return_sequences=3),
    "forced token suppressed": lambda g, b: g(suppress_tokens=[2], forced_eos_token_id=2),
    "generate argument in config": lambda g, b: g(streamer=object()),
    "bad early_stopping": lambda g, b: g(early_stopping="sometimes"),
    "no new tokens": lambda g, b: g(max_new_tokens=0),
    "unknown cache": lambda g, b: g(cache_implementation="nope"),
}


@pytest.mark.parametrize("case", sorted(MISCONFIGURATIONS))
def test_misconfigurations_are_logged_or_raised_exactly_as_transformers_does(case):
    build = MISCONFIGURATIONS[case]
    ours = _behaviour(lambda: build(GenerationConfig, ContinuousBatchingConfig), OURS_LOGGER)
    theirs = _behaviour(lambda: build(TGenerationConfig, TContinuousBatchingConfig), THEIRS_LOGGER)
    assert ours == theirs
    assert ours[0] == "raises" or "WARNING" in ours[1]  # every case is reported one way or the other


def test_max_cache_len_with_a_dynamic_cache_logs_but_is_not_an_error():
    with logs() as log:
        config = GenerationConfig(max_cache_len=64, cache_implementation="dynamic")
    assert "max_cache_len" in log.messages(logging.WARNING)[0]
    quiet(config.validate, strict=True)


def test_deprecated_continuous_batching_config_warns():
    with pytest.warns(FutureWarning):
        config = GenerationConfig(continuous_batching_config=ContinuousBatchingConfig())
    assert "continuous_batching_config" in config.to_dict()


# ------------------------------------------------------------------------------------------------
# validation: hypothesis fuzz
# ------------------------------------------------------------------------------------------------

TEXT = st.text(max_size=4)
BOOLS = st.booleans()
INTS = st.integers(-5, 100)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
INT_LISTS = st.lists(st.integers(0, 5), max_size=3)
DICTS = st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
TOKEN = st.integers(0, 50_000)


def int_case(low, high=None, valid_top=None):
    """An int field whose allowed values are exactly [low, high] (None: unbounded); valid draws stop at valid_top."""
    top = valid_top if valid_top is not None else high if high is not None else low + 10_000
    out_of_range = st.integers(max_value=low - 1)
    if high is not None:
        out_of_range = st.one_of(out_of_range, st.integers(min_value=high + 1))
    return st.integers(low, top), st.one_of(out_of_range, TEXT, BOOLS, FLOATS, INT_LISTS, DICTS)


def real_case(low=None, high=None, low_open=False, high_open=False, allow_inf=False):
    """A real field whose allowed values are exactly the interval given (None: unbounded)."""
    valid = st.floats(low, high, exclude_min=low_open and low is not None, exclude_max=high_open and high is not None,
                      allow_nan=False, allow_infinity=allow_inf)
    bad = [st.just(float("nan")), TEXT, BOOLS, st.lists(st.floats(0, 1), max_size=2), DICTS]
    if low is not None:
        bad.append(st.floats(max_value=low, exclude_max=not low_open, allow_nan=False, allow_infinity=False))
        bad.append(st.just(-math.inf))
    if high is not None:
        bad.append(st.floats(min_value=high, exclude_min=not high_open, allow_nan=False, allow_infinity=False))
    if not allow_inf:
        bad.append(st.just(math.inf))
    return valid, st.one_of(*bad)


def bool_case():
    return BOOLS, st.one_of(TEXT, INTS, FLOATS, INT_LISTS, DICTS)


def choice_case(choices):
    return st.sampled_from(choices), st.one_of(TEXT.filter(lambda s: s not in choices), INTS, BOOLS, FLOATS, INT_LISTS)


def token_case():
    return st.integers(-1, 50_000), st.one_of(TEXT, BOOLS, FLOATS, INT_LISTS, DICTS)


def token_ids_case():
    valid = st.one_of(TOKEN, st.lists(TOKEN, min_size=1, max_size=3))
    return valid, st.one_of(st.just([]), TEXT, BOOLS, FLOATS, DICTS, st.lists(TEXT, min_size=1, max_size=2))


def token_list_case():
    return st.lists(TOKEN, max_size=4), st.one_of(TEXT, INTS, BOOLS, DICTS, st.lists(TEXT, min_size=1, max_size=2))


SEQUENCE_BIAS_VALID = st.one_of(
    st.dictionaries(st.tuples(TOKEN).map(tuple) | st.lists(TOKEN, min_size=1, max_size=3).map(tuple),
                    st.floats(-5, 5), min_size=1, max_size=3),
    st.lists(st.tuples(st.lists(TOKEN, min_size=1, max_size=3), st.floats(-5, 5)).map(list), min_size=1, max_size=3),
    st.just({"(1, 2)": 2.0, "(3,)": -1.0}),
)
SEQUENCE_BIAS_INVALID = st.one_of(
    st.just({}), st.just([]), st.just({(): 1.0}), st.just({(-1,): 1.0}), st.just({(1,): float("nan")}),
    st.just({"a": 1.0}), st.just([[1, 2]]), INTS, TEXT, BOOLS,
)
WATERMARK_VALID = st.fixed_dictionaries(
    {},
    optional={
        "greenlist_ratio": st.floats(0, 1),
        "bias": st.floats(-5, 5),
        "hashing_key": st.integers(0, 2**31),
        "seeding_scheme": st.sampled_from(["lefthash", "selfhash"]),
        "context_width": st.integers(1, 4),
    },
)
WATERMARK_INVALID = st.one_of(
    st.just({"greenlist_ratio": 1.5}), st.just({"seeding_scheme": "x"}), st.just({"context_width": 0}),
    st.just({"foo": 1}), INTS, TEXT, INT_LISTS,
)
COMPILE_VALID = st.fixed_dictionaries(
    {},
    optional={"fullgraph": BOOLS, "dynamic": st.none() | BOOLS, "mode": st.sampled_from(["default", "max-autotune"])},
)
COMPILE_INVALID = st.one_of(st.just({"mode": "fast"}), st.just({"foo": 1}), st.just({"options": {"a": 1}}), INTS, TEXT)

FIELD_CASES = {
    "max_length": int_case(1),
    "max_new_tokens": int_case(1),
    "min_length": int_case(0),
    "min_new_tokens": int_case(0),
    "early_stopping": (
        st.sampled_from([True, False, "never"]),
        st.one_of(TEXT.filter(lambda s: s != "never"), INTS, FLOATS, INT_LISTS),
    ),
    "max_time": real_case(0.0, None, allow_inf=True),
    "stop_strings": (
        st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3)),
        st.one_of(st.just(""), st.just([]), st.just(["a", ""]), INTS, BOOLS, INT_LISTS.filter(bool), DICTS),
    ),
    "do_sample": bool_case(),
    "num_beams": int_case(1, valid_top=8),
    "use_mtp": bool_case(),
    "use_cache": bool_case(),
    "cache_implementation": choice_case(VALID_CACHE_IMPLEMENTATIONS),
    "cache_config": (DICTS, st.one_of(TEXT, INTS, BOOLS, INT_LISTS, FLOATS)),
    "max_cache_len": int_case(1),
    "temperature": real_case(0.0),
    "top_k": int_case(0),
    "top_p": real_case(0.0, 1.0),
    "min_p": real_case(0.0, 1.0),
    "top_h": real_case(0.0, 1.0, low_open=True),
    "typical_p": real_case(0.0, 1.0, low_open=True),
    "epsilon_cutoff": real_case(0.0, 1.0, high_open=True),
    "eta_cutoff": real_case(0.0, 1.0, high_open=True),
    "repetition_penalty": real_case(0.0, low_open=True),
    "encoder_repetition_penalty": real_case(0.0, low_open=True),
    "length_penalty": real_case(),
    "no_repeat_ngram_size": int_case(0),
    "bad_words_ids": (
        st.lists(st.lists(TOKEN, min_size=1, max_size=3), min_size=1, max_size=3),
        st.one_of(st.just([]), st.just([[]]), st.just([[-1]]), st.just([1, 2]), TEXT, INTS, BOOLS),
    ),
    "renormalize_logits": bool_case(),
    "forced_bos_token_id": token_case(),
    "forced_eos_token_id": token_ids_case(),
    "remove_invalid_values": bool_case(),
    "exponential_decay_length_penalty": (
        st.tuples(st.integers(0, 100), st.floats(0.5, 2.0)).flatmap(lambda t: st.sampled_from([t, list(t)])),
        st.one_of(st.just((-1, 1.5)), st.just([1]), st.just([1, 2.0, 3]), st.just((1.5, 2.0)),
                  st.just((1, float("nan"))), TEXT, INTS),
    ),
    "suppress_tokens": token_list_case(),
    "begin_suppress_tokens": token_list_case(),
    "sequence_bias": (SEQUENCE_BIAS_VALID, SEQUENCE_BIAS_INVALID),
    "token_healing": bool_case(),
    "guidance_scale": real_case(),
    "watermarking_config": (WATERMARK_VALID, WATERMARK_INVALID),
    "num_return_sequences": int_case(1, valid_top=8),
    "output_attentions": bool_case(),
    "output_hidden_states": bool_case(),
    "output_scores": bool_case(),
    "output_logits": bool_case(),
    "return_dict_in_generate": bool_case(),
    "pad_token_id": token_case(),
    "bos_token_id": token_case(),
    "eos_token_id": token_ids_case(),
    "encoder_no_repeat_ngram_size": int_case(0),
    "decoder_start_token_id": token_ids_case(),
    "is_assistant": bool_case(),
    "num_assistant_tokens": int_case(1),
    "num_assistant_tokens_schedule": choice_case(("constant", "heuristic", "heuristic_transient")),
    "assistant_confidence_threshold": real_case(0.0, 1.0),
    "prompt_lookup_num_tokens": int_case(1),
    "max_matching_ngram_size": int_case(1),
    "assistant_early_exit": int_case(1),
    "assistant_lookbehind": int_case(0),
    "target_lookbehind": int_case(0),
    "assistant_ensemble_weight": real_case(0.0, 1.0, low_open=True, high_open=True),
    "speculation_type": choice_case(("dflash",)),
    "response_format": (
        st.sampled_from([None, {"type": "text"}, {"type": "json_object"}, {"type": "regex", "pattern": "a+"},
                         {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
                         {"type": "choice", "choices": ["a", "b"]}, {"json": {"type": "integer"}}]),
        st.one_of(INTS, TEXT, st.just({"type": "xml"}), st.just({"type": "regex"}),
                  st.just({"type": "choice", "choices": []})),
    ),
    "grammar_engine": choice_case(("llguidance", "xgrammar")),
    "compile_config": (COMPILE_VALID, COMPILE_INVALID),
    "disable_compile": bool_case(),
    "batch_invariant": bool_case(),
    "prefill_chunk_size": int_case(1),
}
EXTRA_CASES = {
    "my_custom_flag": (st.one_of(INTS, TEXT, INT_LISTS), st.nothing()),
    "streamer": (st.nothing(), st.just("a streamer")),
    "validate": (st.nothing(), INTS),
}
ALL_CASES = {**FIELD_CASES, **EXTRA_CASES}
# compile_config: genfn accepts a dict (transformers wants a CompileConfig object), so it is left
# out where transformers is the oracle.
# response_format / grammar_engine are genfn's own fields: transformers keeps them as free attributes.
PARITY_FIELDS = sorted(set(FIELD_CASES) - {"compile_config"} - set(GENFN_ONLY_FIELDS))


def test_fuzz_table_covers_every_field():
    assert set(FIELD_CASES) == set(GENERATION_CONFIG_FIELDS)


@st.composite
def config_dicts(draw, names=tuple(sorted(ALL_CASES)), valid_only=False):
    """(kwargs, names given an invalid value)."""
    keys = draw(st.lists(st.sampled_from(names), unique=True, max_size=8))
    kwargs, bad = {}, set()
    for key in keys:
        valid, invalid = ALL_CASES[key]
        if valid_only or invalid.is_empty or (not valid.is_empty and draw(st.integers(0, 3)) > 0):
            if valid.is_empty:
                continue
            kwargs[key] = draw(valid)
        else:
            kwargs[key] = draw(invalid)
            bad.add(key)
    return kwargs, bad


@FUZZ
@given(config_dicts(), st.booleans())
def test_fuzz_validate_raises_only_value_or_type_errors_naming_a_field(case, strict):
    kwargs, bad = case
    try:
        quiet(lambda: GenerationConfig(**copy.deepcopy(kwargs)).validate(strict=strict))
    except (ValueError, TypeError) as err:
        named = bad or set(kwargs)
        assert any(f"`{name}`" in str(err) for name in named), (str(err), kwargs)
    else:
        assert not bad, f"accepted invalid {bad}: {kwargs}"


@FUZZ
@given(config_dicts(names=tuple(PARITY_FIELDS), valid_only=True), st.data())
def test_fuzz_raise_and_warn_match_transformers(case, data):
    kwargs, _ = case
    # genfn-only error: temperature 0 with sampling crashes transformers later, in generate.
    assume(not (kwargs.get("do_sample") is True and kwargs.get("temperature") == 0))
    ours, ours_err = outcome(lambda: GenerationConfig(**copy.deepcopy(kwargs)))
    theirs, theirs_err = outcome(lambda: TGenerationConfig(**copy.deepcopy(kwargs)))
    assert (ours_err is None) == (theirs_err is None), (ours_err, theirs_err, kwargs)
    if ours_err is not None:
        assert isinstance(ours_err, (ValueError, TypeError))
        return
    user_set = data.draw(st.none() | st.sets(st.sampled_from(sorted(kwargs) or ["top_k"])))
    _, ours_strict = outcome(lambda: ours.validate(strict=True, user_set_attributes=user_set))
    _, theirs_strict = outcome(lambda: theirs.validate(strict=True, user_set_attributes=user_set))
    assert (ours_strict is None) == (theirs_strict is None), (ours_strict, theirs_strict, kwargs)
    if ours_strict is not None:
        assert flagged(str(ours_strict)) == flagged(str(theirs_strict))
    # non-strict: a logged warning exactly when strict mode found contradictions, naming the same
    # flags as transformers' logged warning
    with logs(OURS_LOGGER) as ours_log:
        ours.validate(user_set_attributes=user_set)
    with logs(THEIRS_LOGGER) as theirs_log:
        theirs.validate(user_set_attributes=user_set)
    assert logged_flags(ours_log) == (flagged(str(ours_strict)) if ours_strict is not None else set())
    assert logged_flags(ours_log) == logged_flags(theirs_log)


@FUZZ
@given(config_dicts(names=tuple(PARITY_FIELDS), valid_only=True))
def test_fuzz_json_round_trips_both_ways(case):
    kwargs, _ = case
    ours, ours_err = outcome(lambda: GenerationConfig(**copy.deepcopy(kwargs)))
    theirs, theirs_err = outcome(lambda: TGenerationConfig(**copy.deepcopy(kwargs)))
    assume(ours_err is None and theirs_err is None)
    assert ours_data(ours) == theirs_data(theirs)
    assert json.loads(ours.to_json_string(ignore_metadata=True)) == json.loads(
        theirs.to_json_string(ignore_metadata=True)
    )
    from_ours = quiet(TGenerationConfig.from_dict, json.loads(ours.to_json_string()))
    from_theirs = quiet(GenerationConfig.from_dict, json.loads(theirs.to_json_string()))
    assert theirs_data(from_ours) == ours_data(ours)
    assert ours_data(from_theirs) == theirs_data(theirs)
    assert from_theirs == quiet(GenerationConfig.from_dict, json.loads(ours.to_json_string()))


# ------------------------------------------------------------------------------------------------
# resolution used by generate, against transformers' own generate helpers
# ------------------------------------------------------------------------------------------------


class _StubModelConfig:
    is_encoder_decoder = False

    def __init__(self, max_position_embeddings):
        self.max_position_embeddings = max_position_embeddings

    def _get_generation_parameters(self):
        return {}


class _StubModel:
    """Just enough of a model for GenerationMixin's config-preparation methods."""

    def __init__(self, generation_config, max_position_embeddings=None):
        self.generation_config = generation_config
        self.config = _StubModelConfig(max_position_embeddings)


RESOLVE_CASES = [
    # (model generation_config.json, passed config kwargs or None, generate kwargs, prompt length, max positions)
    ({}, None, {}, 5, None),
    ({"max_length": 50}, None, {}, 5, None),
    ({}, None, {"max_new_tokens": 7}, 5, None),
    ({"max_new_tokens": 30, "do_sample": True, "temperature": 0.6, "top_p": 0.9}, {"do_sample": False}, {}, 4, None),
    ({"do_sample": True, "top_k": 20}, {"top_k": 5}, {"max_new_tokens": 3, "foo": 1}, 4, None),
    ({}, None, {"min_new_tokens": 3, "max_new_tokens": 10}, 4, None),
    ({"min_length": 30}, None, {"max_new_tokens": 4}, 2, None),
    ({"min_length": 2}, None, {"min_new_tokens": 4, "max_length": 40}, 2, None),
    ({}, None, {}, 10, 16),
    ({"max_length": 5}, None, {}, 5, None),
    ({"cache_implementation": "hybrid", "custom_model_key": 1}, {"custom_passed": 2}, {}, 3, None),
    ({"eos_token_id": [1, 2], "pad_token_id": 0}, None, {"num_beams": 4, "num_return_sequences": 2}, 3, None),
    ({"bos_token_id": 1, "_from_model_config": True, "transformers_version": "4.30.0"}, None, {"top_p": 0.5}, 3, None),
]


@pytest.fixture(scope="module")
def generation_mixin():
    from transformers.generation.utils import GenerationMixin

    return GenerationMixin


def _theirs_resolve(mixin, model_kwargs, passed_kwargs, call_kwargs, prompt_len, max_positions):
    import torch

    model = _StubModel(TGenerationConfig(**model_kwargs), max_positions)
    passed = TGenerationConfig(**passed_kwargs) if passed_kwargs is not None else None
    has_default_max = (call_kwargs.get("max_length") is None and (passed is None or passed.max_length is None)
                       and model.generation_config.max_length is None)
    has_default_min = (call_kwargs.get("min_length") is None and (passed is None or passed.min_length is None)
                       and model.generation_config.min_length is None)
    config, unused = mixin._prepare_generation_config(model, passed, **copy.deepcopy(call_kwargs))
    resolved = copy.deepcopy(config)
    config = mixin._prepare_generated_length(
        model, config, has_default_max, has_default_min, "input_ids", prompt_len, torch.zeros(1, prompt_len)
    )
    mixin._validate_generated_length(model, config, prompt_len, has_default_max)
    return resolved, unused, (config.max_length, config.min_length)


@pytest.mark.parametrize(("model_kwargs", "passed_kwargs", "call_kwargs", "prompt_len", "max_positions"), RESOLVE_CASES)
def test_resolution_and_lengths_equal_transformers_generate(
    generation_mixin, model_kwargs, passed_kwargs, call_kwargs, prompt_len, max_positions
):
    model_config = quiet(GenerationConfig, **copy.deepcopy(model_kwargs))
    passed = quiet(GenerationConfig, **passed_kwargs) if passed_kwargs is not None else None
    snapshots = (model_config.to_dict(), passed.to_dict() if passed else None)

    ours, ours_unused = quiet(resolve_generation_config, model_config, passed, call_kwargs)
    theirs, theirs_unused, theirs_lengths = None, None, None
    theirs_err = None
    try:
        theirs, theirs_unused, theirs_lengths = quiet(
            _theirs_resolve, generation_mixin, model_kwargs, passed_kwargs, call_kwargs, prompt_len, max_positions
        )
    except ValueError as err:
        theirs_err = err

    assert (model_config.to_dict(), passed.to_dict() if passed else None) == snapshots  # inputs untouched
    if theirs_err is not None:
        with pytest.raises(ValueError, match="max_length"):
            quiet(resolve_lengths, ours, prompt_len, max_positions)
        return
    assert ours_unused == theirs_unused
    assert ours_data(ours) == without_deprecated(theirs_data(theirs))
    assert quiet(resolve_lengths, ours, prompt_len, max_positions) == theirs_lengths


def test_resolve_accepts_a_generation_config_json_dict():
    ours, _ = quiet(resolve_generation_config, {"do_sample": True, "top_k": 3}, None, {"max_new_tokens": 2})
    assert (ours.do_sample, ours.top_k, ours.top_p, ours.max_new_tokens) == (True, 3, 1.0, 2)
    assert resolve_lengths(ours, 4) == (6, 0)


def test_resolve_lengths_on_unresolved_configs_and_bad_inputs():
    with pytest.warns(UserWarning, match="max_length"):
        assert resolve_lengths(GenerationConfig(), 3) == (23, 0)
    assert resolve_lengths(GenerationConfig(max_length=10, min_new_tokens=2), 3) == (10, 5)
    with pytest.raises(ValueError, match="prompt_len"):
        resolve_lengths(GenerationConfig(max_new_tokens=2), -1)
    with pytest.raises(TypeError, match="prompt_len"):
        resolve_lengths(GenerationConfig(max_new_tokens=2), 2.5)


# ------------------------------------------------------------------------------------------------
# Python protocol, nested configs
# ------------------------------------------------------------------------------------------------


def test_equality_copy_hash_and_repr():
    config = GenerationConfig(do_sample=True, top_k=4, eos_token_id=[1, 2], custom=[1])
    clone = config.copy()
    assert clone == config and hash(clone) == hash(config) and clone is not config
    clone.eos_token_id.append(3)
    assert config.eos_token_id == [1, 2] and clone != config
    assert copy.deepcopy(config) == config
    assert repr(config).startswith("GenerationConfig {") and '"top_k": 4' in repr(config)
    assert config != TGenerationConfig(do_sample=True, top_k=4)
    assert GenerationConfig(transformers_version="1.0") == GenerationConfig()  # metadata is not compared


def test_replace_is_functional_and_strict_about_names():
    config = GenerationConfig(do_sample=True)
    new = config.replace(top_k=3)
    assert new.top_k == 3 and config.top_k is None
    with pytest.raises(TypeError, match="top_kk"):
        config.replace(top_kk=3)


def test_normalize_sequence_bias_accepts_every_spelling():
    expected = {(1, 2): 1.5, (3,): -1.0}
    assert normalize_sequence_bias({(1, 2): 1.5, (3,): -1}) == expected
    assert normalize_sequence_bias({"(1, 2)": 1.5, "(3,)": -1.0}) == expected
    assert normalize_sequence_bias([[[1, 2], 1.5], [[3], -1.0]]) == expected


@pytest.mark.parametrize(
    ("build", "error", "fragment"),
    [
        (lambda: CompileConfig(mode="fast"), ValueError, "mode"),
        (lambda: CompileConfig(fullgraph="yes"), TypeError, "fullgraph"),
        (lambda: CompileConfig(options={"triton.cudagraphs": True}), ValueError, "options"),
        (lambda: CompileConfig.from_dict({"nope": 1}), TypeError, "nope"),
        (lambda: WatermarkingConfig(context_width=0), ValueError, "context_width"),
        (lambda: WatermarkingConfig(greenlist_ratio=1.5), ValueError, "greenlist_ratio"),
        (lambda: SynthIDTextWatermarkingConfig(ngram_len=5, keys=[1], sampling_table_size=2**25), ValueError,
         "sampling_table_size"),
        (lambda: SynthIDTextWatermarkingConfig(ngram_len=0, keys=[1]), ValueError, "ngram_len"),
        (lambda: SynthIDTextWatermarkingConfig(ngram_len=2, keys=[]), ValueError, "keys"),
        (lambda: ContinuousBatchingConfig(page_size=2), ValueError, "page_size"),
        (lambda: ContinuousBatchingConfig(scheduler_type="lifo"), ValueError, "scheduler_type"),
        (lambda: ContinuousBatchingConfig(use_cuda_graph=(True,)), TypeError, "use_cuda_graph"),
        (lambda: ContinuousBatchingConfig(max_memory_percent=1.5), ValueError, "max_memory_percent"),
        (lambda: ContinuousBatchingConfig(default_compile_level=4), ValueError, "default_compile_level"),
    ],
)
def test_nested_configs_validate_with_named_errors(build, error, fragment):
    with pytest.raises(error, match=fragment):
        build()


def test_nested_configs_round_trip_through_dicts():
    assert CompileConfig.from_dict(CompileConfig(dynamic=True, mode=None, options={"a": 1}).to_dict()) == CompileConfig(
        dynamic=True, mode=None, options={"a": 1}
    )
    watermark = WatermarkingConfig.from_dict({"bias": 1.0}, context_width=3)
    assert watermark == WatermarkingConfig(bias=1.0, context_width=3)
    assert dict(watermark) == watermark.to_dict()
    synthid = SynthIDTextWatermarkingConfig(ngram_len=3, keys=[1, 2])
    assert SynthIDTextWatermarkingConfig.from_dict(synthid.to_dict()) == synthid
    batching = ContinuousBatchingConfig(decode_compile_config={"mode": "default"}, use_cuda_graph=(True, False))
    assert batching.decode_compile_config == CompileConfig(mode="default")
    assert ContinuousBatchingConfig.from_dict(batching.to_dict()) == batching
    assert batching.cuda_graph_booleans == (True, False)
    assert ContinuousBatchingConfig(use_cuda_graph=True).cuda_graph_booleans == (True, True)


def test_continuous_batching_deprecated_fields_translate_like_transformers():
    with logs() as log:
        ours = ContinuousBatchingConfig(block_size=128)
        levels = ContinuousBatchingConfig(use_default_compile_configs=True)
    with logs(THEIRS_LOGGER) as theirs_log:
        theirs = TContinuousBatchingConfig(block_size=128)
        their_levels = TContinuousBatchingConfig(use_default_compile_configs=True)
    ours_warnings, theirs_warnings = log.messages(logging.WARNING), theirs_log.messages(logging.WARNING)
    assert len(ours_warnings) == len(theirs_warnings) == 2
    assert "block_size" in ours_warnings[0] and "use_default_compile_configs" in ours_warnings[1]
    assert ours.page_size == theirs.page_size == 128
    assert levels.default_compile_level == their_levels.default_compile_level
