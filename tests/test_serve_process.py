"""``python -m genfn.serve`` as a process: a graceful SIGTERM (a short stream finishes, a long one
is ended by the drain timeout with an SSE error, the process exits 0 after stopping the
manager), and ``examples/openai_client.py`` starting its own server. The model is the tiny random
Llama of test_serve.py saved as a Hugging Face directory. Every wait has a timeout."""

from __future__ import annotations

import json
import pathlib
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

import genfn
from cli_support import ServerProcess, subprocess_env
from test_serve import tiny_chat_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
LONG_CONTEXT = 8192
WAIT_S = 120  # process start (torch import, model load) on a busy machine


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-chat-model")
    # A long context, so the drain test's long stream cannot finish inside the drain on a quiet machine.
    genfn.save(tiny_chat_model(LONG_CONTEXT), directory)
    return str(directory)


def _server(*args: str) -> ServerProcess:
    """``python -m genfn.serve`` on a free port, listening."""
    server = ServerProcess([sys.executable, "-m", "genfn.serve", "--port", "0", *args])
    server.wait_listening(WAIT_S)
    return server


def _stream_lines(url: str, max_tokens: int, out: list, first: threading.Event) -> None:
    body = {"prompt": "Count:", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=WAIT_S) as response:
            for line in response.iter_lines():
                if line:
                    out.append(line)
                    first.set()
    except httpx.HTTPError as exc:
        out.append(f"transport error: {exc!r}")
    first.set()


def test_sigterm_drains_streams_then_stops(tiny_dir):
    """SIGTERM while two streams run: the short one ends normally ([DONE]); the long one is ended at
    the drain timeout by an SSE error event; new connections are refused; the process exits 0."""
    server = _server("--model", tiny_dir, "--drain-timeout", "3", "--num-blocks", "600")
    try:
        short, long_ = [], []
        started = [threading.Event(), threading.Event()]
        threads = [threading.Thread(target=_stream_lines, args=(server.url, 6, short, started[0])),
                   threading.Thread(target=_stream_lines, args=(server.url, 8000, long_, started[1]))]
        for thread in threads:
            thread.start()
        assert all(event.wait(WAIT_S) for event in started), "the streams did not start"
        server.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(WAIT_S)
            assert not thread.is_alive(), "a stream did not end"
        assert server.process.wait(WAIT_S) == 0
    finally:
        server.kill()
    assert short[-1] == "data: [DONE]", short[-3:]
    assert json.loads(short[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    assert len(long_) >= 2 and long_[-2] == "event: error", long_[-3:]
    assert json.loads(long_[-1][len("data: "):])["error"]["code"] == "server_shutting_down"
    log = "".join(server.lines)
    assert "shutting down" in log and "stopped" in log
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)


def test_openai_client_example_starts_a_server_and_streams(tiny_dir):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "openai_client.py"), "--model", tiny_dir,
                             "--max-tokens", "3", "--prompt", "Hello"],
                            capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=WAIT_S)
    assert result.returncode == 0, result.stderr
    assert "assistant: " in result.stdout
    assert re.search(r"\[3 tokens in [\d.]+ s", result.stdout), result.stdout
    assert "stopped" in result.stderr  # the example shut its server down gracefully
