"""The server under faults and load, on 127.0.0.1 with a tiny random Llama: a client that reads
slowly (one output held per choice), 200 streams that leave at random points (every block free
after), bodies of 10 MB (413) and malformed UTF-8 (400), requests during shutdown (503), the
schema at /openapi.json and /docs, and the ``openai`` client's surface: tools in, ``tool_calls``
out (whole and streamed), a tool result back in, and the fields clients send. Every wait has a
timeout; every loop is bounded."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import httpx
import openai
import pytest

from genfn.batching.manager import ContinuousBatchingManager
from genfn.batching.requests import RequestStatus
from genfn.batching.results import GenerationOutput
from genfn.config.batching import ContinuousBatchingConfig
from genfn.serve import create_app
from genfn.serve.runs import Drain, Run
from test_serve import MODEL, WAIT_S, ServerThread, _greedy_text, _idle, _wait_until, tiny_chat_model

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


@pytest.fixture(scope="module")
def model():
    return tiny_chat_model()


@pytest.fixture(scope="module")
def manager(model):
    config = ContinuousBatchingConfig(page_size=16, num_blocks=1024, max_batch_tokens=256, max_requests_per_batch=64)
    manager = ContinuousBatchingManager(model, continuous_batching_config=config)
    manager.start()
    yield manager
    manager.stop(block=True, timeout=WAIT_S)


@pytest.fixture(scope="module")
def server(manager, model):
    app = create_app(manager, model.tokenizer, model_name=MODEL, max_body_bytes=1024 * 1024)
    with ServerThread(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0)


# ---- back-pressure ---------------------------------------------------------------------------------


class _Output:
    def __init__(self, request_id, tokens, finished=False):
        self.request_id, self.generated_tokens, self._finished = request_id, tokens, finished

    def is_finished(self):
        return self._finished


def test_a_run_holds_one_output_per_choice_however_many_arrive():
    class Pump:
        def subscribe(self, ids, callback):
            self.callback = callback

        def unsubscribe(self, ids):
            pass

    class Manager:
        def add_request(self, *args, **kwargs):
            pass

    async def scenario():
        pump = Pump()
        run = Run(Manager(), pump, Drain(), "t")
        await run.submit([[1], [2]], [{}, {}], streaming=True)
        for step in range(10_000):  # a client that reads nothing while 10,000 outputs arrive
            pump.callback(_Output(run.request_ids[step % 2], list(range(step // 2 + 1))))
        assert run.backlog == 2
        first, second = await run.next(), await run.next()
        assert {first.request_id, second.request_id} == set(run.request_ids)
        assert {len(first.generated_tokens), len(second.generated_tokens)} == {5000}
        pump.callback(_Output(run.request_ids[0], [0] * 5001, finished=True))
        last = await run.next()
        assert last.is_finished() and run.open == {run.request_ids[1]}

    asyncio.run(asyncio.wait_for(scenario(), WAIT_S))


def test_a_slow_reader_gets_the_whole_text(server, manager, model):
    body = {"model": MODEL, "prompt": "Slowly:", "max_tokens": 120, "temperature": 0, "stream": True}
    texts = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=WAIT_S) as response:
        for number, line in enumerate(response.iter_lines()):
            if number == 0:
                threading.Event().wait(3.0)  # the engine runs ahead while nothing is read
            if line.startswith("data: {"):
                texts.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(texts) == _greedy_text(model, model.tokenizer.encode("Slowly:"), 120)
    _wait_until(lambda: _idle(manager), "the engine to be idle")


# ---- many clients leaving ----------------------------------------------------------------------------


def test_200_streams_that_leave_at_random_points_free_every_block(server, manager, client):
    rng = random.Random(0)
    plans = [(rng.randint(8, 24), rng.randint(0, 12), rng.random() < 0.5) for _ in range(200)]

    async def one(http, i, max_tokens, leave_after, chat):
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                **({"messages": [{"role": "user", "content": f"Go {i}"}]} if chat else {"prompt": f"Go {i}"})}
        seen = 0
        async with http.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen > leave_after:
                        return "left"  # leaves the block: the connection closes mid-stream
                    if line == "data: [DONE]":
                        return "done"
        return "done"

    async def crowd():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=WAIT_S) as http:
            return await asyncio.gather(*(asyncio.wait_for(one(http, i, *plan), 120) for i, plan in enumerate(plans)))

    outcomes = asyncio.run(asyncio.wait_for(crowd(), 180))
    assert outcomes.count("left") > 50
    _wait_until(lambda: _idle(manager), "every block to be free and nothing left running")
    assert manager.is_running()
    after = client.completions.create(model=MODEL, prompt="Still here", max_tokens=3, temperature=0)
    assert after.usage.completion_tokens == 3


# ---- bodies ---------------------------------------------------------------------------------------------


def _error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_a_10_mb_body_is_refused_quickly(server):
    huge = json.dumps({"model": MODEL, "prompt": "x" * (10 * 1024 * 1024)}).encode()
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as http:
        declared = _error(http.post("/v1/completions", content=huge, headers={"content-type": "application/json"}),
                          413)
        assert declared["code"] == "request_too_large"

        def chunks():  # no Content-Length: counted as it arrives
            for start in range(0, len(huge), 1 << 16):
                yield huge[start:start + (1 << 16)]

        streamed = http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        assert streamed.status_code in (400, 413)
        _error(streamed, streamed.status_code)
        assert http.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize("raw", [b'{"model": "\xff\xfe", "prompt": "x"}', b'{"prompt": "caf\xc3"}', b"\x80\x81"])
def test_malformed_utf8_is_a_400(server, raw):
    response = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                          timeout=WAIT_S)
    error = _error(response, 400)
    assert error["code"] == "invalid_json" and error["type"] == "invalid_request_error"


def test_a_body_is_json_whatever_its_content_type(server):
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}).encode()
    for content_type in ("application/x-www-form-urlencoded", "text/plain", None):  # curl -d sends the first
        headers = {"content-type": content_type} if content_type else {}
        response = httpx.post(server.url + "/v1/completions", content=body, headers=headers, timeout=WAIT_S)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def test_openapi_schema_and_docs(server):
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as http:
        schema = http.get("/openapi.json").json()
        assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(schema["paths"])
        body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"].endswith("/ChatCompletionRequest")
        fields = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
        assert {"messages", "tools", "tool_choice", "response_format", "metadata", "store"} <= set(fields)
        docs = http.get("/docs")
        assert docs.status_code == 200 and "openapi.json" in docs.text


# ---- shutdown ---------------------------------------------------------------------------------------------


def test_a_request_during_shutdown_is_a_503(model):
    class Idle:
        def __init__(self):
            self.model, self.generation_config = model, model.generation_config

        def is_running(self):
            return True

        def get_result(self, request_id=None, timeout=None):
            threading.Event().wait(min(timeout or 0.05, 0.05))

    app = create_app(Idle(), model.tokenizer, model_name=MODEL)
    with ServerThread(app) as running, httpx.Client(base_url=running.url, timeout=WAIT_S) as http:
        app.state.genfn.begin_drain()
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi", "max_tokens": "not even valid"})):
            error = _error(http.post(path, json=body), 503)
            assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
        assert http.get("/health").status_code == 503


# ---- the openai client ---------------------------------------------------------------------------------


def test_requests_that_leave_sampling_out_get_the_chat_defaults(server, client, model):
    from genfn.serve.defaults import CHAT_DEFAULTS

    assert model.generation_config.temperature is None  # the model sets no sampling defaults of its own
    card = httpx.get(server.url + "/v1/models", timeout=WAIT_S).json()["data"][0]
    assert card["sampling_defaults"] == CHAT_DEFAULTS
    request = dict(model=MODEL, prompt="Defaults", max_tokens=6, seed=11)
    implicit = client.completions.create(**request).choices[0].text
    explicit = client.completions.create(**request, temperature=0.7, top_p=0.95, extra_body={"top_k": 50})
    assert implicit == explicit.choices[0].text
    assert implicit != client.completions.create(**request, temperature=0).choices[0].text


def test_fields_clients_send_are_accepted(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=3, temperature=0,
        response_format={"type": "text"}, metadata={"run": "1"}, store=False, service_tier="auto", user="u1",
        parallel_tool_calls=True, tools=[WEATHER], tool_choice="none", logit_bias={"5": -1}, seed=4)
    assert response.usage.completion_tokens == 3 and response.choices[0].message.tool_calls is None


class ScriptedManager:
    """The manager's interface, answering with fixed text: a tool call, or once a tool answered
    (the prompt holds its result), a sentence that uses it."""

    CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    ANSWER = "It is sunny in Oslo."

    def __init__(self, model):
        self.model, self.generation_config, self.tokenizer = model, model.generation_config, model.tokenizer
        self.prompts = []
        self._handlers = {}

    def is_running(self):
        return True

    @property
    def max_request_tokens(self):
        return self.model.max_position_embeddings

    def register_result_handler(self, request_id, callback):
        self._handlers[request_id] = (callback, asyncio.get_running_loop())

    def remove_result_handler(self, request_id):
        self._handlers.pop(request_id, None)

    def add_request(self, prompt, request_id, max_new_tokens, streaming=False, **settings):
        text = self.tokenizer.decode(prompt)
        self.prompts.append(text)
        reply = self.ANSWER if "sunny" in text else self.CALL
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        callback, loop = self._handlers[request_id]
        for end in range(1, len(ids)):
            loop.call_soon_threadsafe(callback, GenerationOutput(request_id, list(prompt), ids[:end], [0.0] * end,
                                                                 status=RequestStatus.DECODING))
        loop.call_soon_threadsafe(callback, GenerationOutput(request_id, list(prompt), ids, [0.0] * len(ids),
                                                             status=RequestStatus.FINISHED))
        return request_id

    def cancel_request(self, request_id):
        pass


def test_a_tool_call_round_trip_with_the_openai_client(model):
    scripted = ScriptedManager(model)
    app = create_app(scripted, model.tokenizer, model_name=MODEL)
    with ServerThread(app) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0)
        messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
        first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
        assert "get_weather" in scripted.prompts[-1]  # the tools reached the prompt

        streamed = list(client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], stream=True))
        deltas = [d for c in streamed for d in (c.choices[0].delta.tool_calls or [])]
        assert [d.function.name for d in deltas] == ["get_weather"]
        assert json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Oslo"}
        assert [c.choices[0].finish_reason for c in streamed if c.choices[0].finish_reason] == ["tool_calls"]
        assert not any(c.choices[0].delta.content for c in streamed)

        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
        assert final.choices[0].message.content == ScriptedManager.ANSWER
        assert final.choices[0].finish_reason == "stop" and final.choices[0].message.tool_calls is None

        with pytest.raises(openai.BadRequestError) as nameless:
            client.chat.completions.create(model=MODEL, messages=messages,
                                           tools=[{"type": "function", "function": {"parameters": {}}}])
        assert nameless.value.param == "tools[0].function.name"
