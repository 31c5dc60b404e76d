"""``num_return_sequences`` (OpenAI's ``n``) inside continuous batching (``genfn.batching.sequence_groups``):
a request's sequences share the prompt's blocks and its logits (the prompt goes through the model
once; the others fork the first's block table and choose their first token from its logits row),
then decode as requests of their own, and sequence ``j`` samples with the key ``generate`` gives
the prompt's ``j``-th returned row, with chunked prefill, preemption and cancellation, without
leaking a block. Every wait has a timeout."""

from __future__ import annotations

import pytest
import torch

from batching_support import run_engine
from conftest import tiny_pair
from genfn.batching import blocks as B
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
        state = manager.scheduler.state
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
    # The prompt went through the model once (and the greedy prompt beside it): the three later
    # sequences forked the first's blocks (27 tokens each) and sampled from its logits row.
    assert manager.stats["preempted"] == 0
    assert manager.stats["prompt_tokens_computed"] == 27 + 3
    assert manager.stats["reused_tokens"] == 3 * 27
    assert B.num_free_blocks(state.allocator) == state.allocator.num_blocks, "blocks leaked"
    alone = generate(tiny, torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False)[0, 3:].tolist()
    assert results[greedy].generated_tokens == (alone[:alone.index(eos) + 1] if eos in alone else alone)


def test_generate_batch_returns_every_sequence_of_every_prompt(tiny):
    prompts = [[4, 5, 6, 7, 8], [9, 10, 11]]
    results = tiny.generate_batch(prompts, max_new_tokens=4, do_sample=True, num_return_sequences=2, seed=3,
                                  continuous_batching_config=ContinuousBatchingConfig(page_size=4))
    assert len(results) == 4
    assert [out.prompt_ids for out in results.values()] == [prompts[0], prompts[0], prompts[1], prompts[1]]
    assert all(out.status == RequestStatus.FINISHED for out in results.values())


SEQUENCES = {  # request id -> (prompt, max_new_tokens, settings)
    "story": (list(range(3, 30)), 8, dict(do_sample=True, temperature=0.9, num_return_sequences=4, seed=7)),
    "pair": (list(range(40, 49)), 6, dict(do_sample=True, top_k=20, repetition_penalty=1.2,
                                          num_return_sequences=2, seed=3)),
    "aligned": (list(range(60, 68)), 5, dict(do_sample=True, num_return_sequences=3, seed=9)),  # 2 full blocks
}
OTHERS = {
    "greedy": ([5, 6, 7], 6, dict(do_sample=False)),
    "greedy-long": (list(range(30, 52)), 9, dict(do_sample=False)),
    "sampled": ([11, 12, 13, 14], 7, dict(do_sample=True, temperature=0.9, seed=5)),
}


