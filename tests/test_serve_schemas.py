"""The server's request models and the pure parts around them: OpenAI-shaped 400s naming the
field for every kind of bad body, the fields clients send that genfn accepts and ignores, tools
(validation, rendering, parsing the reply into tool calls, streamed or not), output constraints,
and the sampling defaults."""

from __future__ import annotations

import json
import random

import pytest

from genfn.config import GenerationConfig
from genfn.serve.defaults import CHAT_DEFAULTS, parse_sampling_defaults, sampling_defaults
from genfn.serve.errors import APIError
from genfn.serve.params import parse_chat, parse_completion
from genfn.serve.schemas import ChatCompletionRequest
from genfn.serve.structured import constraint_for, engine_constrains
from genfn.serve.tools import ToolCallText, parse_tool_calls, render_prompt, tool_mode

VOCAB = 1000
USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _refused(body, chat=True):
    with pytest.raises(APIError) as refused:
        (parse_chat if chat else parse_completion)(body, {}, VOCAB)
    error = refused.value
    assert error.status == 400 and set(error.body()["error"]) == {"message", "type", "param", "code"}
    assert error.message and error.type == "invalid_request_error" and "{{" not in error.message
    return error


@pytest.mark.parametrize("extra, param, code", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name",
     "missing_required_parameter"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "invalid_value"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", "invalid_value"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "invalid_value"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_type"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "invalid_value"),
    ({"response_format": {"type": "text", "json_schema": {"name": "x", "schema": {}}}},
     "response_format.json_schema", "invalid_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
     "response_format.json_schema.schema", "invalid_type"),
    ({"metadata": {"a": 1}}, "metadata.a", "invalid_type"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id", "missing_required_parameter"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x", "colour": 1}]}, "messages[0].colour", "unknown_parameter"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content",
     "invalid_type"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens", "invalid_value"),
    ({"temperature": float("nan")}, "temperature", "invalid_value"),
    ({"temperature": True}, "temperature", "invalid_type"),
    ({"top_k": -2}, "top_k", "invalid_value"),
    ({"n": 65}, "n", "invalid_value"),
    ({"stop": ["a", 1]}, "stop[1]", "invalid_type"),
    ({"stream_options": {"include_usage": True}, "stream": False}, "stream_options", "invalid_value"),
])
def test_bad_chat_bodies_name_the_field(extra, param, code):
    error = _refused({"messages": USER, **extra})
    assert (error.param, error.code) == (param, code), error.message


@pytest.mark.parametrize("body, param, code", [
    ({"prompt": ["a", 1]}, "prompt[1]", "invalid_type"),
    ({"prompt": []}, "prompt", "invalid_value"),
    ({"prompt": None}, "prompt", "missing_required_parameter"),
    ({"prompt": "x", "logprobs": True}, "logprobs", "invalid_type"),
    ({"prompt": "x", "logit_bias": {"3": "high"}}, "logit_bias", "invalid_type"),
    ({"prompt": "x", "response_format": {"type": "text"}}, "response_format", "unknown_parameter"),
])
def test_bad_completion_bodies_name_the_field(body, param, code):
    error = _refused(body, chat=False)
    assert (error.param, error.code) == (param, code), error.message


def test_fields_clients_send_are_accepted():
    params, messages = parse_chat({"messages": USER, "metadata": {"run": "7"}, "store": False, "service_tier": "auto",
                                   "user": "u-1", "logit_bias": {"5": -100}, "stream": True,
                                   "stream_options": {"include_usage": True}, "response_format": {"type": "text"},
                                   "parallel_tool_calls": False, "tools": [WEATHER], "tool_choice": "none",
                                   "reasoning_effort": "low", "seed": 3}, {}, VOCAB)
    assert params.logit_bias == {5: -100.0} and params.include_usage and params.seed == 3
    assert messages == USER


def test_tool_round_trip_messages_are_kept_for_the_template():
    body = {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "tools": [WEATHER]}
    _, messages = parse_chat(body, {}, VOCAB)
    assert messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def _mode(**extra):
    return tool_mode(ChatCompletionRequest.model_validate({"messages": USER, "tools": [WEATHER, TIME], **extra}))


def test_tool_mode_follows_tool_choice():
    assert tool_mode(ChatCompletionRequest.model_validate({"messages": USER})) is None
    assert _mode(tool_choice="none") is None
    auto = _mode()
    assert auto.names == ["get_weather", "get_time"] and auto.required is None and auto.parallel
    named = _mode(tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    assert named.names == ["get_time"] and named.required == "get_time" and not named.parallel
    assert _mode(tool_choice="required").required == "required"


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', None,
     [("get_weather", {"city": "Oslo"})]),
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "Let me look.",
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ('<tool_call>{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),  # cut before its end tag
    ('  {"name": "get_weather", "parameters": {"city": "Rome"}}', None, [("get_weather", {"city": "Rome"})]),
    ('[{"name": "get_time", "arguments": "{}"}, {"name": "get_weather", "arguments": {"city": "Bo"}}]', None,
     [("get_time", {}), ("get_weather", {"city": "Bo"})]),
    ('{"name": "launch_rockets", "arguments": {}}', '{"name": "launch_rockets", "arguments": {}}', []),
    ('<tool_call>not json</tool_call>', '<tool_call>not json</tool_call>', []),
    ('{"city": "Oslo"}', '{"city": "Oslo"}', []),
    ("It is sunny.", "It is sunny.", []),
])
def test_replies_parse_into_tool_calls(text, content, calls):
    got_content, got = parse_tool_calls(text, _mode())
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got)
    assert len({c["id"] for c in got}) == len(got)


