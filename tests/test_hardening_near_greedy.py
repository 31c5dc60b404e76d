"""The near-greedy reply (issue 28): could a request of continuous batching read another request's
keys/values? Many concurrent requests (greedy, and sampling at temperature 1e-4 with a seed) with
shared prefixes, identical prompts side by side, cancellations from another thread, and a block
budget small enough that requests are preempted and recomputed from the prefix cache: every request
that finishes must give its solo run's tokens *and* its solo run's log-probabilities (a request
reading someone else's blocks would change its logits even where the argmax survived)."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from conftest import tiny_pair
from genfn.batching import blocks as B
from genfn.batching.manager import ContinuousBatchingManager
from genfn.batching.requests import RequestStatus
from genfn.config.batching import ContinuousBatchingConfig
from genfn.generation import generate

WAIT_S = 60
EOS = 2

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair()[1]


def _solo(model, prompt, limit, settings):
    """(tokens up to EOS, the log-probability of each under the raw logits) of ``generate`` alone."""
    settings = dict(settings)
    seed = settings.pop("seed", None)
    out = generate(model, torch.tensor([prompt]), max_new_tokens=limit, key=seed, return_dict_in_generate=True,
                   output_logits=True, **settings)
    tokens = out.sequences[0, len(prompt):].tolist()
    if EOS in tokens:
        tokens = tokens[:tokens.index(EOS) + 1]
    logprobs = [float(torch.log_softmax(step[0], -1)[t]) for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def _workload(rng, vocab):
    system = [rng.randrange(3, vocab) for _ in range(9)]  # two full blocks of 4 shared by many prompts
    # Whole blocks that recur in other orders: the same 4 tokens after different prefixes hold
    # different keys/values (layers past the first see the context), so only the digest chain
    # (parent + tokens) may match them.
    pieces = [[rng.randrange(3, vocab) for _ in range(4)] for _ in range(3)]
    requests = []
    for i in range(40):
        if i % 5 == 4:
            order = rng.sample(range(3), rng.randint(2, 3))
            prompt = [t for k in order for t in pieces[k]] + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 3))]
        elif i % 3 == 0:
            prompt = system + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 6))]
        elif i % 3 == 1 and requests:
            prompt = list(requests[-1][0])  # the same prompt as the previous request, side by side
        else:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 14))]
        settings = ({"do_sample": False} if i % 2 == 0 else
                    {"do_sample": True, "temperature": 1e-4, "seed": 500 + i})
        requests.append((prompt, rng.randint(4, 16), settings))
    return requests


def test_no_request_reads_another_requests_blocks_under_preemption_prefix_reuse_and_cancels(tiny):
    rng = random.Random(28)
    work = _workload(rng, tiny.vocab_size)
    # 18 blocks of 4 slots for up to 6 requests of up to 30 tokens: preemption is certain.
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=18, max_batch_tokens=24, max_requests_per_batch=6)
    manager = ContinuousBatchingManager(tiny, None, cb)
    results: dict = {}
    lock = threading.Lock()
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=m, eos_token_id=EOS, **s) for p, m, s in work]
        doomed = set(rng.sample(ids, 8))

        def canceller():
            for rid in sorted(doomed):
                time.sleep(rng.uniform(0, 0.02))
                manager.cancel_request(rid)
        thread = threading.Thread(target=canceller)
        thread.start()
        deadline = time.monotonic() + 10 * WAIT_S
        while len(results) < len(ids) and time.monotonic() < deadline:
            out = manager.get_result(timeout=WAIT_S)
            assert out is not None, "no result came"
            if out.is_finished():
                with lock:
                    assert out.request_id not in results, f"{out.request_id} ended twice"
                    results[out.request_id] = out
        thread.join(timeout=WAIT_S)
        assert not thread.is_alive()
        alloc = manager.scheduler.state.allocator
        B.check_invariants(alloc)
        assert B.num_free_blocks(alloc) == alloc.num_blocks, "blocks leaked"
        preempted, reused = manager.stats["preempted"], manager.stats["reused_tokens"]
    finally:
        manager.stop(timeout=WAIT_S)
    assert set(results) == set(ids), "a request never ended"
    assert preempted > 0 and reused > 0, "the workload did not exercise preemption and prefix reuse"
    compared = 0
    for rid, (prompt, limit, settings) in zip(ids, work):
        out = results[rid]
        if out.status == RequestStatus.CANCELLED:
            assert rid in doomed
            continue
        assert out.status == RequestStatus.FINISHED, out.error
        tokens, logprobs = _solo(tiny, prompt, limit, settings)
        assert list(out.generated_tokens) == tokens, f"{rid} {settings}: tokens differ from its solo run"
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(logprobs), rtol=1e-4, atol=1e-4,
                                   msg=f"{rid}: log-probabilities differ from its solo run (another request's "
                                       f"keys/values?)")
        compared += 1
    assert compared >= len(ids) - len(doomed)


@pytest.mark.parametrize("temperature", [1e-4, 1e-12, 1e-30])
def test_tiny_temperatures_stay_finite_and_near_greedy(tiny, temperature):
    """logits / temperature in float32 (every family returns float32 logits) stays finite down to
    1e-30 for logits of this size, so the choice is the greedy one wherever the top two logits are
    apart by more than temperature x the Gumbel noise's range (~20)."""
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    greedy = generate(tiny, prompt, max_new_tokens=12, return_dict_in_generate=True, output_logits=True)
    sampled = generate(tiny, prompt, max_new_tokens=12, do_sample=True, temperature=temperature, top_k=0, key=3,
                       return_dict_in_generate=True, output_scores=True)
    for step, scores in enumerate(sampled.scores):
        assert torch.isfinite(scores).any(-1).all(), f"step {step}: no finite score"
    # Up to the first near-tie, the sampled tokens are the greedy ones.
    for step, logits in enumerate(greedy.logits):
        top2 = torch.topk(logits[0], 2).values
        if float(top2[0] - top2[1]) <= 20 * temperature:
            break
        assert int(sampled.sequences[0, 5 + step]) == int(greedy.sequences[0, 5 + step])
