"""The server's web page in a real browser: Debian's headless Chromium driven by Playwright, against
the real app (uvicorn on 127.0.0.1, a free port) over a tiny random Llama that uses SmolLM2's
tokenizer and chat template.

The page must stream a reply (its text seen growing in the DOM, chunk by chunk), send the settings
the user typed, stop a reply, show errors readably and show live engine numbers. Every wait has a
timeout. A screenshot of the finished chat goes to tests/artifacts/.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import smollm2_path, tiny_pair

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
MODEL_NAME = "tiny-llama"
START_TIMEOUT_S = 30
# The first forward may build genfn's decode kernel from source (about 20 s on a quiet machine).
WARMUP_TIMEOUT_S = 180
WAIT_MS = 20_000  # the longest any single wait in the browser may take
SYSTEM_PROMPT = "You answer in one short sentence."


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def server_url():
    import uvicorn

    from genfn.batching import ContinuousBatchingManager
    from genfn.config.batching import ContinuousBatchingConfig
    from genfn.serve.app import create_app
    from genfn.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(smollm2_path())
    _, model = tiny_pair(vocab_size=len(tokenizer), max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=128, max_requests_per_batch=4)
    manager = ContinuousBatchingManager(model, None, config)
    app = create_app(manager, tokenizer, model_name=MODEL_NAME)  # serves the manager its caller runs
    manager.start()
    # The socket is bound before uvicorn starts, so no other process can take the port in between.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                pytest.fail(f"the server did not start within {START_TIMEOUT_S} s")
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        # One request before the browser's, so that no browser wait includes a first-use build.
        warmup = httpx.post(url + "/v1/chat/completions", timeout=WARMUP_TIMEOUT_S,
                            json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert warmup.status_code == 200, warmup.text
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=START_TIMEOUT_S)
        sock.close()
        manager.stop(timeout=START_TIMEOUT_S)
        assert not thread.is_alive(), "uvicorn did not shut down"


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (make install-test does it)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], timeout=WAIT_MS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser, server_url):
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    console: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
    page.goto(server_url + "/")
    _wait_for_server_defaults(page)
    yield page
    # Printed output shows only when the test failed: what the page held when it gave up waiting.
    print(f"the page at the end: {page.evaluate(PAGE_STATE)}")
    print("its console:", *console, sep="\n  ")
    context.close()
    assert not errors, f"the page raised: {errors}"


def _wait_for_server_defaults(page) -> None:
    """Waits for the page's /v1/models answer (the engine panel may show the model name before it)."""
    page.wait_for_function("name => document.title.startsWith(name)", arg=MODEL_NAME)


PAGE_STATE = """() => {
  const value = id => document.getElementById(id).value;
  const error = document.getElementById('error');
  return {prompt: value('prompt'), temperature: value('temperature'), max_tokens: value('max_tokens'),
          error: error.hidden ? null : error.textContent, send_disabled: document.getElementById('send').disabled,
          focused: document.activeElement && document.activeElement.id,
          messages: [...document.querySelectorAll('.message')].map(m => [m.dataset.role, m.dataset.state]),
          engine: document.getElementById('engine-status').dataset.state};
}"""


# Records every distinct length the newest assistant bubble's text has had, as the DOM changes.
RECORD_LENGTHS = """() => {
  window.replyLengths = [];
  new MutationObserver(() => {
    const replies = document.querySelectorAll('.message-assistant .message-content');
    if (!replies.length) return;
    const length = replies[replies.length - 1].textContent.length;
    const seen = window.replyLengths;
    if (length > 0 && seen[seen.length - 1] !== length) seen.push(length);
  }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
}"""

LAST_REPLY = ".message-assistant >> nth=-1"


def _wait_for_reply_end(page) -> str:
    """Waits until the newest reply stops streaming; returns its state (done, stopped, error)."""
    page.wait_for_function("""() => {
      const replies = document.querySelectorAll('.message-assistant');
      return replies.length && replies[replies.length - 1].dataset.state !== 'streaming';
    }""")
    return page.locator(LAST_REPLY).get_attribute("data-state")


