"""Constrained output through the server, with the official ``openai`` client, on 127.0.0.1 with a
tiny random Llama: ``chat.completions.parse`` with a pydantic model (``response_format`` json_schema)
returns a parsed object, a required tool call is decoded under the tools' schema, and a schema the
engine cannot compile is an OpenAI-shaped 400. A random model writes whatever the grammar lets it,
so every pass here is the grammar's doing. Every wait has a timeout."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

pytest.importorskip("llguidance")

from genfn.batching.manager import ContinuousBatchingManager  # noqa: E402
from genfn.config.batching import ContinuousBatchingConfig  # noqa: E402
from genfn.serve import create_app  # noqa: E402
from test_serve import MODEL, WAIT_S, ServerThread, tiny_chat_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class Verdict(BaseModel):
    answer: Literal["yes", "no", "maybe"]
    confidence: int = Field(ge=0, le=9)


@pytest.fixture(scope="module")
def model():
    return tiny_chat_model()


@pytest.fixture(scope="module")
def server(model):
    config = ContinuousBatchingConfig(page_size=16, num_blocks=512, max_batch_tokens=128, max_requests_per_batch=16)
    manager = ContinuousBatchingManager(model, continuous_batching_config=config)
    manager.start()
    app = create_app(manager, model.tokenizer, model_name=MODEL)
    try:
        with ServerThread(app) as running:
            yield running
    finally:
        manager.stop(block=True, timeout=WAIT_S)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parse_with_a_pydantic_model_returns_the_parsed_object(client, seed):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Is the sea wet?"}], response_format=Verdict,
        max_tokens=48, temperature=1.0, seed=seed)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Verdict)
    assert Verdict.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_schema_holds_for_every_choice_of_n(client):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A colour?"}], n=3, max_tokens=32, temperature=1.0,
        seed=5, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}})
    assert len(completion.choices) == 3
    for choice in completion.choices:
        assert json.loads(choice.message.content)["colour"] in ("red", "green", "blue")


def test_a_required_tool_call_is_decoded_under_the_tools_schema(client):
    tool = {"type": "function", "function": {
        "name": "set_level", "parameters": {"type": "object", "properties": {"level": {"type": "integer",
                                                                                     "minimum": 0, "maximum": 5}},
                                            "required": ["level"], "additionalProperties": False}}}
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Set the level."}], tools=[tool], tool_choice="required",
        max_tokens=48, temperature=1.0, seed=3)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "set_level"
    assert 0 <= json.loads(call.function.arguments)["level"] <= 5


def test_a_schema_that_cannot_compile_is_a_400(client):
    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}, "required": ["a"]}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
    error = caught.value.body
    assert caught.value.status_code == 400 and isinstance(error, dict) and error.get("message")
