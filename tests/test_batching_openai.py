"""What the OpenAI server asks of the batching manager: per-request presence/frequency penalties
and logit_bias (against a plain reference computed by hand on the dense model's logits), top
logprobs (against log_softmax top-k of a single-request forward), requests with different
settings sharing a batch, stop strings, cancellation freeing blocks, and ``chunked_prefill`` in
the config. A tiny random Llama, eager; every wait has a timeout."""

from __future__ import annotations

import collections
import itertools
import random
import time

import pytest
import torch

from conftest import tiny_pair
from genfn.batching.manager import ContinuousBatchingManager
from genfn.batching.requests import RequestStatus
from genfn.config.batching import ContinuousBatchingConfig
from genfn.processors.context import LogitsContext
from genfn.processors.openai_sampling import LogitBiasLogitsProcessor, PresenceFrequencyPenaltyLogitsProcessor
from genfn.processors.chain import ProcessorChain

WAIT_S = 60  # the longest any single wait in these tests may take
EOS = 2  # the tiny model's EOS id
VOCAB = 97


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair()[1]


def _config(**overrides):
    sizes = dict(page_size=4, num_blocks=64, max_batch_tokens=32, max_requests_per_batch=6)
    sizes.update(overrides)
    return ContinuousBatchingConfig(**sizes)


@pytest.fixture(scope="module")
def manager(tiny):
    manager = ContinuousBatchingManager(tiny, None, _config())
    manager.start()
    yield manager
    manager.stop(timeout=WAIT_S)


def _collect(manager, ids):
    """The terminal output of each request in ``ids`` (each exactly once)."""
    results = {}
    deadline = time.monotonic() + 10 * WAIT_S
    while len(results) < len(ids) and time.monotonic() < deadline:
        out = manager.get_result(timeout=WAIT_S)
        assert out is not None, "no result came"
        if out.is_finished():
            assert out.request_id not in results, f"{out.request_id} ended twice"
            results[out.request_id] = out
    assert set(results) == set(ids)
    return results


def _run(manager, requests):
    """Add every ``(prompt, settings)`` together; their outputs in order."""
    ids = [manager.add_request(prompt, **settings) for prompt, settings in requests]
    results = _collect(manager, ids)
    return [results[i] for i in ids]


def _dense_logits(model, tokens):
    return model(torch.tensor([tokens])).logits[0, -1].float()


def _by_hand(model, prompt, max_new_tokens, presence=0.0, frequency=0.0, bias=None):
    """Greedy decoding with OpenAI's penalties and bias applied by hand to the dense logits."""
    generated = []
    for _ in range(max_new_tokens):
        logits = _dense_logits(model, prompt + generated)
        adjust = torch.zeros(VOCAB)
        for token, count in collections.Counter(generated).items():
            adjust[token] -= frequency * count + presence
        for token, value in (bias or {}).items():
            adjust[token] += value
        token = int(torch.argmax(logits + adjust))
        generated.append(token)
        if token == EOS:
            break
    return generated


def _prompts(seed, count, low=1, high=12):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(low, high))] for _ in range(count)]


# ----------------------------------------------------------------------------------------------
# The processors on their own
# ----------------------------------------------------------------------------------------------


def _context(rows, width=16):
    """``rows``: (prompt, generated) token lists; a LogitsContext over a padded buffer."""
    tokens = torch.full((len(rows), width), 5, dtype=torch.int64)  # padding that must not count
    for r, (prompt, generated) in enumerate(rows):
        tokens[r, :len(prompt) + len(generated)] = torch.tensor(prompt + generated)
    cur = torch.tensor([len(p) + len(g) for p, g in rows])
    return LogitsContext(tokens=tokens, cur_len=cur, prompt_len=torch.tensor([len(p) for p, _ in rows]))