def test_one_call_only_when_parallel_calls_are_off():
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_time", ' \
           '"arguments": {}}</tool_call>'
    assert len(parse_tool_calls(text, _mode(parallel_tool_calls=False))[1]) == 1


@pytest.mark.parametrize("seed", range(40))
def test_streamed_tool_text_sends_only_content_and_ends_with_the_calls(seed):
    rng = random.Random(seed)
    texts = ["Sure. <tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>",
             "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}",
             "No tools needed: 2 < 3 and {braces} are fine.", "  \n <tool_call>{\"name\": \"get_time\"}"]
    text = rng.choice(texts)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream = ToolCallText(_mode())
    sent = "".join(stream.feed(piece) for piece in pieces)
    assert "<tool" not in sent and "{\"name\"" not in sent
    rest, calls = stream.finish()
    whole_content, whole_calls = parse_tool_calls(text, _mode())
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
    if not whole_calls:
        assert sent + rest == text
    else:
        assert (sent + rest).strip() == (whole_content or "")


class _Tokenizer:
    """Records what the chat template is given."""

    def __init__(self, template):
        self.chat_template = template
        self.calls = []

    def apply_chat_template(self, messages, add_generation_prompt=False, tools=None):
        self.calls.append((messages, tools))
        return [1, 2, 3]


def test_tools_reach_a_template_that_reads_them_and_a_system_message_otherwise():
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c"}]
    reads = _Tokenizer("{% if tools %}{{ tools }}{% endif %}")
    assert render_prompt(reads, messages, _mode()) == [1, 2, 3]
    rendered, tools = reads.calls[0]
    assert [t["function"]["name"] for t in tools] == ["get_weather", "get_time"]
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}

    plain = _Tokenizer("{% for m in messages %}{{ m.content }}{% endfor %}")
    render_prompt(plain, messages, _mode(tool_choice="required"))
    rendered, tools = plain.calls[0]
    assert tools is None and rendered[0]["role"] == "system"
    assert "get_weather" in rendered[0]["content"] and "must call" in rendered[0]["content"]
    assert rendered[2] == {"role": "assistant",
                           "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'}
    assert rendered[3]["role"] == "user" and "sunny" in rendered[3]["content"]
    render_prompt(plain, messages[:1], None)
    assert plain.calls[1] == (messages[:1], None)


def test_constraints_go_through_one_function():
    free = ChatCompletionRequest.model_validate({"messages": USER, "response_format": {"type": "text"}})
    assert constraint_for(free, None) is None
    auto = ChatCompletionRequest.model_validate({"messages": USER, "tools": [WEATHER]})
    assert constraint_for(auto, tool_mode(auto)) is None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    shaped = ChatCompletionRequest.model_validate(
        {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    required = ChatCompletionRequest.model_validate({"messages": USER, "tools": [WEATHER], "tool_choice": "required"})
    if engine_constrains():
        assert constraint_for(shaped, None)["response_format"]["json_schema"]["schema"] == schema
        spec = constraint_for(required, tool_mode(required))["response_format"]["json_schema"]["schema"]
        assert spec["items"]["properties"]["name"] == {"const": "get_weather"}
    else:  # refused with a 400, never answered unconstrained
        for request, param in ((shaped, "response_format"), (required, "tool_choice")):
            with pytest.raises(APIError) as refused:
                constraint_for(request, tool_mode(request))
            assert refused.value.status == 400 and refused.value.param == param


def test_sampling_defaults_come_from_the_model_else_the_chat_defaults():
    assert sampling_defaults(None) == CHAT_DEFAULTS
    assert sampling_defaults(GenerationConfig()) == CHAT_DEFAULTS
    tuned = GenerationConfig(temperature=0.6, top_p=0.9, max_new_tokens=64)
    assert sampling_defaults(tuned) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}
    assert sampling_defaults(tuned, "none") == {}
    assert sampling_defaults(None, "temperature=0.2,top-k=5") == {**CHAT_DEFAULTS, "temperature": 0.2, "top_k": 5}
    assert parse_sampling_defaults(" AUTO ") == "auto"


@pytest.mark.parametrize("text, words", [("temperature", ["key=value"]), ("heat=1", ["heat"]),
                                         ("top_k=1.5", ["top_k", "integer"]), ("top_p=2", ["top_p", "1.0"]),
                                         ("temperature=nan", ["temperature"]), ("", ["empty"])])
def test_bad_sampling_defaults_say_why(text, words):
    with pytest.raises(ValueError) as refused:
        parse_sampling_defaults(text)
    assert all(word in str(refused.value) for word in words), str(refused.value)