def _wait_for_idle_engine(page) -> None:
    page.wait_for_function("""() => document.getElementById('engine-running').textContent === '0'
                              && document.getElementById('engine-status').dataset.state === 'live'""")


def _engine_numbers(page) -> dict:
    text = {name: page.locator(f"#engine-{name}").inner_text().strip()
            for name in ("tps", "running", "waiting", "finished", "kv")}
    kv = re.fullmatch(r"(\d+) / (\d+)", text["kv"])
    assert kv, f"the KV panel shows {text['kv']!r}, not 'used / total'"
    assert re.fullmatch(r"\d+(\.\d)?", text["tps"]), text
    return {"tokens_per_second": float(text["tps"]), "running": int(text["running"]), "waiting": int(text["waiting"]),
            "requests_finished": int(text["finished"]), "kv_used": int(kv[1]), "kv_total": int(kv[2])}


def test_a_message_streams_into_the_page_with_the_settings_sent_and_the_engine_panel_live(page, server_url):
    finished_before = httpx.get(server_url + "/v1/engine", timeout=START_TIMEOUT_S).json()["requests_finished"]
    page.fill("#system", SYSTEM_PROMPT)
    page.fill("#temperature", "0.9")
    page.fill("#top_p", "0.9")
    page.fill("#top_k", "40")
    page.fill("#max_tokens", "24")
    page.fill("#seed", "7")
    page.evaluate(RECORD_LENGTHS)
    page.fill("#prompt", "Tell me about the sea.")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#send")
    request = sent.value.post_data_json
    assert request["stream"] is True and request["model"] == MODEL_NAME
    assert request["messages"] == [{"role": "system", "content": SYSTEM_PROMPT},
                                   {"role": "user", "content": "Tell me about the sea."}]
    assert {k: request[k] for k in ("temperature", "top_p", "top_k", "max_tokens", "seed")} == \
        {"temperature": 0.9, "top_p": 0.9, "top_k": 40, "max_tokens": 24, "seed": 7}

    state = _wait_for_reply_end(page)
    reply = page.locator(LAST_REPLY)
    assert state == "done", f"the reply ended {state}: {reply.locator('.message-meta').inner_text()}"
    text = reply.locator(".message-content").inner_text()
    assert text.strip(), "the reply finished empty"

    # Streamed, not delivered at once: the bubble grew through several lengths to its final one.
    lengths = page.evaluate("window.replyLengths")
    assert len(lengths) >= 2, f"the reply appeared in one piece (lengths seen: {lengths})"
    assert lengths == sorted(lengths) and lengths[-1] == len(reply.locator(".message-content").text_content())
    assert int(reply.get_attribute("data-chunks")) >= len(lengths)

    # The engine panel polls every second; it has numbers and has counted the finished request.
    page.wait_for_function("before => Number(document.getElementById('engine-finished').textContent) > before",
                           arg=finished_before)
    engine = _engine_numbers(page)
    assert engine["kv_total"] > 0 and 0 <= engine["kv_used"] <= engine["kv_total"]
    assert page.locator("#engine-status").get_attribute("data-state") == "live"

    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "serve_browser_chat.png"
    page.screenshot(path=str(screenshot))
    print(f"screenshot: {screenshot}")

    # The same request without streaming gives the same text: the page assembled the deltas right.
    request.pop("stream_options", None)
    answer = httpx.post(server_url + "/v1/chat/completions", json={**request, "stream": False},
                        timeout=START_TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    assert reply.locator(".message-content").text_content() == answer.json()["choices"][0]["message"]["content"]



def test_stop_ends_a_reply_the_engine_lets_it_go_and_the_next_turn_carries_the_history(page):
    page.fill("#max_tokens", "400")
    page.fill("#prompt", "Write a long story.")
    page.press("#prompt", "Enter")
    page.wait_for_function("() => Number(document.querySelector('.message-assistant')?.dataset.chunks) >= 1")
    assert page.locator("#stop").is_enabled()
    page.click("#stop")
    assert _wait_for_reply_end(page) == "stopped"
    assert page.locator("#send").is_enabled() and page.locator("#stop").is_disabled()
    partial = page.locator(LAST_REPLY).locator(".message-content").text_content()
    assert partial
    # The server sees the dropped connection and cancels the request: nothing stays running.
    _wait_for_idle_engine(page)

    # The next turn sends the conversation so far, the stopped reply as far as it came.
    page.fill("#prompt", "Go on.")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.press("#prompt", "Enter")
    assert sent.value.post_data_json["messages"] == [
        {"role": "user", "content": "Write a long story."}, {"role": "assistant", "content": partial},
        {"role": "user", "content": "Go on."}]
    page.keyboard.press("Escape")
    assert _wait_for_reply_end(page) == "stopped"

    page.click("#new-chat")
    assert page.locator(".message").count() == 0 and page.locator("#empty-note").is_visible()
    _wait_for_idle_engine(page)  # the second stopped turn is let go too, before the next test starts


def test_bad_settings_and_server_errors_are_shown_readably(page):
    chat_requests = []
    page.on("request", lambda request: chat_requests.append(request)
            if request.url.endswith("/v1/chat/completions") else None)
    page.fill("#temperature", "5")
    page.fill("#prompt", "Hello")
    page.click("#send")
    page.wait_for_selector("#error:not([hidden])")
    assert "Temperature must be between 0 and 2" in page.locator("#error").inner_text()
    assert page.locator(".message").count() == 0 and not chat_requests, "a bad setting was sent"

    # A setting only the server can judge: more tokens than the model's context holds.
    page.fill("#temperature", "0.7")
    page.fill("#max_tokens", "32768")
    page.click("#send")
    assert _wait_for_reply_end(page) == "error"
    banner = page.locator("#error").inner_text()
    print(f"the page shows: {banner}")
    assert banner.startswith("The server answered 400"), banner
    assert "max_tokens" in banner or "context" in banner, banner
    # The failed turn goes back to the message box for another try.
    assert page.input_value("#prompt") == "Hello"


def test_a_setting_typed_before_the_server_defaults_arrive_is_kept(browser, server_url):
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        held = []  # the page's /v1/models request, answered only once the user has typed
        page.route("**/v1/models", lambda route: held.append(route))
        page.goto(server_url + "/")
        deadline = time.monotonic() + WAIT_MS / 1000
        while not held:
            assert time.monotonic() < deadline, "the page never asked for /v1/models"
            page.wait_for_timeout(20)
        defaults = httpx.get(server_url + "/v1/models", timeout=START_TIMEOUT_S).json()["data"][0]["sampling_defaults"]
        assert "temperature" in defaults and "top_p" in defaults, defaults
        page.fill("#temperature", "1.3")
        held[0].continue_()
        _wait_for_server_defaults(page)
        assert page.input_value("#temperature") == "1.3", "the server's default overwrote the user's setting"
        assert float(page.input_value("#top_p")) == defaults["top_p"], "an untouched setting lost the server default"
    finally:
        context.close()


def test_an_error_event_in_the_middle_of_a_stream_is_shown_with_the_text_so_far(page):
    # The server's SSE error event (what a failure mid-generation sends), played by the browser.
    chunk = json.dumps({"choices": [{"index": 0, "delta": {"content": "Half a"}, "finish_reason": None}]})
    failure = json.dumps({"error": {"message": "the engine failed", "type": "server_error", "param": None,
                                    "code": None}})
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body=f"data: {chunk}\n\nevent: error\ndata: {failure}\n\n"))
    page.fill("#prompt", "Hello")
    page.click("#send")
    assert _wait_for_reply_end(page) == "error"
    assert page.locator(LAST_REPLY).locator(".message-content").text_content() == "Half a"
    assert page.locator("#error").inner_text() == "The server failed while writing the reply: the engine failed"
