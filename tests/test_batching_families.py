"""Continuous batching as a capability of a model family (``genfn.models.registry.PACKED_FORWARDS``).

For each family that declares a packed forward (Llama, Mistral with a sliding window shorter than
the prompts, Qwen2 with its q/k/v bias, and a transformers GPT-2 wrapped by ``from_module``):
greedy requests equal ``generate`` request by request and seeded sampled requests equal
``generate`` with the same key, in one batch that chunks prompts, is preempted by a tiny block
budget and shares a system prompt's blocks. An encoder-decoder model is refused when the manager
is built, naming the model and what runs it. Every wait has a timeout."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_pair
from genfn.batching.manager import ContinuousBatchingManager
from genfn.batching.requests import RequestStatus
from genfn.config.batching import ContinuousBatchingConfig
from genfn.generation import generate
from genfn.models.registry import PACKED_FORWARDS, packed_forward
from batching_support import run_requests


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

FAMILIES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {"sliding_window": 8},
    "Qwen2ForCausalLM": {},
    "GPT2LMHeadModel": {},  # wrapped with genfn.from_module
}


def _wrapped_gpt2():
    import transformers

    import genfn

    config = transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=1,
                                     eos_token_id=2, initializer_range=0.3)
    torch.manual_seed(4)
    return genfn.from_module(transformers.GPT2LMHeadModel(config).eval())


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request):
    if request.param == "GPT2LMHeadModel":
        return _wrapped_gpt2()
    return tiny_pair(request.param, seed=4, **FAMILIES[request.param])[1]


def _alone(model, prompt, max_new_tokens, **settings):
    out = generate(model, torch.tensor([prompt]), max_new_tokens=max_new_tokens, **settings)
    tokens = out[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def test_each_family_batches_greedy_and_seeded_requests_as_generate(family_model):
    model = family_model
    assert packed_forward(model) is not None
    rng = random.Random(11)
    system = [rng.randrange(3, 97) for _ in range(13)]
    requests = []
    for i in range(12):
        prompt = [rng.randrange(3, 97) for _ in range(rng.randint(1, 24))]
        if i % 2:
            prompt = system + prompt[:6]  # a shared prefix, longer than Mistral's window of 8
        settings = {"do_sample": False} if i % 3 else {"do_sample": True, "temperature": 0.8, "top_k": 20,
                                                        "seed": 500 + i}
        requests.append((prompt, rng.randint(4, 12), settings))
    # 12 blocks of 4 tokens and 12 tokens per forward: prompts are chunked, requests preempted.
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=12, max_batch_tokens=12, max_requests_per_batch=4)
    outputs, stats = run_requests(model, requests, cb)
    assert stats["preempted"] > 0 and stats["reused_tokens"] > 0, dict(stats)
    for i, (out, (prompt, limit, settings)) in enumerate(zip(outputs, requests)):
        assert out.status == RequestStatus.FINISHED, out.error
        settings = dict(settings)
        seed = settings.pop("seed", None)
        expected = _alone(model, prompt, limit, key=seed, **settings) if seed is not None else \
            _alone(model, prompt, limit, **settings)
        assert out.generated_tokens == expected, f"request {i} ({settings})"


def test_an_encoder_decoder_model_is_refused_when_the_manager_is_built(tmp_path_factory):
    from test_encoder_decoder import pair

    model = pair("bart", tmp_path_factory)[1]
    assert packed_forward(model) is None and "genfn.models.adapter" in PACKED_FORWARDS
    with pytest.raises(ValueError, match=r"continuous batching cannot run .*encoder-decoder.*genfn\.generate"):
        ContinuousBatchingManager(model)
    with pytest.raises(ValueError, match="continuous batching cannot run"):
        model.generate_batch([[5, 6, 7]], max_new_tokens=2)