def _expected(model, prompt, limit, settings):
    """generate's rows (generated tokens, each cut after its first EOS), with the same key."""
    settings = dict(settings)
    seed = settings.pop("seed", None)
    rows = generate(model, torch.tensor([prompt]), max_new_tokens=limit,
                    **({"key": seed} if seed is not None else {}), **settings)[:, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    return [row[:row.index(eos) + 1] if eos in row else row for row in rows]


@pytest.mark.parametrize("num_blocks,max_batch_tokens,max_rows", [(96, 64, 16), (13, 8, 8)],
                         ids=["roomy", "tiny-budget-chunked"])
def test_n_sequences_compute_the_prompt_once_and_each_equals_generate(tiny, num_blocks, max_batch_tokens, max_rows):
    ended, seen = run_engine(tiny, {**SEQUENCES, **OTHERS}, num_blocks, max_batch_tokens, max_rows)
    for rid, (prompt, limit, settings) in SEQUENCES.items():
        ids = sequence_ids(rid, settings["num_return_sequences"])
        assert [list(ended[sid].generated_ids) for sid in ids] == _expected(tiny, prompt, limit, settings), rid
        assert all(ended[sid].status == RequestStatus.FINISHED for sid in ids)
    for rid, (prompt, limit, settings) in OTHERS.items():
        assert [list(ended[rid].generated_ids)] == _expected(tiny, prompt, limit, settings), rid
    assert sorted(seen["joined"]) == sorted(SEQUENCES)  # every leader forked its sequences once
    prompts = sum(len(prompt) for prompt, _, _ in {**SEQUENCES, **OTHERS}.values())
    later = sum(settings.get("num_return_sequences", 1) - 1 for _, _, settings in SEQUENCES.values())
    if num_blocks > 50:
        # Every prompt computed exactly once; each sequence computes its own tokens but the last
        # (the first one of the n sampled from the shared logits row).
        assert not seen["preempted"]
        assert seen["shared_rows"] == later
        assert seen["prompt_tokens"] == prompts
        assert seen["tokens"] == prompts + sum(len(r.generated_ids) - 1 for r in ended.values())
        # The later sequences' prompt tokens came from the first's blocks.
        assert seen["reused"] == sum(len(SEQUENCES[rid][0]) * (SEQUENCES[rid][2]["num_return_sequences"] - 1)
                                     for rid in SEQUENCES)
    else:
        # The budget forced preemptions, of forked sequences among them (each recomputed and went
        # on with its own key), and some later sequences found no row beside their leader's (they
        # computed the prompt's last token themselves).
        assert any(isinstance(r, str) and "." in r for r in seen["preempted"]), seen["preempted"]


def test_sequences_without_a_row_beside_their_first_compute_the_prompts_last_token_themselves(tiny):
    story = {"story": SEQUENCES["story"]}
    ended, seen = run_engine(tiny, story, 64, 16, 2)  # two rows: the first sequence's and one shared
    assert seen["shared_rows"] == 1 and seen["joined"] == ["story"]
    # The two others forked 26 tokens (the partial block copied) and computed the last one each.
    assert seen["prompt_tokens"] == 27 + 2
    assert [list(ended[sid].generated_ids) for sid in sequence_ids("story", 4)] == _expected(tiny, *story["story"])


def test_cancelling_one_sequence_leaves_the_others_and_cancelling_the_first_early_ends_them_all(tiny):
    story = {"story": SEQUENCES["story"]}
    ended, _ = run_engine(tiny, story, 64, 16, 8, cancel=(4, "story.2"))
    expected = _expected(tiny, *story["story"])
    for j, sid in enumerate(sequence_ids("story", 4)):
        if sid == "story.2":
            assert ended[sid].status == RequestStatus.CANCELLED
        else:
            assert list(ended[sid].generated_ids) == expected[j], sid
    # Cancelled while its prompt is still being prefilled (27 tokens, 16 a forward): the other
    # sequences never joined; every block came back (checked by _run_engine).
    ended, seen = run_engine(tiny, story, 64, 16, 8, cancel=(1, "story"))
    assert list(ended) == ["story"] and ended["story"].status == RequestStatus.CANCELLED and not seen["joined"]


def test_a_request_cancelled_before_its_prompt_is_computed_ends_every_sequence(tiny):
    manager = ContinuousBatchingManager(tiny, None, ContinuousBatchingConfig(page_size=4, num_blocks=32))
    ids = manager.add_sequences(list(range(3, 20)), "early", max_new_tokens=4, do_sample=True,
                                num_return_sequences=3, seed=1)
    manager.cancel_request("early")  # before start(): applied right after the loop's first drain
    manager.start()
    try:
        results = _collect(manager, 3)
        state = manager.scheduler.state
    finally:
        manager.stop(timeout=WAIT_S)
    assert sorted(results) == sorted(ids)
    assert all(out.status == RequestStatus.CANCELLED for out in results.values())
    assert not state.requests and B.num_free_blocks(state.allocator) == state.allocator.num_blocks
