"""Hypothesis over the API's own schema: request bodies drawn from the pydantic models' JSON Schema
(each field left out, valid by its schema, or any JSON at all) and raw junk, sent to
``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` of a server over a tiny random
model. Every answer is a 2xx (a stream ends with ``[DONE]``) or a 4xx in OpenAI's error shape:
never a 500, never a hang. Derandomized and bounded (~200 cases)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from genfn.config.batching import ContinuousBatchingConfig
from genfn.batching.manager import ContinuousBatchingManager
from genfn.serve import create_app
from genfn.serve.schemas import ChatCompletionRequest, CompletionRequest
from test_serve import MODEL, ServerThread, tiny_chat_model

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
REQUEST_S = 60  # one request's answer, at most
# No shrinking: a failure is reported as drawn, so a run stays bounded.
FUZZ = settings(max_examples=70, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
                    | st.text(max_size=12), lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def from_schema(schema: dict, defs: dict, depth: int = 0) -> st.SearchStrategy:
    """Values valid by a (pydantic-written) JSON Schema: the keywords pydantic uses, bounded sizes."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs, depth)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for union in ("anyOf", "oneOf"):
        if union in schema:
            return st.one_of([from_schema(s, defs, depth) for s in schema[union]])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -2**31 - 1) + 1)
        high = schema.get("maximum", schema.get("exclusiveMaximum", 2**31 + 1) - 1)
        return st.integers(low, high)
    if kind == "number":
        return st.floats(schema.get("minimum", schema.get("exclusiveMinimum")),
                         schema.get("maximum", schema.get("exclusiveMaximum")),
                         exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema,
                         allow_nan=False, allow_infinity=False)
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 16), 16))
    if kind == "array":
        items = from_schema(schema.get("items", {}), defs, depth + 1) if depth < 4 else JSON
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=3)
    if kind == "object" and "properties" in schema and depth < 5:
        return object_from_schema(schema, defs, depth + 1)
    return JSON


def object_from_schema(schema: dict, defs: dict, depth: int = 0) -> st.SearchStrategy:
    required = set(schema.get("required", ()))
    fields = {name: from_schema(sub, defs, depth) for name, sub in schema["properties"].items()}
    return st.fixed_dictionaries({n: s for n, s in fields.items() if n in required},
                                 optional={n: s for n, s in fields.items() if n not in required})


@st.composite
def body_of(draw, model) -> dict:
    """A body valid by the schema (the fields each in or out), often with one field's value
    replaced by any JSON, sometimes a field nobody documents; ``model`` names the served model
    unless it was replaced."""
    schema = model.model_json_schema()
    body = draw(object_from_schema(schema, schema.get("$defs", {})))
    body["model"] = MODEL
    mutation = draw(st.sampled_from(["none", "none", "value", "field"]))
    if mutation == "value":
        body[draw(st.sampled_from(sorted(schema["properties"])))] = draw(JSON)
    elif mutation == "field":
        body[draw(st.text(min_size=1, max_size=8))] = draw(JSON)
    return body


def _cheap(body):
    """Keep generation short (the point is the answer's shape, not the engine's speed)."""
    if isinstance(body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(name), int) and not isinstance(body[name], bool) and body[name] > 4:
                body[name] = 4
        if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 2:
            body["n"] = 2
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 2
    return body


@pytest.fixture(scope="module")
def server():
    model = tiny_chat_model(context=128)  # a short context bounds any request the fuzzer can make
    config = ContinuousBatchingConfig(page_size=16, num_blocks=256, max_batch_tokens=256, max_requests_per_batch=16)
    manager = ContinuousBatchingManager(model, continuous_batching_config=config)
    manager.start()
    try:
        with ServerThread(create_app(manager, model.tokenizer, model_name=MODEL)) as running:
            with httpx.Client(base_url=running.url, timeout=REQUEST_S) as http:
                yield http
    finally:
        manager.stop(block=True, timeout=REQUEST_S)


def _check(http: httpx.Client, path: str, content: bytes) -> None:
    with http.stream("POST", path, content=content, headers={"content-type": "application/json"}) as response:
        raw = response.read()
    status = response.status_code
    assert status < 500, (status, raw[:500], content[:500])
    if status >= 400:
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], raw
        assert error["type"] == "invalid_request_error" or status == 404, raw
        return
    assert 200 <= status < 300
    if response.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in raw.decode().split("\n") if line]
        assert lines[-1] == "data: [DONE]" and "event: error" not in lines, lines[-3:]
        for line in lines[:-1]:
            json.loads(line[len("data: "):])
    else:
        assert json.loads(raw)["choices"]


@FUZZ
@given(body=body_of(ChatCompletionRequest))
def test_fuzz_chat_completions(server, body):
    _check(server, "/v1/chat/completions", json.dumps(_cheap(body)).encode())


@FUZZ
@given(body=body_of(CompletionRequest))
def test_fuzz_completions(server, body):
    _check(server, "/v1/completions", json.dumps(_cheap(body)).encode())


@settings(FUZZ, max_examples=40)
@given(junk=st.binary(max_size=64) | JSON.map(lambda v: json.dumps(v).encode()),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_fuzz_junk_bodies(server, junk, path):
    _check(server, path, junk)


def test_models_endpoint(server):
    listing = server.get("/v1/models").json()
    assert listing["object"] == "list" and listing["data"][0]["id"] == MODEL
    assert server.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    missing = server.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
