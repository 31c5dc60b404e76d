"""Structured outputs in continuous batching: 16 mixed requests (JSON schema, regex, free) through
the engine step with preemption; every request's tokens equal ``generate`` alone with the same
``response_format`` (the matcher follows the request through preemption and recomputation)."""

from __future__ import annotations

import json
import re

import pytest

import genfn
from genfn.batching import scheduling as S
from genfn.batching.engine import Engine, engine_step
from genfn.batching.requests import make_request
from genfn.batching.settings import request_settings
from genfn.models.packed import init_packed_cache
from tests.conftest import smollm2_path, tiny_pair

pytest.importorskip("llguidance")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "tag"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}, "tag": {"enum": ["a", "bb", "ccc"]}}}
REGEX = r"[0-9]{2}:[0-9]{2}"


@pytest.fixture(scope="module")
def tokenizer():
    from genfn.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_path())


@pytest.fixture(scope="module")
def model():
    return tiny_pair(vocab_size=49152, eos_token_id=2, pad_token_id=2)[1]


def _until_eos(tokens, eos=2):
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def test_mixed_requests_with_preemption_equal_generate_alone(model, tokenizer):
    formats = [{"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
               {"type": "regex", "pattern": REGEX}, None, {"type": "choice", "choices": ["left", "right"]}] * 4
    prompts = [tokenizer.encode(f"Request {i}: " + "give an answer " * (i % 3), add_special_tokens=False)
               for i in range(16)]
    size, blocks, width = 4, 20, 16
    engine = Engine(model, init_packed_cache(model.spec, blocks, size), max_batch_tokens=32, max_requests=8,
                    table_width=width)
    state = S.init_scheduler(blocks, size, S.SchedulerPolicy(max_requests_per_batch=8, max_blocks_per_request=width))
    for i, (prompt, fmt) in enumerate(zip(prompts, formats)):
        settings = {"response_format": fmt} if fmt is not None else {}
        r = request_settings(model, prompt, None, settings, max_new_tokens=40, tokenizer=tokenizer)
        state = S.add_request(state, make_request(i, prompt, r.max_new_tokens, list(r.eos_token_ids),
                                                  {"genfn": r.settings}))
    ended, preempted = {}, 0
    for _ in range(2000):
        if not S.has_pending(state):
            break
        state, outcome = engine_step(engine, state)
        preempted += len(outcome.preempted)
        ended.update({r.request_id: r for r in outcome.finished})
    assert len(ended) == len(prompts) and preempted > 0
    for i, (prompt, fmt) in enumerate(zip(prompts, formats)):
        ids = genfn.generate(model, [prompt], max_new_tokens=40, tokenizer=tokenizer, response_format=fmt)
        alone = ids[0, len(prompt):].tolist()
        got = list(ended[i].generated_ids)
        assert got == _until_eos(alone), f"request {i} ({fmt})"
        text = tokenizer.decode(got, skip_special_tokens=True)
        if i % 4 == 0:
            assert set(json.loads(text)) == {"n", "tag"}
        elif i % 4 == 1:
            assert re.fullmatch(REGEX, text)
        elif i % 4 == 3:
            assert text in ("left", "right")


def test_manager_add_request_takes_response_format(model, tokenizer):
    from genfn.batching.manager import ContinuousBatchingManager
    from genfn.config.batching import ContinuousBatchingConfig

    manager = ContinuousBatchingManager(model, None, ContinuousBatchingConfig(page_size=8, num_blocks=64))
    manager.start()
    try:
        rid = manager.add_request(tokenizer.encode("Time:", add_special_tokens=False), max_new_tokens=12,
                                  tokenizer=tokenizer, response_format={"type": "regex", "pattern": REGEX})
        out = manager.get_result(request_id=rid, timeout=120)
        assert out is not None and out.request_id == rid
        assert re.fullmatch(REGEX, tokenizer.decode(list(out.generated_tokens), skip_special_tokens=True))
        with pytest.raises(ValueError, match="regex"):
            manager.add_request([5, 6], max_new_tokens=4, tokenizer=tokenizer, response_format={"regex": "(ab"})
    finally:
        manager.stop(timeout=60)