def test_presence_and_frequency_penalties_count_only_generated_tokens_per_row():
    rows = [([7, 7, 8], [9, 9, 9, 7]), ([9], [10]), ([9, 9], [])]
    values = [(0.5, 1.25), (-2.0, 0.0), (2.0, -1.5)]
    ctx = _context(rows)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    rows_chains = [ProcessorChain((PresenceFrequencyPenaltyLogitsProcessor(p, f),)).per_row(1) for p, f in values]
    merged = ProcessorChain.merge_rows(rows_chains)
    out = merged(logits, ctx)
    for r, ((prompt, generated), (presence, frequency)) in enumerate(zip(rows, values)):
        expected = logits[r].clone()
        for token, count in collections.Counter(generated).items():  # the prompt is not counted
            expected[token] = logits[r, token] - frequency * count - presence
        assert torch.allclose(out[r], expected, atol=1e-6), r
    assert torch.equal(out[2], logits[2])  # nothing generated yet: nothing to penalize


def test_logit_bias_rows_with_different_tokens_merge_into_one_processor():
    biases = [{3: 100.0, 4: -100.0}, None, {4: 0.5, 50: -1.0}]
    chains = [ProcessorChain(() if b is None else (LogitBiasLogitsProcessor.create(b, VOCAB),)).per_row(1)
              for b in biases]
    merged = ProcessorChain.merge_rows(chains)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    out = merged(logits, _context([([1], []), ([1], []), ([1], [])]))
    for r, bias in enumerate(biases):
        expected = logits[r].clone()
        for token, value in (bias or {}).items():
            expected[token] += value
        assert torch.equal(out[r], expected), r


@pytest.mark.parametrize(("settings", "error", "names"), [
    ({"presence_penalty": 2.5}, ValueError, "presence_penalty"),
    ({"frequency_penalty": -2.01}, ValueError, "frequency_penalty"),
    ({"presence_penalty": "1"}, TypeError, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, ValueError, "frequency_penalty"),
    ({"logit_bias": {VOCAB: 1.0}}, ValueError, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, ValueError, "logit_bias"),
    ({"logit_bias": {3: 100.5}}, ValueError, "logit_bias[3]"),
    ({"logit_bias": {"3": 1.0}}, TypeError, "logit_bias"),
    ({"logit_bias": {3: "1"}}, TypeError, "logit_bias[3]"),
    ({"logit_bias": [(3, 1.0)]}, TypeError, "logit_bias"),
    ({"top_logprobs": 21}, ValueError, "top_logprobs"),
    ({"top_logprobs": -1}, ValueError, "top_logprobs"),
    ({"top_logprobs": True}, TypeError, "top_logprobs"),
    ({"top_logprobs": 2.0}, TypeError, "top_logprobs"),
])
def test_bad_openai_settings_are_refused_naming_the_argument(tiny, settings, error, names):
    manager = ContinuousBatchingManager(tiny, None, _config())  # validation happens before the queue
    with pytest.raises(error, match=f"`{names}`".replace("[", r"\[").replace("]", r"\]")):
        manager.add_request([5, 6], max_new_tokens=2, **settings)
    assert manager._inputs.empty()


def test_chunked_prefill_comes_from_the_config_and_the_keyword_overrides_it(tiny):
    assert ContinuousBatchingConfig().chunked_prefill is True
    off = _config(chunked_prefill=False)
    assert ContinuousBatchingManager(tiny, None, off).chunked_prefill is False
    assert ContinuousBatchingManager(tiny, None, off, chunked_prefill=True).chunked_prefill is True
    assert ContinuousBatchingManager(tiny, None, _config(), chunked_prefill=False).chunked_prefill is False
    assert ContinuousBatchingConfig.from_dict(off.to_dict()) == off
    with pytest.raises(TypeError, match="chunked_prefill"):
        ContinuousBatchingConfig(chunked_prefill="yes")
    with pytest.raises(TypeError, match="chunked_prefill"):
        ContinuousBatchingManager(tiny, None, off, chunked_prefill=1)


@pytest.mark.parametrize("chunked", [True, False])
def test_chunked_prefill_off_in_the_config_fails_a_prompt_over_the_token_budget(tiny, chunked):
    manager = ContinuousBatchingManager(tiny, None, _config(max_batch_tokens=16, chunked_prefill=chunked))
    manager.start()
    try:
        long_prompt, short_prompt = _prompts(11, 1, 40, 40)[0], [5, 6, 7]
        out_long, out_short = _run(manager, [(long_prompt, dict(max_new_tokens=3, do_sample=False)),
                                             (short_prompt, dict(max_new_tokens=3, do_sample=False))])
        assert out_short.status == RequestStatus.FINISHED
        if chunked:
            assert out_long.status == RequestStatus.FINISHED
            assert out_long.generated_tokens == _by_hand(tiny, long_prompt, 3)
        else:
            assert out_long.status == RequestStatus.FAILED and out_long.error
        assert manager.metrics().kv_blocks_used == 0
    finally:
        manager.stop(timeout=WAIT_S)


