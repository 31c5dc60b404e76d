"""Examples 2-4 run on a tiny random Llama with a real tokenizer (seconds, not minutes): keyed
sampling is batch-independent, one compiled static-cache step serves every prompt, and streaming
handlers on an asyncio loop see every request's tokens grow to generate's greedy result."""

from __future__ import annotations

import asyncio
import importlib.util
import pathlib
import sys

import pytest

import genfn
from cli_support import build_tiny_model

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return genfn.load(build_tiny_model(tmp_path_factory.mktemp("tiny_examples")))


def _greedy(model, prompt: str, max_new_tokens: int) -> list[int]:
    ids = model.tokenizer([prompt])["input_ids"]
    return genfn.generate(model, ids, max_new_tokens=max_new_tokens)[0, ids.shape[1]:].tolist()


def test_sampling_keys_give_a_row_its_tokens_alone_or_batched(tiny):
    example = _load_example("sampling_keys")
    prompts = ["The capital of France is", "Say hi", "Paris is the capital", "hi"]
    alone, batched = example.sample_alone_and_batched(tiny, prompts, seed=3, max_new_tokens=8)
    assert alone == batched and all(alone)
    again, _ = example.sample_alone_and_batched(tiny, prompts, seed=3, max_new_tokens=8)
    other, _ = example.sample_alone_and_batched(tiny, prompts, seed=4, max_new_tokens=8)
    assert again == alone and other != alone
    assert alone != [_greedy(tiny, p, 8) for p in prompts]  # it really sampled


def test_static_cache_reuse_compiles_once_for_every_prompt(tiny):
    example = _load_example("static_cache_reuse")
    prompts = ["hi", "The capital of France is", "Say hi to everyone. The capital of France is Paris."]
    compiled, eager, compiles, _ = example.run(tiny, prompts, max_cache_len=64, max_new_tokens=6)
    assert compiled == eager
    assert compiles == 1, compiles  # three prompt lengths, two max_new_tokens, one compiled step


def test_continuous_batching_stream_handlers_see_tokens_grow(tiny):
    example = _load_example("continuous_batching_stream")
    prompts = ["The capital of France is", "Say hi", "Paris is", "hi to everyone"]
    results = asyncio.run(example.stream_all(tiny, prompts, max_new_tokens=6, timeout_s=120, echo=False))
    assert sorted(results) == [f"req-{i}" for i in range(len(prompts))]
    for i, prompt in enumerate(prompts):
        tokens, counts = results[f"req-{i}"]
        assert tokens == _greedy(tiny, prompt, 6)  # batching never changes a request's greedy tokens
        assert len(counts) >= 2 and counts == sorted(counts) and counts[-1] == len(tokens)
