"""The token budget split: while requests decode, a batch carries at most
``prefill_tokens_while_decoding`` prompt tokens (pure scheduler), and the manager's greedy tokens
do not depend on the cap."""

from __future__ import annotations

import pytest
import torch

from genfn.batching import scheduling as S
from genfn.batching.requests import RequestStatus, make_request

from conftest import tiny_pair

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_pair()[1]


def _policy(cap, **options):
    return S.SchedulerPolicy(kind="fifo", max_requests_per_batch=8, prefill_tokens_while_decoding=cap, **options)


def _decoding_state(cap, **options):
    """Request "d" decodes (its 4-token prompt computed); "p" (40 tokens) and "q" (30) wait."""
    state = S.init_scheduler(64, 4, _policy(cap, **options))
    state = S.add_request(state, make_request("d", range(1, 5), max_new_tokens=50))
    state, batch = S.schedule(state, 64)
    state, _ = S.apply_step(state, batch, {"d": 7})
    assert state.requests["d"].status == RequestStatus.DECODING
    state = S.add_request(state, make_request("p", range(10, 50), max_new_tokens=5))
    return S.add_request(state, make_request("q", range(60, 90), max_new_tokens=5))


def test_prompt_tokens_are_capped_while_a_request_decodes():
    state = _decoding_state(12)
    state, batch = S.schedule(state, 64)
    sizes = {c.request_id: len(c.token_ids) for c in batch.chunks}
    assert sizes == {"d": 1, "p": 12}  # the decode row first, then 12 prompt tokens; "q" waits
    # The prompt continues 12 tokens a step while "d" decodes.
    state, _ = S.apply_step(state, batch, {"d": 8})
    state, batch = S.schedule(state, 64)
    assert {c.request_id: len(c.token_ids) for c in batch.chunks} == {"d": 1, "p": 12}
    assert next(c for c in batch.chunks if c.request_id == "p").start == 12


def test_without_a_cap_or_a_decoding_request_the_whole_budget_goes_to_prompts():
    state, batch = S.schedule(_decoding_state(None), 64)
    assert {c.request_id: len(c.token_ids) for c in batch.chunks} == {"d": 1, "p": 40, "q": 23}
    # Nothing decodes yet: the cap does not apply.
    state = S.init_scheduler(64, 4, _policy(12))
    state = S.add_request(state, make_request("p", range(10, 50), max_new_tokens=5))
    state, batch = S.schedule(state, 64)
    assert [len(c.token_ids) for c in batch.chunks] == [40]
    # Without chunked prefill a prompt is never split, so the cap cannot apply either.
    state, batch = S.schedule(_decoding_state(12, chunked_prefill=False), 64)
    assert {c.request_id: len(c.token_ids) for c in batch.chunks} == {"d": 1, "p": 40}  # "q" does not fit whole


@pytest.mark.parametrize("cap", [0, -3, True, 2.5])
def test_a_bad_cap_is_refused_by_name(cap):
    with pytest.raises(ValueError, match="prefill_tokens_while_decoding"):
        _policy(cap)


def test_the_manager_cap_changes_no_greedy_token(tiny_model):
    """A tiny model, prompts of mixed lengths: greedy outputs with a cap of 8 prompt tokens per
    decoding batch equal those without one, and equal each request's ``generate``."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=gen).tolist() for n in (5, 40, 17, 33, 2, 26)]
    outputs = {}
    for cap in (8, 512):
        results = tiny_model.generate_batch(prompts, max_new_tokens=6, do_sample=False, warmup=False,
                                            prefill_tokens_while_decoding=cap)
        outputs[cap] = [list(r.generated_tokens) for r in results.values()]
    assert outputs[8] == outputs[512]
    for prompt, generated in zip(prompts, outputs[8]):
        alone = tiny_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
        assert alone[0, len(prompt):].tolist() == generated
    with pytest.raises(ValueError, match="prefill_tokens_while_decoding"):
        tiny_model.generate_batch(prompts[:1], max_new_tokens=2, warmup=False, prefill_tokens_while_decoding=0)


def test_generate_batch_opens_the_whole_budget_and_the_manager_caps_a_quarter(tiny_model):
    """An offline batch is throughput-first (prompts take whatever decoding leaves of the budget,
    as vLLM schedules); a manager made for serving caps prompt tokens at a quarter of it unless
    told otherwise. ``"uncapped"`` names the first, an int any cap; anything else is refused."""
    from genfn.batching.manager import UNCAPPED, ContinuousBatchingManager
    from genfn.config.batching import ContinuousBatchingConfig

    config = ContinuousBatchingConfig(max_batch_tokens=256)
    serving = ContinuousBatchingManager(tiny_model, continuous_batching_config=config)
    serving._build()
    assert serving.scheduler.policy.prefill_tokens_while_decoding == 64
    offline = ContinuousBatchingManager(tiny_model, continuous_batching_config=config,
                                        prefill_tokens_while_decoding=UNCAPPED)
    offline._build()
    assert offline.scheduler.policy.prefill_tokens_while_decoding == 256
    with pytest.raises(ValueError, match="prefill_tokens_while_decoding"):
        ContinuousBatchingManager(tiny_model, prefill_tokens_while_decoding="none")

    seen = {}
    original = ContinuousBatchingManager.__init__

    def spy(self, *args, **kwargs):
        seen.update(kwargs)
        original(self, *args, **kwargs)

    ContinuousBatchingManager.__init__ = spy
    try:
        results = tiny_model.generate_batch([[5, 6, 7]], max_new_tokens=2, warmup=False)
    finally:
        ContinuousBatchingManager.__init__ = original
    assert seen["prefill_tokens_while_decoding"] == UNCAPPED
    assert len(next(iter(results.values())).generated_tokens) == 2
