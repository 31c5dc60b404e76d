"""The OpenAI-compatible server for real: uvicorn on 127.0.0.1 over a tiny random Llama with the
SmolLM2 tokenizer, driven by the official ``openai`` client (and raw httpx where the client would
hide the wire format). Greedy text is checked against ``genfn.generate`` on the same model;
streams against the non-streamed responses. Every wait has a timeout."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time

import httpx
import openai
import pytest
import torch

from conftest import smollm2_path, tiny_hf_model
from genfn.batching.manager import ContinuousBatchingManager
from genfn.batching.requests import RequestStatus
from genfn.batching.results import GenerationOutput
from genfn.config.batching import ContinuousBatchingConfig
from genfn.generation import generate
from genfn.models.model import from_hf_state_dict
from genfn.serve import create_app
from genfn.tokenizer import Tokenizer

WAIT_S = 60  # the longest any single wait may take
MODEL = "tiny-llama"
CONTEXT = 512


def tiny_chat_model(context: int = None):
    """A tiny random Llama over SmolLM2's real tokenizer (and its chat template)."""
    context = CONTEXT if context is None else context
    tokenizer = Tokenizer.from_gguf(smollm2_path())
    hf_model, config = tiny_hf_model(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                     max_position_embeddings=context)
    return from_hf_state_dict(config, hf_model.state_dict(), tokenizer=tokenizer)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerThread:
    """uvicorn serving ``app`` on a free port in a daemon thread."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the test server did not stop"


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_chat_model()


@pytest.fixture(scope="module")
def manager(model):
    config = ContinuousBatchingConfig(page_size=16, num_blocks=512, max_batch_tokens=256, max_requests_per_batch=64)
    manager = ContinuousBatchingManager(model, continuous_batching_config=config)
    manager.start()
    yield manager
    manager.stop(block=True, timeout=WAIT_S)


@pytest.fixture(scope="module")
def server(manager, model):
    app = create_app(manager, model.tokenizer, model_name=MODEL)
    with ServerThread(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0)


def _wait_until(condition, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _idle(manager):
    """No request left in the engine and every KV block released (cached prefixes may stay)."""
    m = manager.metrics()
    return m.running == 0 and m.waiting == 0 and m.kv_blocks_used == 0


def _greedy_text(model, prompt_ids, max_new_tokens):
    out = generate(model, torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return model.tokenizer.decode(out[0, len(prompt_ids):].tolist(), skip_special_tokens=True)


def _chat_ids(model, text):
    return model.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


# ----------------------------------------------------------------------------------------------
# The small endpoints
# ----------------------------------------------------------------------------------------------


def test_models_health_engine_and_metrics(client, server, manager):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as http:
        assert http.get("/health").json() == {"status": "ok"}
        engine = http.get("/v1/engine").json()
        assert set(engine) == {"model", "tokens_per_second", "running", "waiting", "kv_blocks_used",
                               "kv_blocks_total", "requests_finished"}
        assert engine["model"] == MODEL and engine["kv_blocks_total"] == manager.metrics().kv_blocks_total == 512
        client.completions.create(model=MODEL, prompt="Count", max_tokens=3, temperature=0)
        after = http.get("/v1/engine").json()
        assert after["requests_finished"] >= engine["requests_finished"] + 1
        metrics = http.get("/metrics")
        assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
        assert "# TYPE" in metrics.text and MODEL in metrics.text
        assert http.get("/").status_code == 200


# ----------------------------------------------------------------------------------------------
# Completions and chat, streamed and not
# ----------------------------------------------------------------------------------------------


def test_completion_greedy_equals_generate_and_reports_usage(client, model):
    prompt = "The quick brown fox"
    ids = model.tokenizer.encode(prompt)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    choice = response.choices[0]
    assert choice.text == _greedy_text(model, ids, 12)
    assert choice.finish_reason == "length"
    assert response.object == "text_completion" and response.model == MODEL and response.id.startswith("cmpl-")
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == 12
    assert response.usage.total_tokens == len(ids) + 12


def test_completion_token_prompts_and_several_prompts(client, model):
    ids = model.tokenizer.encode("Once upon a time")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    both = client.completions.create(model=MODEL, prompt=["Once upon a time", "Hello"], max_tokens=5, temperature=0,
                                     n=2)
    assert by_ids.choices[0].text == _greedy_text(model, ids, 5)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.choices[0].text == both.choices[1].text == by_ids.choices[0].text
    assert both.choices[2].text == _greedy_text(model, model.tokenizer.encode("Hello"), 5)


def test_chat_stream_equals_chat_and_ends_with_usage(client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    prompt = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert whole.choices[0].message.content == _greedy_text(model, prompt, 16)
    assert whole.choices[0].message.role == "assistant" and whole.object == "chat.completion"
    assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == 16

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1, "the reply must arrive in several chunks"
    assert "".join(pieces) == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completion_stream_equals_completion(client):
    whole = client.completions.create(model=MODEL, prompt="In the beginning", max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="In the beginning", max_tokens=10, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_max_completion_tokens_and_extras(client):
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_completion_tokens=2, temperature=0.8, seed=1,
                                              extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3})
    assert response.usage.completion_tokens == 2 and response.choices[0].finish_reason == "length"


# ----------------------------------------------------------------------------------------------
# Sampling: n, seeds
# ----------------------------------------------------------------------------------------------


def test_n_choices_and_seed_reproducibility(client):
    def sample(n, seed):
        response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go"}],
                                                  max_tokens=3, temperature=1.0, seed=seed, n=n)
        assert [c.index for c in response.choices] == list(range(n))
        assert response.usage.completion_tokens == 3 * n
        return [c.message.content for c in response.choices]

    three = sample(3, seed=7)
    assert len(set(three)) == 3, "each choice samples with its own seed"
    assert sample(3, seed=7) == three
    assert sample(1, seed=7) == three[:1]
    assert sample(1, seed=8) != three[:1]


def test_same_seed_same_text_while_other_requests_run(client, server):
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Tell"}], max_tokens=3, temperature=0.9,
                   top_p=0.95, seed=1234)
    alone = client.chat.completions.create(**request).choices[0].message.content

    async def crowd():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=WAIT_S,
                                      max_retries=0) as aclient:
            # Greedy neighbours: sampling a 49k vocabulary costs the eager engine far more than a step.
            others = [aclient.completions.create(model=MODEL, prompt=f"noise {i}", max_tokens=8, temperature=0)
                      for i in range(6)]
            results = await asyncio.gather(aclient.chat.completions.create(**request), *others)
            return results[0].choices[0].message.content

    assert asyncio.run(asyncio.wait_for(crowd(), WAIT_S)) == alone


# ----------------------------------------------------------------------------------------------
# Stop strings
# ----------------------------------------------------------------------------------------------


def test_stop_string_cuts_the_text_before_it_streamed_or_not(client):
    request = dict(model=MODEL, prompt="Stop here", max_tokens=24, temperature=0)
    full = client.completions.create(**request).choices[0].text
    middle = len(full) // 2
    stop = full[middle:middle + 3]
    assert len(stop) == 3 and stop.strip(), f"the greedy text is too short to pick a stop string: {full!r}"
    expected = full[:full.index(stop)]

    cut = client.completions.create(**request, stop=[stop, "never-there"])
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 24

    chunks = list(client.completions.create(**request, stop=stop, stream=True))
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == expected
    assert all(stop not in t for t in texts)
    assert chunks[-1].choices[0].finish_reason == "stop"


# ----------------------------------------------------------------------------------------------
# Logprobs
# ----------------------------------------------------------------------------------------------


def test_chat_logprobs_and_top_logprobs(client, model):
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 6
    assert "".join(t.token for t in content) == response.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3
        values = [t.logprob for t in token.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        # Greedy picks the most likely token of the raw distribution.
        assert token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob, abs=1e-5)
        assert bytes(token.bytes).decode("utf-8") == token.token

    streamed = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=6, temperature=0, logprobs=True, stream=True))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in tokens] == pytest.approx([t.logprob for t in content], abs=1e-6)


def test_legacy_completion_logprobs(client):
    response = client.completions.create(model=MODEL, prompt="Numbers:", max_tokens=5, temperature=0, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(value, abs=1e-5) and token in top


def test_penalties_and_logit_bias_reach_the_sampler(client, model):
    request = dict(model=MODEL, prompt="Bias", max_tokens=4, temperature=0)
    plain = client.completions.create(**request)
    forced = model.tokenizer.encode(" banana", add_special_tokens=False)[0]
    biased = client.completions.create(**request, logit_bias={str(forced): 100})
    assert biased.choices[0].text == model.tokenizer.decode([forced] * 4)
    assert biased.choices[0].text != plain.choices[0].text
    penalised = client.completions.create(**request, logit_bias={str(forced): 100}, presence_penalty=2.0,
                                          frequency_penalty=2.0)
    assert penalised.usage.completion_tokens == 4  # accepted; their effect is tested with the manager


# ----------------------------------------------------------------------------------------------
# Bad requests
# ----------------------------------------------------------------------------------------------

_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

BAD_REQUESTS = [
    ("malformed JSON", "/v1/chat/completions", b'{"model": ', 400, None, "invalid_json"),
    ("not an object", "/v1/chat/completions", [1, 2], 400, None, "invalid_json"),
    ("unknown model", "/v1/chat/completions", {**_CHAT, "model": "gpt-9"}, 404, "model", "model_not_found"),
    ("negative max_tokens", "/v1/chat/completions", {**_CHAT, "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ("huge max_tokens", "/v1/chat/completions", {**_CHAT, "max_tokens": 10**9}, 400, "max_tokens",
     "context_length_exceeded"),
    ("prompt over the context", "/v1/completions", {"model": MODEL, "prompt": list(range(3, 3 + CONTEXT)),
                                                    "max_tokens": 1}, 400, "prompt", "context_length_exceeded"),
    ("wrong type", "/v1/chat/completions", {**_CHAT, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ("temperature out of range", "/v1/chat/completions", {**_CHAT, "temperature": 3}, 400, "temperature",
     "invalid_value"),
    ("max_tokens as a bool", "/v1/chat/completions", {**_CHAT, "max_tokens": True}, 400, "max_tokens",
     "invalid_type"),
    ("unknown field", "/v1/chat/completions", {**_CHAT, "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    ("n of zero", "/v1/chat/completions", {**_CHAT, "n": 0}, 400, "n", "invalid_value"),
    ("stop of numbers", "/v1/chat/completions", {**_CHAT, "stop": [1]}, 400, "stop[0]", "invalid_type"),
    ("logit_bias outside the vocabulary", "/v1/chat/completions", {**_CHAT, "logit_bias": {"99999999": 1}}, 400,
     "logit_bias", "invalid_value"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**_CHAT, "top_logprobs": 2}, 400, "top_logprobs",
     "invalid_value"),
    ("no messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages", "missing_required_parameter"),
    ("a bad role", "/v1/chat/completions", {**_CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role", "invalid_value"),
    ("stream_options without stream", "/v1/chat/completions", {**_CHAT, "stream_options": {"include_usage": True}},
     400, "stream_options", "invalid_value"),
    ("no prompt", "/v1/completions", {"model": MODEL}, 400, "prompt", "missing_required_parameter"),
    ("token id outside the vocabulary", "/v1/completions", {"model": MODEL, "prompt": [10**7]}, 400, "prompt",
     "invalid_value"),
    ("legacy logprobs over 5", "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 6}, 400, "logprobs",
     "invalid_value"),
]


@pytest.mark.parametrize("path, body, status, param, code", [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(server, manager, path, body, status, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    before = manager.metrics()
    response = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"},
                          timeout=WAIT_S)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code
    assert error["type"] == "invalid_request_error" and error["message"]
    after = manager.metrics()
    assert after.requests_finished + after.requests_failed == before.requests_finished + before.requests_failed


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert bad.value.param == "max_tokens"


def test_unknown_route_and_method_are_json(server):
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as http:
        missing = http.get("/v1/nothing")
        assert missing.status_code == 404 and "error" in missing.json()
        wrong = http.get("/v1/chat/completions")
        assert wrong.status_code == 405 and "error" in wrong.json()


# ----------------------------------------------------------------------------------------------
# Disconnects
# ----------------------------------------------------------------------------------------------


def test_client_leaving_a_stream_cancels_its_request_and_frees_its_blocks(server, manager):
    _wait_until(lambda: _idle(manager), "the engine to be idle")
    cancelled = manager.metrics().requests_cancelled
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=WAIT_S) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one chunk arrived: the request is running
        assert manager.metrics().kv_blocks_used > 0
    _wait_until(lambda: manager.metrics().requests_cancelled == cancelled + 1, "the request to be cancelled")
    _wait_until(lambda: _idle(manager), "its blocks to be freed")


def test_client_leaving_a_whole_response_cancels_it(server, manager):
    _wait_until(lambda: _idle(manager), "the engine to be idle")
    cancelled = manager.metrics().requests_cancelled
    body = json.dumps({"model": MODEL, "prompt": "Another long story:", "max_tokens": 400, "temperature": 0})
    host, port = server.url.removeprefix("http://").split(":")
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
    # The client leaves once the engine is decoding its request, not after a fixed time: on a fast
    # machine the tiny model writes all 400 tokens in under half a second.
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        sock.sendall(request)
        _wait_until(lambda: manager.metrics().running == 1, "the request to be decoding")
    _wait_until(lambda: manager.metrics().requests_cancelled == cancelled + 1, "the request to be cancelled")
    _wait_until(lambda: _idle(manager), "its blocks to be freed")


# ----------------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------------


def test_200_concurrent_streams_each_answered_once(server, manager):
    """200 streaming requests at once from one process: every one ends exactly once (one finish
    reason, then [DONE]), within its own time cap, and the cache is empty afterwards."""
    count, cap_s, max_tokens = 200, 90.0, 4

    async def one(http, i):
        started = time.perf_counter()
        first, reasons, done, ids = None, [], 0, set()
        body = {"model": MODEL, "prompt": f"Request {i}:", "max_tokens": max_tokens, "temperature": 0,
                "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done += 1
                    continue
                chunk = json.loads(line[len("data: "):])
                ids.add(chunk["id"])
                choice = chunk["choices"][0]
                if first is None and choice["text"]:
                    first = time.perf_counter() - started
                if choice["finish_reason"]:
                    reasons.append(choice["finish_reason"])
        return {"ttft": first, "latency": time.perf_counter() - started, "reasons": reasons, "done": done,
                "ids": ids}

    async def crowd():
        limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=cap_s) as http:
            started = time.perf_counter()
            results = await asyncio.gather(*(asyncio.wait_for(one(http, i), cap_s) for i in range(count)))
            return results, time.perf_counter() - started

    results, wall = asyncio.run(crowd())
    assert len(results) == count
    assert all(r["reasons"] == ["length"] and r["done"] == 1 and len(r["ids"]) == 1 for r in results)
    assert len(set().union(*(r["ids"] for r in results))) == count
    _wait_until(lambda: _idle(manager), "every block to be free")
    ttft = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    latency = sorted(r["latency"] for r in results)

    def pct(values, p):
        return values[min(len(values) - 1, int(p * len(values)))]

    print(f"\n{count} concurrent streams x {max_tokens} tokens: {count / wall:.1f} requests/s; "
          f"TTFT p50 {statistics.median(ttft):.2f} s, p99 {pct(ttft, 0.99):.2f} s; "
          f"latency p50 {statistics.median(latency):.2f} s, p99 {pct(latency, 0.99):.2f} s")


# ----------------------------------------------------------------------------------------------
# Faults, on a manager that fails on purpose
# ----------------------------------------------------------------------------------------------


class FailingManager:
    """The manager's interface, scripted: each request streams one token, then fails."""

    def __init__(self, model):
        self.model = model
        self.generation_config = model.generation_config
        self.scheduler = None
        self._handlers = {}

    def is_running(self):
        return True

    def add_request(self, prompt, request_id, max_new_tokens, streaming=False, **settings):
        self._deliver(GenerationOutput(request_id, list(prompt), [42], [-0.5], status=RequestStatus.DECODING))
        self._deliver(GenerationOutput(request_id, list(prompt), [42], [-0.5], error="the GPU caught fire",
                                       status=RequestStatus.FAILED))
        return request_id

    def cancel_request(self, request_id):
        pass

    @property
    def max_request_tokens(self):
        return self.model.max_position_embeddings

    def register_result_handler(self, request_id, callback):
        self._handlers[request_id] = (callback, asyncio.get_running_loop())

    def remove_result_handler(self, request_id):
        self._handlers.pop(request_id, None)

    def _deliver(self, output):
        callback, loop = self._handlers[output.request_id]
        loop.call_soon_threadsafe(callback, output)