# ----------------------------------------------------------------------------------------------
# Through the manager
# ----------------------------------------------------------------------------------------------


_GREEDY_SETTINGS = [
    {},
    {"frequency_penalty": 2.0},
    {"presence_penalty": 2.0},
    {"presence_penalty": -1.0, "frequency_penalty": 0.75},
    {"logit_bias": {11: 100.0}},
    {"logit_bias": {11: 3.0, 12: -100.0}, "frequency_penalty": 1.5},
]


def test_penalties_and_bias_per_request_equal_a_reference_by_hand(tiny, manager):
    """Six requests with six different settings in one batch (twice over, with different
    prompts): each request's greedy tokens equal decoding it alone with the penalties and bias
    applied by hand to the dense model's logits."""
    prompts = _prompts(21, 2 * len(_GREEDY_SETTINGS))
    requests = [(p, dict(max_new_tokens=10, do_sample=False, eos_token_id=EOS, **_GREEDY_SETTINGS[i % 6]))
                for i, p in enumerate(prompts)]
    outputs = _run(manager, requests)
    changed = 0
    for i, (out, (prompt, _)) in enumerate(zip(outputs, requests)):
        settings = _GREEDY_SETTINGS[i % 6]
        expected = _by_hand(tiny, prompt, 10, settings.get("presence_penalty", 0.0),
                            settings.get("frequency_penalty", 0.0), settings.get("logit_bias"))
        assert out.status == RequestStatus.FINISHED, out.error
        assert out.generated_tokens == expected, (i, settings)
        assert out.finish_reason == ("stop" if expected[-1] == EOS else "length")
        changed += settings != {} and expected != _by_hand(tiny, prompt, 10)
    assert changed >= 6, "the settings should change most requests' tokens"
    assert outputs[4].generated_tokens == [11] * 10  # a +100 bias wins every step


_MIXED_SETTINGS = [
    dict(do_sample=True, seed=1, temperature=0.7, frequency_penalty=1.0, top_logprobs=3),
    dict(do_sample=True, seed=2, top_k=20, presence_penalty=0.5, logit_bias={7: 2.0}),
    dict(do_sample=False, repetition_penalty=1.3, presence_penalty=1.0, top_logprobs=20),
    dict(do_sample=True, seed=3, top_p=0.9, logit_bias={8: -100.0, 9: 1.0}),
    dict(do_sample=False, top_logprobs=1),
    dict(do_sample=True, seed=4, no_repeat_ngram_size=2, frequency_penalty=-0.5),
    dict(do_sample=False),
    dict(do_sample=True, seed=5, min_new_tokens=4, frequency_penalty=2.0, presence_penalty=-2.0),
]


def test_requests_with_different_settings_in_one_batch_equal_each_alone(manager):
    prompts = _prompts(31, len(_MIXED_SETTINGS), 1, 20)
    requests = [(p, dict(max_new_tokens=12, **s)) for p, s in zip(prompts, _MIXED_SETTINGS)]
    together = _run(manager, requests)
    shuffled = list(range(len(requests)))
    random.Random(0).shuffle(shuffled)
    reordered = _run(manager, [requests[i] for i in shuffled])
    for position, i in enumerate(shuffled):
        alone = _run(manager, [requests[i]])[0]
        for out in (together[i], reordered[position]):
            assert out.status == RequestStatus.FINISHED, out.error
            assert out.generated_tokens == alone.generated_tokens, (i, _MIXED_SETTINGS[i])
            assert out.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
            assert (out.top_logprobs is None) == (alone.top_logprobs is None) == ("top_logprobs" not in requests[i][1])


