"""Model drafters inside continuous batching (``genfn.batching.drafting``): a draft model
(``assistant_model``) or the model's own first layers (``assistant_early_exit``) propose each
request's drafts beside the batch, and the batch's packed forward verifies them.

One batch mixes draft-model requests (a draft that is the target itself, so rounds are accepted
whole and run over several steps, and a differently seeded draft that is mostly rejected),
early-exit requests, prompt-lookup requests and plain greedy and sampled ones, with chunked prefill
and a block budget small enough to preempt requests mid-round; every request equals ``generate``'s
result for the same settings and key (greedy: plain greedy; sampling: ``generate``'s speculative
sampling), and every block comes back. Prompt lookup under a ``response_format`` cuts its drafts at
the grammar and equals ``generate`` under the same schema. A draft model of another vocabulary and
MTP are refused by name. Every wait has a timeout."""

from __future__ import annotations

import random

import pytest
import torch

from batching_support import drive, run_requests
from conftest import tiny_pair
from genfn.batching.settings import request_settings
from genfn.config.batching import ContinuousBatchingConfig
from genfn.generation import generate
from genfn.strategies.assisted.build import carried_schedules

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

EOS = 2


@pytest.fixture(scope="module")
def models():
    """The target, and a one-layer draft model of the same vocabulary (other weights: mostly rejected)."""
    target = tiny_pair(seed=4)[1]
    draft = tiny_pair(seed=9, num_hidden_layers=1)[1]
    return target, draft


def _alone(model, prompt, limit, settings):
    settings = dict(settings)
    if "seed" in settings:
        settings["key"] = settings.pop("seed")
    tokens = generate(model, torch.tensor([prompt]), max_new_tokens=limit, **settings)[0, len(prompt):].tolist()
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


def _prompts(seed, count):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        piece = [rng.randrange(3, 97) for _ in range(rng.randint(3, 6))]
        out.append(piece * 3 + [rng.randrange(3, 97) for _ in range(rng.randint(0, 5))])
    return out


def _mixed(target, draft):
    sample = {"do_sample": True, "temperature": 0.8, "top_k": 20}
    return [
        {"do_sample": False},
        {**sample, "seed": 11},
        {"do_sample": False, "prompt_lookup_num_tokens": 3},
        {"do_sample": False, "assistant_model": target, "num_assistant_tokens": 4,
         "assistant_confidence_threshold": 0.0},
        {"do_sample": False, "assistant_model": target, "num_assistant_tokens": 3},  # the adaptive threshold
        {**sample, "seed": 12, "assistant_model": target, "num_assistant_tokens": 5,
         "assistant_confidence_threshold": 0.0},
        {**sample, "seed": 13, "assistant_model": draft, "num_assistant_tokens": 3},
        {"do_sample": False, "assistant_model": draft, "num_assistant_tokens": 3,
         "assistant_confidence_threshold": 0.0},
        {"do_sample": False, "assistant_early_exit": 1, "num_assistant_tokens": 3},
        {**sample, "seed": 14, "assistant_early_exit": 1, "num_assistant_tokens": 2},
        {**sample, "seed": 15, "prompt_lookup_num_tokens": 2},
    ]


def test_mixed_batch_with_preemption_equals_generate(models):
    target, draft = models
    settings = _mixed(target, draft)
    prompts = _prompts(3, len(settings))
    limits = [random.Random(i).randint(10, 24) for i in range(len(settings))]
    expected = [_alone(target, p, n, s) for p, n, s in zip(prompts, limits, settings)]
    # 4-token blocks, 24 of them, 12 tokens a forward: prompts are chunked, requests preempted.
    tokens, most, _, preempted, _ = drive(target, list(zip(prompts, limits, settings)), blocks=24, budget=12)
    assert preempted > 0, "no request was preempted"
    assert most > 2, "no step kept a run of drafts"
    for i, (got, want) in enumerate(zip(tokens, expected)):
        assert got == want, f"request {i} ({ {k: v for k, v in settings[i].items() if k != 'assistant_model'} })"


def test_greedy_draft_requests_equal_plain_greedy_without_preemption(models):
    target, draft = models
    prompts = _prompts(5, 4)
    # A tiny random model is unsure of every token: the default confidence threshold (0.4) would end
    # each round after one draft, so it is off here.
    requests = [(p, 16, {"do_sample": False, "assistant_model": a, "num_assistant_tokens": 4,
                         "assistant_confidence_threshold": 0.0})
                for p, a in zip(prompts, (target, draft, target, draft))]
    tokens, most, _, preempted, _ = drive(target, requests, blocks=64, budget=64)
    assert preempted == 0 and most > 4
    for (prompt, limit, _), got in zip(requests, tokens):
        assert got == _alone(target, prompt, limit, {"do_sample": False})