def test_an_error_during_a_stream_is_an_sse_error_event(model):
    app = create_app(FailingManager(model), model.tokenizer, model_name=MODEL)
    with ServerThread(app) as running:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True}
        with httpx.stream("POST", running.url + "/v1/chat/completions", json=body, timeout=WAIT_S) as response:
            lines = [line for line in response.iter_lines() if line]
        assert lines[-2] == "event: error"
        error = json.loads(lines[-1][len("data: "):])["error"]
        assert "the GPU caught fire" in error["message"] and error["type"] == "server_error"
        assert "data: [DONE]" not in lines

        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0)
        with pytest.raises(openai.APIError, match="the GPU caught fire"):
            list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=5, stream=True))
        with pytest.raises(openai.InternalServerError, match="the GPU caught fire"):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5)


def test_a_manager_that_is_not_running_gets_503(model):
    idle = ContinuousBatchingManager(model, continuous_batching_config=ContinuousBatchingConfig(page_size=16,
                                                                                                num_blocks=8))
    app = create_app(idle, model.tokenizer, model_name=MODEL)
    with ServerThread(app) as running, httpx.Client(base_url=running.url, timeout=WAIT_S) as http:
        assert http.get("/health").status_code == 503
        response = http.post("/v1/chat/completions", json=_CHAT)
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_not_running"


def test_generation_defaults_fill_what_a_request_leaves_out(model):
    """One app per manager (its output pump takes every output), so this app gets a manager of its own."""
    own = ContinuousBatchingManager(model, continuous_batching_config=ContinuousBatchingConfig(page_size=16,
                                                                                               num_blocks=32))
    own.start()
    try:
        app = create_app(own, model.tokenizer, model_name=MODEL, generation_defaults={"temperature": 0.0,
                                                                                      "max_tokens": 5})
        with ServerThread(app) as running:
            client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0)
            response = client.completions.create(model=MODEL, prompt="Defaults")
            assert response.usage.completion_tokens == 5
            assert response.choices[0].text == _greedy_text(model, model.tokenizer.encode("Defaults"), 5)
    finally:
        own.stop(block=True, timeout=WAIT_S)


def test_stream_of_several_choices_gives_each_its_own_text_and_end(client, server):
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Pick"}], max_tokens=3, temperature=1.0,
                   seed=3, n=2)
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[index].message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    body = {**request, "stream": True, "max_tokens": 1, "temperature": 0, "n": 1}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=WAIT_S) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert list(response.iter_lines())[-2:] == ["data: [DONE]", ""]
