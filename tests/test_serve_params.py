"""The server's pure parts: stop-string hold-back over every way of splitting a text, the request
body checks and their defaults, per-choice seeds, and the manager settings a request maps to."""

from __future__ import annotations

import random

import pytest

from genfn.config import GenerationConfig
from genfn.serve.errors import APIError
from genfn.serve.params import (SamplingParams, choice_seed, defaults_from_config, manager_settings, parse_chat,
                                parse_completion)
from genfn.serve.stoptext import StopTextFilter, cut_at_stop

VOCAB = 1000
_USER = [{"role": "user", "content": "hi"}]


def _pieces(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("seed", range(200))
def test_stop_filter_sends_the_text_before_the_first_stop_however_it_is_split(seed):
    rng = random.Random(seed)
    alphabet = "ab\n"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    expected, found = cut_at_stop(text, stops)
    stop_filter = StopTextFilter(stops)
    sent = ""
    for piece in _pieces(text, rng):
        sent += stop_filter.feed(piece)
        # Nothing sent may be part of a stop string, complete or still forming.
        assert expected.startswith(sent)
        assert not any(s in sent for s in stops)
    sent += stop_filter.finish()
    assert sent == expected and stop_filter.stopped == found


def test_stop_filter_holds_back_only_a_possible_stop_start():
    stop_filter = StopTextFilter(["END"])
    assert stop_filter.feed("the E") == "the "
    assert stop_filter.feed("N") == ""
    assert stop_filter.feed("X and") == "ENX and"
    assert stop_filter.feed(" EN") == " "
    assert stop_filter.feed("D more") == "" and stop_filter.stopped
    assert stop_filter.feed("after") == "" and stop_filter.finish() == ""


def test_chat_defaults_come_from_the_generation_config():
    config = GenerationConfig(temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=64)
    defaults = defaults_from_config(config)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 64}
    params, messages = parse_chat({"messages": _USER}, defaults, VOCAB)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.9, 20, 64)
    assert messages == _USER
    params, _ = parse_chat({"messages": _USER, "temperature": 0, "top_k": -1, "max_completion_tokens": 5},
                           defaults, VOCAB)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 0, 5)
    plain, _ = parse_chat({"messages": _USER}, {}, VOCAB)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.max_tokens) == (1.0, 1.0, 0, None)


def test_chat_messages_are_normalised():
    body = {"messages": [{"role": "developer", "content": "rules"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    _, messages = parse_chat(body, {}, VOCAB)
    assert messages == [{"role": "system", "content": "rules"}, {"role": "user", "content": "ab"}]
    with pytest.raises(APIError) as image:
        parse_chat({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, {}, VOCAB)
    assert image.value.param == "messages[0].content"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": "x", "stop": ""}, "stop"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "other": 1}}, "stream_options.other"),
    ({"prompt": "x", "model": 5}, "model"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
])
def test_completion_fields_are_checked(body, param):
    with pytest.raises(APIError) as refused:
        parse_completion(body, {}, VOCAB)
    assert refused.value.status == 400 and refused.value.param == param
    assert refused.value.body()["error"]["param"] == param


def test_choice_seeds_keep_the_first_and_differ_for_the_rest():
    assert choice_seed(5, 0) == 5
    seeds = [choice_seed(5, i) for i in range(64)]
    assert len(set(seeds)) == 64 and all(0 <= s < 2**62 for s in seeds)
    assert [choice_seed(5, i) for i in range(64)] == seeds
    assert choice_seed(6, 1) != choice_seed(5, 1)


def test_manager_settings_pass_only_what_a_request_sets():
    greedy = manager_settings(SamplingParams(model=None, temperature=0.0), 7, 0)
    assert greedy == {"max_new_tokens": 7, "do_sample": False}
    params = SamplingParams(model=None, temperature=0.5, top_p=0.8, top_k=3, min_p=0.1, repetition_penalty=1.2,
                            presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={3: 2.0}, stop=("x",), seed=9,
                            top_logprobs=2)
    second = manager_settings(params, 4, 1)
    assert second == {"max_new_tokens": 4, "do_sample": True, "temperature": 0.5, "top_p": 0.8, "top_k": 3,
                      "min_p": 0.1, "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                      "logit_bias": {3: 2.0}, "top_logprobs": 2, "stop_strings": ["x"], "seed": choice_seed(9, 1)}


@pytest.fixture(scope="module")
def tokenizer():
    from conftest import smollm2_path
    from genfn.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_path())


def test_choice_text_never_sends_half_a_character_or_a_forming_stop(tokenizer):
    """Token by token through a byte-level BPE (an emoji spans several tokens): every piece sent is
    whole text, nothing of the stop string is sent, and the pieces add up to the text before it."""
    from genfn.serve.choices import ChoiceText

    text = "Tea 🍵 and café — naïve 日本語 END of the story"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the text must split a character across tokens"
    choice = ChoiceText(tokenizer, ["END"], max_new_tokens=len(ids), eos_token_ids=[tokenizer.eos_token_id])
    pieces = [choice.advance(ids[:count])[0] for count in range(1, len(ids) + 1)]
    pieces.append(choice.finish(ids)[0])
    assert all("\ufffd" not in piece and "E" not in piece for piece in pieces)
    assert "".join(pieces) == "Tea 🍵 and café — naïve 日本語 "
    assert choice.finish_reason == "stop"

    whole = ChoiceText(tokenizer, [], max_new_tokens=len(ids), eos_token_ids=[tokenizer.eos_token_id])
    assert whole.finish(ids)[0] == text and whole.finish_reason == "length"
    early = ChoiceText(tokenizer, [], max_new_tokens=len(ids) + 1, eos_token_ids=[tokenizer.eos_token_id])
    assert early.finish(ids + [tokenizer.eos_token_id])[0] == text and early.finish_reason == "stop"
