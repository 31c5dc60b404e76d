"""Bad input and model faults at ``generate``: every mistake a clear ValueError/TypeError naming the
argument, NaN/inf logits an error under every strategy, and the valid inputs transformers accepts
(float and numpy masks, numpy ids and lengths, processors returning new strided tensors) accepted."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import genfn
from conftest import tiny_hf_model, tiny_pair
from genfn.driver import NonFiniteLogitsError
from genfn.models.loaders.errors import CheckpointError

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

PROMPT = torch.tensor([[5, 6, 7, 8]])


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair()[1]


def _faulty(model, transform):
    """``model`` with ``transform`` applied to every logits tensor its apply returns."""
    def apply_fn(spec, params, tokens, positions, cache, mask=None, **kwargs):
        logits, cache = model.apply_fn(spec, params, tokens, positions, cache, mask, **kwargs)
        return transform(logits), cache
    return genfn.Model(model.spec, model.params, apply_fn, model.init_cache_fn,
                       generation_config=model.generation_config, config=model.config)


def _nan_after(calls: int):
    """A transform whose logits turn NaN (in one row of a batch) from the ``calls``-th apply on."""
    count = {"n": 0}

    def transform(logits):
        count["n"] += 1
        if count["n"] < calls:
            return logits
        out = logits.clone()
        out[-1] = float("nan")
        return out
    return transform


# ---- NaN / inf under every strategy ------------------------------------------------------------

STRATEGIES = {
    "greedy": {},
    "sampling": {"do_sample": True},
    "beam": {"num_beams": 2},
    "beam_sampling": {"num_beams": 2, "do_sample": True},
    "prompt_lookup": {"prompt_lookup_num_tokens": 2},
    "guidance": {"guidance_scale": 1.5},
    "static_cache": {"cache_implementation": "static", "disable_compile": True},
}


@pytest.mark.parametrize("strategy", list(STRATEGIES) + ["draft_model"])
@pytest.mark.parametrize("fault", ["nan_at_prefill", "nan_later", "posinf", "neginf_row"])
def test_nonfinite_logits_raise_under_every_strategy(tiny, strategy, fault):
    transform = {
        "nan_at_prefill": lambda l: torch.full_like(l, float("nan")),
        "nan_later": _nan_after(3),
        "posinf": lambda l: l.index_fill(-1, torch.tensor([4]), float("inf")),
        "neginf_row": lambda l: torch.full_like(l, -float("inf")),
    }[fault]
    model = _faulty(tiny, transform)
    settings = dict(STRATEGIES.get(strategy, {}))
    if strategy == "draft_model":
        settings["assistant_model"] = tiny
    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with pytest.raises(NonFiniteLogitsError, match="NaN or infinite logits"):
        genfn.generate(model, prompt, max_new_tokens=6, key=0, **settings)


@pytest.mark.parametrize("strategy", ["greedy", "beam", "sampling"])
def test_remove_invalid_values_keeps_generating(tiny, strategy):
    model = _faulty(tiny, lambda l: l.index_fill(-1, torch.tensor([4]), float("nan")))
    out = genfn.generate(model, PROMPT, max_new_tokens=4, remove_invalid_values=True, key=0, **STRATEGIES[strategy])
    assert out.shape == (1, 8)


# ---- the model's logits shape ------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["greedy", "beam", "sampling", "prompt_lookup"])
@pytest.mark.parametrize("fault, message", [
    (lambda l: l[..., :50], "50 columns, but its vocabulary"),
    (lambda l: torch.cat([l, l[..., :3]], -1), "100 columns, but its vocabulary"),
    (lambda l: torch.cat([l, l], 0), "but the batch has"),
    (lambda l: l[:1], "but the batch has"),
    (lambda l: l[0, 0], "must return logits"),
])
def test_logits_of_the_wrong_shape_are_refused(tiny, strategy, fault, message):
    model = _faulty(tiny, fault)
    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with pytest.raises(ValueError, match=message):
        genfn.generate(model, prompt, max_new_tokens=4, key=0, **STRATEGIES[strategy])


def test_a_tokenizer_larger_than_the_logits_is_reported(tiny, caplog):
    class BigTokenizer:
        def __len__(self):
            return tiny.vocab_size + 5
    genfn.generate(tiny, PROMPT, max_new_tokens=2, tokenizer=BigTokenizer())
    assert "more than the model's 97 logits columns" in caplog.text


# ---- bad model objects -------------------------------------------------------------------------

@pytest.mark.parametrize("model, message", [
    (None, "model must be a genfn model"),
    ("HuggingFaceTB/SmolLM2-135M", "load it first"),
    (os.path, "has no apply, init_cache, vocab_size, generation_config"),
    (torch.nn.Linear(2, 2), "wrap it first: genfn.from_module"),
    (42, "model must be a genfn model"),
])
def test_a_model_that_is_not_a_model_is_named(model, message):
    with pytest.raises(TypeError, match=message):
        genfn.generate(model, PROMPT, max_new_tokens=2)


def test_a_model_with_a_bad_vocab_size_is_named(tiny):
    class Odd:
        apply = init_cache = generation_config = None
        vocab_size = "97"
    with pytest.raises(TypeError, match="model.vocab_size must be an int"):
        genfn.generate(Odd(), PROMPT, max_new_tokens=2)


def test_a_model_that_raises_in_a_compiled_whole_loop_raises_its_own_error(tiny):
    class Refusal(ValueError):
        pass

    def refuse(logits):
        if logits.shape[1] == 1:  # decode steps only: the prefill passes
            raise Refusal("no single tokens, please")
        return logits
    model = _faulty(tiny, refuse)
    for settings in ({"disable_compile": True}, {}):
        with pytest.raises(Refusal, match="no single tokens, please"):
            genfn.generate(model, PROMPT, max_new_tokens=4, cache_implementation="static", compile_loop=True,
                           **settings)


# ---- bad tokenizers ----------------------------------------------------------------------------

class _VocabOnly:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return self.vocab


@pytest.mark.parametrize("tokenizer, message", [
    (object(), "stop_strings needs a tokenizer .* object has no get_vocab"),
    (_VocabOnly([("a", 1)]), "get_vocab\\(\\) must return a non-empty dict"),
    (_VocabOnly({}), "get_vocab\\(\\) must return a non-empty dict"),
    (_VocabOnly({"a": "1"}), "token string -> int id"),
    (_VocabOnly({1: 1}), "token string -> int id"),
])
def test_stop_strings_with_a_tokenizer_that_cannot_serve_them(tiny, tokenizer, message):
    with pytest.raises(TypeError, match=message):
        genfn.generate(tiny, PROMPT, max_new_tokens=2, stop_strings=["x"], tokenizer=tokenizer)


def test_stop_strings_with_a_decoder_that_mangles_text(tiny):
    """A tokenizers backend whose decoder drops letters: its tokens' text cannot be recovered (it
    was a bare 'substring not found')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate("abcdefxyz")}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="x"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Replace("c", "")

    class Wrapped:
        backend_tokenizer = backend

        def get_vocab(self):
            return backend.get_vocab()
    with pytest.raises(ValueError, match="does not reproduce plain text"):
        genfn.generate(tiny, PROMPT, max_new_tokens=2, stop_strings=["x"], tokenizer=Wrapped())