def test_top_logprobs_are_the_log_softmax_top_k_of_a_single_request_forward(tiny, manager):
    """Reported under the model's raw distribution (not the sampled, processed one): the chosen
    token's logprob and the top-k pairs equal log_softmax of the dense logits at each step."""
    prompts = _prompts(41, 3, 2, 15)
    settings = [dict(top_logprobs=5, do_sample=True, seed=9, temperature=0.5, frequency_penalty=1.0),
                dict(top_logprobs=20, do_sample=False, logit_bias={13: 5.0}),
                dict(top_logprobs=0, do_sample=False)]
    outputs = _run(manager, [(p, dict(max_new_tokens=8, **s)) for p, s in zip(prompts, settings)])
    assert outputs[2].top_logprobs is None
    for out, prompt, s in zip(outputs[:2], prompts, settings):
        k = s["top_logprobs"]
        assert len(out.top_logprobs) == len(out.generated_tokens) == len(out.logprobs)
        for step, token in enumerate(out.generated_tokens):
            reference = torch.log_softmax(_dense_logits(tiny, prompt + out.generated_tokens[:step]), dim=-1)
            assert out.logprobs[step] == pytest.approx(float(reference[token]), abs=1e-4)
            pairs = out.top_logprobs[step]
            assert len(pairs) == k
            values, ids = torch.topk(reference, k)
            assert [v for _, v in pairs] == pytest.approx(values.tolist(), abs=1e-4)
            assert [v for _, v in pairs] == sorted((v for _, v in pairs), reverse=True)
            for (token_id, value), expected_id in zip(pairs, ids.tolist()):
                # Ids must match except between values too close for the two forwards to order alike.
                close = (reference - value).abs() < 1e-4
                assert token_id == expected_id or bool(close[expected_id]), (step, token_id, expected_id)
                assert float(reference[token_id]) == pytest.approx(value, abs=1e-4)


class _ToyTokenizer:
    """Tokens spell themselves: 'a'..'d', then 'aa'.. and 'aaa'.., over the tiny model's 97 ids."""

    def __init__(self, vocab_size=VOCAB):
        words = ["".join(p) for n in (1, 2, 3) for p in itertools.product("abcd", repeat=n)]
        self.vocab = {w: i for i, w in enumerate(words[:vocab_size])}
        self.words = {i: w for w, i in self.vocab.items()}

    def get_vocab(self):
        return dict(self.vocab)


def test_a_request_with_stop_strings_ends_there_and_the_others_are_unaffected(tiny, manager):
    from genfn.stopping import stop_string_criteria

    toy = _ToyTokenizer()
    prompts = _prompts(51, 4, 2, 10)
    requests = [(p, dict(max_new_tokens=16, do_sample=False, eos_token_id=EOS)) for p in prompts]
    plain = _run(manager, requests)
    generated = plain[0].generated_tokens
    assert len(generated) >= 6, "the reference run should be long enough to stop early"
    stop = toy.words[generated[3]][-2:]  # a string the 4th token's text ends with
    matcher = stop_string_criteria(toy, [stop])

    def stops_after(count):
        tokens = torch.tensor([prompts[0] + generated[:count]])
        return bool(matcher(tokens, torch.tensor([tokens.shape[1]]))[0])

    end = next(count for count in range(1, len(generated) + 1) if stops_after(count))
    assert end <= 4
    requests[0][1].update(stop_strings=[stop], tokenizer=toy)
    outputs = _run(manager, requests)
    assert outputs[0].status == RequestStatus.FINISHED
    assert outputs[0].generated_tokens == generated[:end], stop
    assert outputs[0].finish_reason == "stop" and plain[0].finish_reason in ("stop", "length")
    for out, before in zip(outputs[1:], plain[1:]):
        assert out.generated_tokens == before.generated_tokens
        assert out.finish_reason == before.finish_reason == ("stop" if out.generated_tokens[-1] == EOS else "length")


