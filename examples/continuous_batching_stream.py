"""Continuous batching with streaming result handlers on an asyncio loop.

One ``ContinuousBatchingManager`` runs the batching in a background thread. Each request is
added with ``streaming=True`` and a handler registered for its id with
``register_result_handler``: the manager calls the handler on the asyncio loop
(``call_soon_threadsafe``) with every update (the tokens so far) and then the final result, so a
coroutine can print or forward text as it is produced, for many requests at once, without a
thread of its own. Requests join the running batch as they arrive.

    python examples/continuous_batching_stream.py --max-new-tokens 24
"""

from __future__ import annotations

import argparse
import asyncio

import genfn
from genfn.batching import ContinuousBatchingManager

PROMPTS = ["Write a haiku about the sea.", "The capital of France is", "Once upon a time,",
           "Three things to pack for a hike:", "def add(a, b):"]


async def stream_all(model, prompts, max_new_tokens: int, timeout_s: float = 120.0, echo: bool = True):
    """Run every prompt through one manager; returns {request id: (final tokens, the token counts
    each streamed update carried)}."""
    tok = model.tokenizer
    manager = ContinuousBatchingManager(model)
    manager.start()
    loop = asyncio.get_running_loop()
    done: dict[str, asyncio.Future] = {}
    updates: dict[str, list[int]] = {}
    printed: dict[str, str] = {}
    try:
        for i, prompt in enumerate(prompts):
            request_id = f"req-{i}"
            done[request_id] = loop.create_future()
            updates[request_id] = []
            printed[request_id] = ""

            def handle(output, request_id=request_id):  # runs on this loop, between its other tasks
                updates[request_id].append(len(output.generated_tokens))
                text = tok.decode(output.generated_tokens, skip_special_tokens=True)
                if echo and text.startswith(printed[request_id]) and len(text) > len(printed[request_id]):
                    print(f"[{request_id}] +{text[len(printed[request_id]):]!r}")
                printed[request_id] = text
                if output.is_finished() and not done[request_id].done():
                    done[request_id].set_result(output)

            # Register before adding, so not even the first update can go to the polling store.
            manager.register_result_handler(request_id, handle)
            manager.add_request(tok([prompt])["input_ids"][0].tolist(), request_id=request_id,
                                max_new_tokens=max_new_tokens, streaming=True)
            await asyncio.sleep(0)  # requests arrive one by one and join the running batch
        finals = await asyncio.wait_for(asyncio.gather(*done.values()), timeout_s)
    finally:
        manager.stop(block=True, timeout=30)
    return {out.request_id: (list(out.generated_tokens), updates[out.request_id]) for out in finals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model directory or .gguf file (default: SmolLM2)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    model = genfn.load(args.model)
    results = asyncio.run(stream_all(model, PROMPTS, args.max_new_tokens))
    for (request_id, (tokens, counts)), prompt in zip(results.items(), PROMPTS):
        print(f"{request_id} {prompt!r} -> {model.tokenizer.decode(tokens, skip_special_tokens=True)!r} "
              f"({len(counts)} updates)")


if __name__ == "__main__":
    main()