@pytest.mark.parametrize("tokenizer, message", [
    (object(), "token_healing needs a tokenizer .* object has no get_vocab"),
    (_VocabOnly({"a": 1}), "has no convert_ids_to_tokens\\(\\), decode\\(\\), encode\\(\\)"),
])
def test_token_healing_with_a_tokenizer_that_cannot_serve_it(tiny, tokenizer, message):
    with pytest.raises(TypeError, match=message):
        genfn.generate(tiny, PROMPT, max_new_tokens=2, token_healing=True, tokenizer=tokenizer)


def test_token_healing_with_a_tokenizer_without_special_ids(tiny):
    class NoIds(_VocabOnly):
        def convert_ids_to_tokens(self, i):
            return "a"

        def decode(self, ids, skip_special_tokens=False):
            return "a"

        def encode(self, text):
            return [1]
    with pytest.raises(TypeError, match="bos_token_id, pad_token_id, eos_token_id"):
        genfn.generate(tiny, PROMPT, max_new_tokens=2, token_healing=True, tokenizer=NoIds({"a": 1}))


# ---- bad config files --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(a directory factory writing the tiny model's weights beside a given config.json text)."""
    from safetensors.torch import save_file

    hf_model, config = tiny_hf_model()
    weights = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    root = tmp_path_factory.mktemp("checkpoints")

    def make(name, config_text, generation_text=None, raw: bytes | None = None):
        path = root / name
        path.mkdir()
        save_file(weights, str(path / "model.safetensors"))
        if raw is not None:
            (path / "config.json").write_bytes(raw)
        else:
            (path / "config.json").write_text(config_text if config_text is not None else json.dumps(config))
        if generation_text is not None:
            (path / "generation_config.json").write_text(generation_text)
        return str(path)
    make.config = config
    return make


@pytest.mark.parametrize("name, text, message", [
    ("list", "[1, 2]", "config.json must hold a JSON object .* got a list"),
    ("string", '"llama"', "must hold a JSON object .* got a str"),
    ("null", "null", "must hold a JSON object .* got a NoneType"),
    ("empty", "", "config.json is not valid JSON"),
    ("truncated", '{"model_type": "llama", ', "config.json is not valid JSON"),
])
def test_malformed_config_json_is_named(checkpoint, name, text, message):
    with pytest.raises(CheckpointError, match=message):
        genfn.load(checkpoint(name, text))


