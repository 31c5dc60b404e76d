"""Compiled static-cache inference: one compiled decode step serves prompts of every length.

``cache_implementation="static"`` preallocates the KV cache and compiles the decode step
against it. With a fixed ``max_cache_len``, the cache (and so every tensor the step sees) has
the same shape whatever the prompt, and positions and lengths are tensors, so the step compiles
once and then serves prompts of any length and any ``max_new_tokens`` that fit. This example
counts torch.compile runs (dynamo's compile callbacks) and checks the compiled tokens against
the eager ones.

    python examples/static_cache_reuse.py --max-cache-len 256 --max-new-tokens 24
"""

from __future__ import annotations

import argparse
import time

import genfn

PROMPTS = ["Hi.", "The capital of France is", "Write a short poem about a lighthouse keeper who",
           "List three prime numbers greater than one hundred, and explain how you would check that a number "
           "is prime:"]


class CompileCounter:
    """Counts torch.compile runs while it is active (dynamo's start callback fires once per run)."""

    def __enter__(self):
        from torch._dynamo import callback

        self.count = 0
        self._handler = callback.callback_handler
        self._handler.register_start_callback(self._started)
        return self

    def _started(self, _args) -> None:
        self.count += 1

    def __exit__(self, *exc):
        self._handler.remove_start_callback(self._started)


def run(model, prompts, max_cache_len: int, max_new_tokens: int):
    """Greedy continuations, compiled against one static cache: (tokens per prompt, eager tokens per
    prompt, compile runs, seconds per prompt)."""
    tok = model.tokenizer
    compiled, eager, seconds = [], [], []
    with CompileCounter() as compiles:
        for i, prompt in enumerate(prompts):
            ids = tok([prompt])["input_ids"]
            start = time.perf_counter()
            out = genfn.generate(model, ids, max_new_tokens=max_new_tokens - i % 2,  # lengths vary too
                                 cache_implementation="static", max_cache_len=max_cache_len)
            seconds.append(time.perf_counter() - start)
            compiled.append(out[0, ids.shape[1]:].tolist())
    for i, prompt in enumerate(prompts):  # the same step run eagerly, outside the counter
        ids = tok([prompt])["input_ids"]
        eager.append(genfn.generate(model, ids, max_new_tokens=max_new_tokens - i % 2)[0, ids.shape[1]:].tolist())
    return compiled, eager, compiles.count, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model directory or .gguf file (default: SmolLM2)")
    parser.add_argument("--max-cache-len", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    model = genfn.load(args.model)
    compiled, eager, compiles, seconds = run(model, PROMPTS, args.max_cache_len, args.max_new_tokens)
    for prompt, tokens, s in zip(PROMPTS, compiled, seconds):
        print(f"{len(model.tokenizer([prompt])['input_ids'][0]):3d} prompt tokens, {s:6.2f} s: "
              f"{model.tokenizer.decode(tokens, skip_special_tokens=True)!r}")
    print(f"torch.compile ran {compiles} time(s) for {len(PROMPTS)} prompts (the first call pays for it)")
    if compiled != eager:
        raise SystemExit("compiled tokens differ from eager ones")
    print("compiled tokens equal the eager ones")


if __name__ == "__main__":
    main()
