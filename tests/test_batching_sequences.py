"""``num_return_sequences`` (OpenAI's ``n``) inside continuous batching: a request's sequences are
requests of their own that share the prompt's blocks (the prompt is prefilled once; the others
compute only its last partial block), and sequence ``j`` samples with the key ``generate`` gives
the prompt's ``j``-th returned row. Every wait has a timeout."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_pair
from genfn.batching.manager import ContinuousBatchingManager, sequence_ids
from genfn.batching.requests import RequestStatus
from genfn.config.batching import ContinuousBatchingConfig
from genfn.generation import generate

WAIT_S = 60

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair(seed=6)[1]


def _collect(manager, count):
    results = {}
    for _ in range(count):
        out = manager.get_result(timeout=WAIT_S)
        assert out is not None, "no result came"
        results[out.request_id] = out
    return results


def test_n_sequences_share_the_prompt_and_each_equals_generate_with_the_derived_key(tiny):
    prompt = list(range(3, 30))  # 27 tokens: 6 full blocks of 4 and a partial one
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=64, max_batch_tokens=16, max_requests_per_batch=8)
    manager = ContinuousBatchingManager(tiny, None, cb)
    manager.start()
    try:
        ids = manager.add_sequences(prompt, "story", max_new_tokens=8, do_sample=True, temperature=0.9,
                                    num_return_sequences=4, seed=7)
        greedy = manager.add_request([5, 6, 7], max_new_tokens=5, do_sample=False)
        results = _collect(manager, 5)
    finally:
        manager.stop(timeout=WAIT_S)
    assert ids == sequence_ids("story", 4) == ["story", "story.1", "story.2", "story.3"]
    expected = generate(tiny, torch.tensor([prompt]), max_new_tokens=8, do_sample=True, temperature=0.9,
                        num_return_sequences=4, key=7)[:, len(prompt):].tolist()
    eos = tiny.generation_config.eos_token_id
    for j, rid in enumerate(ids):
        assert results[rid].status == RequestStatus.FINISHED, results[rid].error
        row = expected[j][:expected[j].index(eos) + 1] if eos in expected[j] else expected[j]
        assert results[rid].generated_tokens == row, rid
    assert len({tuple(results[rid].generated_tokens) for rid in ids}) > 1
    # The three later sequences took the prompt's 6 full blocks from the prefix cache.
    assert manager.stats["reused_tokens"] == 3 * 24
    alone = generate(tiny, torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False)[0, 3:].tolist()
    assert results[greedy].generated_tokens == (alone[:alone.index(eos) + 1] if eos in alone else alone)


def test_generate_batch_returns_every_sequence_of_every_prompt(tiny):
    prompts = [[4, 5, 6, 7, 8], [9, 10, 11]]
    results = tiny.generate_batch(prompts, max_new_tokens=4, do_sample=True, num_return_sequences=2, seed=3,
                                  continuous_batching_config=ContinuousBatchingConfig(page_size=4))
    assert len(results) == 4
    assert [out.prompt_ids for out in results.values()] == [prompts[0], prompts[0], prompts[1], prompts[1]]
    assert all(out.status == RequestStatus.FINISHED for out in results.values())