def test_config_json_that_is_not_utf8_is_named(checkpoint):
    with pytest.raises(CheckpointError, match="config.json is not valid JSON .*utf-8"):
        genfn.load(checkpoint("latin1", None, raw=b'{"model_type": "\xff"}'))


@pytest.mark.parametrize("key, value", [
    ("hidden_size", "64"), ("vocab_size", 97.5), ("num_hidden_layers", -1), ("num_attention_heads", True),
    ("num_key_value_heads", 0), ("intermediate_size", [96]),
])
def test_config_json_with_a_wrong_type_names_the_key(checkpoint, key, value):
    text = json.dumps({**checkpoint.config, key: value})
    with pytest.raises(CheckpointError, match=f"config.json's {key} must be an int >= 1"):
        genfn.load(checkpoint(f"{key}-{value!r}", text))


@pytest.mark.parametrize("name, text, error, message", [
    ("glist", "[1]", CheckpointError, "generation_config.json must hold a JSON object"),
    ("gempty", "", CheckpointError, "generation_config.json is not valid JSON"),
    ("gtype", '{"max_new_tokens": "x"}', TypeError, "`max_new_tokens` must be an int"),
    ("grange", '{"temperature": -1}', ValueError, "`temperature` must be a finite number"),
])
def test_malformed_generation_config_json_is_named(checkpoint, name, text, error, message):
    with pytest.raises(error, match=message):
        genfn.load(checkpoint(name, None, text))


@pytest.mark.parametrize("text, message", [
    ("[1]", "must hold a JSON object"), ("", "is not a valid JSON file"), ("{", "is not a valid JSON file"),
])
def test_generation_config_from_pretrained_names_the_file(tmp_path, text, message):
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(OSError, match=message):
        genfn.GenerationConfig.from_pretrained(str(tmp_path))


# ---- valid input accepted ----------------------------------------------------------------------

def test_float_and_numpy_masks_equal_the_integer_mask(tiny):
    prompt = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    mask[0, 0] = 0
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    expected = genfn.generate(tiny, prompt, attention_mask=mask, max_new_tokens=5)
    for other in (mask.float(), mask.double(), mask.bool(), mask.numpy(), mask.numpy().astype(np.float32),
                  mask.tolist()):
        assert torch.equal(genfn.generate(tiny, prompt, attention_mask=other, max_new_tokens=5), expected)
    assert torch.equal(genfn.generate(tiny, prompt.numpy(), attention_mask=mask.numpy(), max_new_tokens=5), expected)


@pytest.mark.parametrize("mask, message", [
    (torch.tensor([[0.5, 1.0, 1.0, 1.0]]), "only 0 \\(padding\\) and 1"),
    (torch.tensor([[1.0, 1.0, 0.0, 1.0]]), "right padding"),
    (torch.ones(1, 4, dtype=torch.complex64), "integer, bool or float dtype"),
    (np.array([[1, 1, 2, 1]]), "only 0 \\(padding\\) and 1"),
    ("1111", "attention_mask must be a torch.Tensor"),
])
def test_bad_masks_are_still_refused(tiny, mask, message):
    with pytest.raises((ValueError, TypeError), match=message):
        genfn.generate(tiny, PROMPT, attention_mask=mask, max_new_tokens=2)


def test_numpy_scalars_for_lengths_and_settings(tiny):
    expected = genfn.generate(tiny, PROMPT, max_new_tokens=6, min_new_tokens=2, num_beams=2, length_penalty=0.5)
    got = genfn.generate(tiny, PROMPT, max_new_tokens=np.int64(6), min_new_tokens=np.int32(2), num_beams=np.int64(2),
                         length_penalty=np.float32(0.5))
    assert torch.equal(got, expected)
    config = genfn.GenerationConfig(max_length=np.int64(10), do_sample=np.bool_(True), temperature=np.float64(0.7))
    assert type(config.max_length) is int and type(config.do_sample) is bool and type(config.temperature) is float
    assert json.loads(config.to_json_string())["max_length"] == 10


@pytest.mark.parametrize("strategy", ["greedy", "beam", "sampling"])
def test_a_processor_returning_a_new_strided_tensor(tiny, strategy):
    def identity(ids, scores):
        return scores.clone()

    def transposed(ids, scores):
        return scores.T.contiguous().T  # a new tensor, column-major

    def from_wider(ids, scores):
        return torch.cat([scores, scores], dim=-1)[:, : scores.shape[-1]]  # a slice of a wider tensor

    def as_double(ids, scores):
        return scores.double()
    settings = dict(STRATEGIES[strategy], max_new_tokens=4, key=0)
    expected = genfn.generate(tiny, PROMPT, logits_processor=[identity], **settings)
    for processor in (transposed, from_wider, as_double):
        assert torch.equal(genfn.generate(tiny, PROMPT, logits_processor=[processor], **settings), expected)
