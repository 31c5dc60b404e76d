"""Launching tensor parallelism from the command line: ``genfn generate --tp 2`` spawning its own
rank, ``torchrun`` on one node and on two "nodes" over the loopback address, and a rank killed
in the middle of a generation (the other exits with an error naming it, and no process is left)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from cli_support import REPO, WAIT, assert_user_error, build_tiny_model, child_pids, process_alive, run_cli

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tp_tiny"))
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 8192  # room for a generation long enough to kill a rank in
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _tokens(result) -> list:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["tokens"]


@pytest.fixture(scope="module")
def one_process_tokens(tiny_dir):
    return _tokens(run_cli("generate", PROMPT, "--model", tiny_dir, "--max-new-tokens", "12", "--json", "-q"))


def test_tp_spawns_its_ranks_and_prints_once(tiny_dir, one_process_tokens):
    result = run_cli("generate", PROMPT, "--model", tiny_dir, "--max-new-tokens", "12", "--json", "-q", "--tp", "2")
    assert _tokens(result) == one_process_tokens
    assert result.stdout.count("\n") == 1  # rank 1 printed nothing


def test_tp_refuses_what_the_ranks_cannot_share():
    assert_user_error(run_cli("determinism", "--tp", "2"), "--tp", "genfn determinism")
    assert_user_error(run_cli("generate", "-", "--tp", "2", stdin="hello"), "--tp", "standard input")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def test_torchrun_two_nodes_over_loopback(tiny_dir, one_process_tokens):
    port = str(_free_port())
    command = ["-m", "genfn", "generate", PROMPT, "--model", tiny_dir, "--max-new-tokens", "12", "--json", "-q",
               "--tp", "2"]
    nodes = [subprocess.Popen(_torchrun("--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
                                        "--master-addr", "127.0.0.1", "--master-port", port, *command),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
             for rank in range(2)]
    try:
        outs = [node.communicate(timeout=WAIT) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], [err for _, err in outs]
    assert json.loads(outs[0][0])["tokens"] == one_process_tokens
    assert outs[1][0] == ""  # only rank 0 (on node 0) writes


def test_a_rank_that_is_too_many_for_torchrun_is_refused(tiny_dir):
    result = subprocess.run(_torchrun("--standalone", "--nproc-per-node", "1", "-m", "genfn", "generate", PROMPT,
                                      "--model", tiny_dir, "--tp", "2", "-q"),
                            capture_output=True, text=True, timeout=WAIT, env=_env(), cwd=REPO)
    assert result.returncode != 0 and "does not match torchrun's world size 1" in result.stderr


def test_a_killed_rank_ends_the_run_with_an_error_naming_it(tiny_dir):
    run = subprocess.Popen([sys.executable, "-m", "genfn", "generate", PROMPT, "--model", tiny_dir,
                            "--max-new-tokens", "8000", "--tp", "2", "-q"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=REPO)
    streamed = threading.Event()
    threading.Thread(target=lambda: run.stdout.read(1) and streamed.set(), daemon=True).start()
    try:
        assert streamed.wait(WAIT), "rank 0 streamed nothing"
        ranks = [pid for pid in child_pids(run.pid) if process_alive(pid)]
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = run.communicate(timeout=60)
        assert time.monotonic() - killed_at < 60
        assert run.returncode == 1
        assert "genfn: error: tensor-parallel rank 1 was killed by signal 9" in stderr.decode(), stderr.decode()
        assert not any(process_alive(pid) for pid in ranks + child_pids(run.pid))
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=10)


@pytest.mark.slow
def test_a_stopped_rank_is_named_by_the_watchdog(tiny_dir):
    """SIGSTOP: the rank is alive but silent (as if hung); rank 0's collective waits, and its
    watchdog names the rank after the heartbeat timeout (30 s) instead of hanging."""
    run = subprocess.Popen([sys.executable, "-m", "genfn", "generate", PROMPT, "--model", tiny_dir,
                            "--max-new-tokens", "8000", "--tp", "2", "-q"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=REPO)
    streamed = threading.Event()
    threading.Thread(target=lambda: run.stdout.read(1) and streamed.set(), daemon=True).start()
    ranks = []
    try:
        assert streamed.wait(WAIT), "rank 0 streamed nothing"
        ranks = [pid for pid in child_pids(run.pid) if process_alive(pid)]
        os.kill(ranks[0], signal.SIGSTOP)
        _, stderr = run.communicate(timeout=90)
        assert run.returncode == 1
        assert "rank 1 stopped responding" in stderr.decode(), stderr.decode()
    finally:
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if run.poll() is None:
            run.kill()
            run.wait(timeout=10)


@pytest.mark.slow
def test_ctrl_c_on_rank_0_ends_every_rank(tiny_dir):
    run = subprocess.Popen([sys.executable, "-m", "genfn", "generate", PROMPT, "--model", tiny_dir,
                            "--max-new-tokens", "8000", "--tp", "2", "-q"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=REPO)
    streamed = threading.Event()
    threading.Thread(target=lambda: run.stdout.read(1) and streamed.set(), daemon=True).start()
    ranks = []
    try:
        assert streamed.wait(WAIT), "rank 0 streamed nothing"
        ranks = [pid for pid in child_pids(run.pid) if process_alive(pid)]
        run.send_signal(signal.SIGINT)
        _, stderr = run.communicate(timeout=60)
        assert run.returncode == 130, stderr.decode()
        deadline = time.monotonic() + 30
        while any(process_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(process_alive(pid) for pid in ranks)
    finally:
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if run.poll() is None:
            run.kill()
            run.wait(timeout=10)