def test_cancelled_requests_queued_or_running_free_their_blocks(tiny):
    """More requests than the batch holds: cancel half right after adding them (most still
    queued), the rest mid-generation; each ends exactly once and every block comes back."""
    manager = ContinuousBatchingManager(tiny, None, _config(num_blocks=24, max_requests_per_batch=3))
    manager.start()
    try:
        prompts = _prompts(61, 12, 4, 16)
        ids = [manager.add_request(p, max_new_tokens=40, do_sample=False, eos_token_id=-1) for p in prompts]
        for request_id in ids[::2]:
            manager.cancel_request(request_id)
        deadline = time.monotonic() + WAIT_S
        while manager.metrics().kv_blocks_used == 0 and time.monotonic() < deadline:
            time.sleep(0.005)  # until the survivors hold blocks
        busy = manager.metrics()
        assert busy.kv_blocks_used > 0 and busy.running > 0
        for request_id in ids[1::2]:
            manager.cancel_request(request_id)
        results = _collect(manager, ids)
        assert all(results[i].status == RequestStatus.CANCELLED for i in ids[::2])
        assert all(results[i].finish_reason is None for i in ids[::2])
        assert all(results[i].status in (RequestStatus.CANCELLED, RequestStatus.FINISHED) for i in ids[1::2])
        idle = manager.metrics()
        assert idle.kv_blocks_used == 0 and idle.kv_blocks_free == idle.kv_blocks_total == 24
        assert idle.running == idle.waiting == 0
        cancelled = sum(r.status == RequestStatus.CANCELLED for r in results.values())
        assert idle.requests_cancelled == cancelled and idle.requests_finished == len(ids) - cancelled
        assert not any(manager.scheduler.state.allocator.refs)
    finally:
        manager.stop(timeout=WAIT_S)
    assert manager.metrics().kv_blocks_used == 0


def test_requests_with_the_same_stop_strings_and_tokenizer_share_one_matcher(tiny):
    """Building a matcher reads the whole vocabulary (about a second for SmolLM2's): a server's
    repeated stop strings must not pay it per request."""
    from genfn.batching.settings import request_settings

    toy, other = _ToyTokenizer(), _ToyTokenizer()

    def matcher(tokenizer, stops):
        return request_settings(tiny, [5, 6], None, {"stop_strings": stops}, max_new_tokens=2,
                                tokenizer=tokenizer).settings.stop_strings

    first = matcher(toy, ["ab", "ca"])
    assert matcher(toy, ["ab", "ca"]) is first
    assert matcher(toy, ["ab"]) is not first and matcher(other, ["ab", "ca"]) is not first
    with pytest.raises(ValueError, match="stop_strings"):
        matcher(toy, [])


def test_the_openai_processors_also_serve_generate_as_user_processors(tiny):
    """Not needed by the manager, but the same processors are ordinary genfn processors: passed to
    ``generate(logits_processor=...)`` they give the tokens decoding by hand gives."""
    from genfn.generation import generate

    prompt = _prompts(71, 1, 5, 9)[0]
    processors = [PresenceFrequencyPenaltyLogitsProcessor(0.5, 1.5), LogitBiasLogitsProcessor.create({20: 0.2}, VOCAB)]
    out = generate(tiny, torch.tensor([prompt]), max_new_tokens=8, do_sample=False, logits_processor=processors)
    expected = _by_hand(tiny, prompt, 8, presence=0.5, frequency=1.5, bias={20: 0.2})
    assert out[0, len(prompt):].tolist()[:len(expected)] == expected


def test_max_request_tokens_is_where_a_request_would_fail(tiny):
    """A server checks prompt + max_tokens against ``max_request_tokens``: within it a request
    finishes by length; past it (by two: the last token needs no cache room) it fails."""
    manager = ContinuousBatchingManager(tiny, None, _config(num_blocks=8, max_blocks_per_request=8))
    assert manager.max_request_tokens == 8 * 4  # < max_position_embeddings (256)
    assert ContinuousBatchingManager(tiny, None, _config(num_blocks=1000)).max_request_tokens <= 256
    manager.start()
    try:
        room = manager.max_request_tokens
        fits, over = _run(manager, [([5] * 10, dict(max_new_tokens=room - 10, do_sample=False, eos_token_id=-1)),
                                    ([5] * 10, dict(max_new_tokens=room - 8, do_sample=False, eos_token_id=-1))])
        assert fits.status == RequestStatus.FINISHED and fits.finish_reason == "length"
        assert len(fits.generated_tokens) == room - 10
        assert over.status == RequestStatus.FAILED and str(room) in over.error
    finally:
        manager.stop(timeout=WAIT_S)
