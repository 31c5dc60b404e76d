"""``genfn serve --tp 2``: rank 0 serves the OpenAI API, rank 1 follows its engine. Two torchrun
"nodes" over the loopback address answer the official ``openai`` client; a rank killed while
serving ends the server with an error naming it, and no process is left; SIGINT drains and stops
every rank. The model is cli_support's tiny random Llama with a tokenizer. Every wait has a
timeout."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest

from cli_support import REPO, WAIT, ServerProcess as Server, build_tiny_model, child_pids, process_alive, subprocess_env

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tp_serve_tiny")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _genfn_workers(pid: int) -> list[int]:
    """The children of ``pid`` that run genfn (torchrun's workers, not its helper processes)."""
    found = []
    for child in child_pids(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"genfn" in f.read():
                    found.append(child)
        except FileNotFoundError:
            pass
    return found


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=WAIT, max_retries=0)


def _genfn_serve(tiny_dir: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "genfn", "serve", "--model", tiny_dir, "--tp", "2", "--port", "0",
            "--num-blocks", "64", "--block-size", "8", *extra]


def _completion(url: str, model: str, max_tokens: int = 6):
    return _client(url).completions.create(model=os.path.basename(model), prompt=PROMPT, max_tokens=max_tokens,
                                           temperature=0)


def test_two_torchrun_nodes_serve_the_openai_client(tiny_dir):
    port = str(_free_port())
    nodes = [Server([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                     "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", port,
                     *_genfn_serve(tiny_dir)[1:]]) for rank in range(2)]
    workers = []
    try:
        url = nodes[0].wait_listening()
        first = _completion(url, tiny_dir)
        assert first.choices[0].finish_reason in ("length", "stop")
        assert 1 <= first.usage.completion_tokens <= 6 and isinstance(first.choices[0].text, str)
        assert _completion(url, tiny_dir).choices[0].text == first.choices[0].text  # greedy: the same answer again
        assert not nodes[1].url  # rank 1 (on node 1) serves nothing
        # SIGTERM to rank 0 (torchrun's worker on node 0): it drains, stops rank 1, and both nodes end cleanly
        workers = [pid for node in nodes for pid in _genfn_workers(node.process.pid)]
        rank0 = _genfn_workers(nodes[0].process.pid)
        assert len(rank0) == 1, rank0
        os.kill(rank0[0], signal.SIGTERM)
        codes = [node.wait(WAIT) for node in nodes]
        assert codes == [0, 0], [node.log() for node in nodes]
        assert not any(process_alive(pid) for pid in workers)
    finally:
        for node in nodes:
            node.kill()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _stream(url: str, model: str, out: list, first: threading.Event) -> None:
    try:
        for chunk in _client(url).completions.create(model=os.path.basename(model), prompt=PROMPT, max_tokens=200, temperature=0,
                                                     stream=True):
            out.append(chunk)
            first.set()
    except Exception as err:  # the server went away mid-stream: expected here
        out.append(err)
    first.set()


def test_a_killed_rank_ends_the_server_with_an_error_naming_it(tiny_dir):
    server = Server(_genfn_serve(tiny_dir))
    ranks = []
    try:
        url = server.wait_listening()
        ranks = [pid for pid in child_pids(server.process.pid) if process_alive(pid)]
        assert len(ranks) == 1, ranks
        out, first = [], threading.Event()
        threading.Thread(target=_stream, args=(url, tiny_dir, out, first), daemon=True).start()
        assert first.wait(WAIT), "the stream did not start"
        os.kill(ranks[0], signal.SIGKILL)
        killed_at = time.monotonic()
        code = server.wait(60)
        assert time.monotonic() - killed_at < 60
        assert code == 1, server.log()
        assert "genfn: error: tensor-parallel rank 1 was killed by signal 9" in server.log(), server.log()
        assert not any(process_alive(pid) for pid in ranks + child_pids(server.process.pid))
    finally:
        server.kill()
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_sigint_drains_and_stops_every_rank(tiny_dir):
    server = Server(_genfn_serve(tiny_dir, "--drain-timeout", "5"))
    ranks = []
    try:
        url = server.wait_listening()
        ranks = [pid for pid in child_pids(server.process.pid) if process_alive(pid)]
        assert len(ranks) == 1, ranks
        assert _completion(url, tiny_dir).usage.completion_tokens >= 1
        server.process.send_signal(signal.SIGINT)  # Ctrl-C reaches rank 0: it drains, then stops rank 1
        assert server.wait(WAIT) == 0, server.log()
        assert "stopped" in server.log()
        deadline = time.monotonic() + 30
        while any(process_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(process_alive(pid) for pid in ranks)
    finally:
        server.kill()
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_python_m_genfn_serve_says_how_to_start_the_ranks(tiny_dir):
    result = subprocess.run([sys.executable, "-m", "genfn.serve", "--model", tiny_dir, "--tp", "2", "--port", "0"],
                            capture_output=True, text=True, timeout=WAIT, env=subprocess_env(), cwd=REPO)
    assert result.returncode == 2
    assert "genfn serve --tp 2" in result.stderr and "torchrun" in result.stderr, result.stderr