def test_rounds_split_over_steps_by_a_tight_budget_keep_generates_tokens(models, monkeypatch):
    """Eight tokens a forward for five decoding rows with six drafts each: most rounds are fed in
    parts (the row's own logits verify one draft more than it fed), and sampled rows still give
    ``generate``'s tokens."""
    from genfn.batching import drafting

    target, draft = models
    continued = []
    settle = drafting.settle

    def spy(rounds, verified, accepted, kept, bonus):
        continued.append(accepted == verified == kept and not bonus)
        settle(rounds, verified, accepted, kept, bonus)

    monkeypatch.setattr(drafting, "settle", spy)
    base = {"num_assistant_tokens": 6, "assistant_confidence_threshold": 0.0}
    # The target drafting for itself with nothing between its logits and p (top_k=0): every draft
    # is kept, so a round's parts and its bonus token fall where only the round's bookkeeping puts them.
    same = {"do_sample": True, "top_k": 0, "assistant_model": target, **base}
    settings = [{**same, "seed": 31},
                {"do_sample": False, "assistant_model": target, **base},
                {**same, "seed": 34},
                {"do_sample": True, "seed": 32, "assistant_model": draft, **base},
                {"do_sample": True, "temperature": 0.7, "seed": 33, "assistant_early_exit": 1, **base}]
    prompts = _prompts(12, len(settings))
    expected = [_alone(target, p, 20, s) for p, s in zip(prompts, settings)]
    tokens, most, *_ = drive(target, [(p, 20, s) for p, s in zip(prompts, settings)], blocks=64, budget=8, rows=5)
    assert sum(continued) >= 3 and most > 2, (sum(continued), most)
    assert tokens == expected


def test_heuristic_schedule_matches_generate_and_is_carried(models):
    target, _ = models
    prompt = _prompts(8, 1)[0]
    settings = {"do_sample": True, "seed": 21, "assistant_model": target, "num_assistant_tokens": 2,
                "num_assistant_tokens_schedule": "heuristic", "assistant_confidence_threshold": 0.0}
    carried_schedules.pop(target, None)
    want = _alone(target, prompt, 20, settings)
    after_generate = int(carried_schedules[target].num_tokens[0])
    carried_schedules.pop(target, None)
    (got,), most, *_ = drive(target, [(prompt, 20, settings)], blocks=64, budget=64)
    assert got == want and most > 2
    assert int(carried_schedules[target].num_tokens[0]) == after_generate > 2
    carried_schedules.pop(target, None)


def test_the_manager_runs_draft_requests_and_returns_every_block(models):
    target, draft = models
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=24, max_batch_tokens=16, max_requests_per_batch=4)
    settings = _mixed(target, draft)[3:8]
    prompts = _prompts(6, len(settings))
    requests = [(p, 12, s) for p, s in zip(prompts, settings)]
    outputs, _ = run_requests(target, requests, cb)
    for (prompt, limit, s), out in zip(requests, outputs):
        assert out.generated_tokens == _alone(target, prompt, limit, s)


def test_a_draft_model_of_another_vocabulary_and_mtp_are_refused_by_name(models):
    target, _ = models
    other = tiny_pair(seed=2, vocab_size=50)[1]
    with pytest.raises(ValueError, match="assistant_model has a vocabulary of 50"):
        request_settings(target, [5, 6, 7], None, {"assistant_model": other}, max_new_tokens=4)
    with pytest.raises(TypeError, match="assistant_model"):
        request_settings(target, [5, 6, 7], None, {"assistant_model": "a name"}, max_new_tokens=4)
    with pytest.raises(ValueError, match="assistant_early_exit"):
        request_settings(target, [5, 6, 7], None, {"assistant_early_exit": 2}, max_new_tokens=4)  # 2 layers
    with pytest.raises(ValueError, match="use_mtp"):
        request_settings(target, [5, 6, 7], None, {"use_mtp": True}, max_new_tokens=4)


def test_prompt_lookup_with_a_response_format_equals_generate_under_the_schema():
    pytest.importorskip("llguidance")
    from conftest import smollm2_path
    from genfn.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(smollm2_path())
    model = tiny_pair(vocab_size=49152, eos_token_id=2, pad_token_id=2)[1]
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "tag"],
              "properties": {"name": {"type": "string", "maxLength": 12}, "tag": {"enum": ["alpha", "beta"]}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    example = '{"name": "cat", "tag": "alpha"} {"name": "dog", "tag": "beta"} {"name": "'
    prompts = [tokenizer.encode(f"{i}: " + example, add_special_tokens=False) for i in range(4)]
    settings = {"response_format": fmt, "prompt_lookup_num_tokens": 4}
    ended, most, *_ = drive(model, [(prompt, 30, settings) for prompt in prompts], blocks=64, budget=32, rows=4,
                           width=32, tokenizer=tokenizer)
    assert most > 1, "no step kept a draft"
    for i, prompt in enumerate(prompts):
        want = generate(model, [prompt], max_new_tokens=30, tokenizer=tokenizer, response_format=fmt)
        alone = want[0, len(prompt):].tolist()
        alone = alone[:alone.index(2) + 1] if 2 in alone else alone
        assert ended[i] == alone, i
        lookup = generate(model, [prompt], max_new_tokens=30, tokenizer=tokenizer, response_format=fmt,
                          prompt_lookup_num_tokens=4)[0, len(prompt):].tolist()
        assert (lookup[:lookup.index(2) + 1] if 2 in lookup else lookup) == alone
