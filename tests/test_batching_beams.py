"""Beam search and beam sampling inside continuous batching (``genfn.batching.beam_groups``).

A beam request's beams are rows of the batch that decode together; after each forward their
logits go through ``generate``'s own beam step, and each new beam's block table is a fork of its
parent's. Beam requests share batches with greedy and sampled requests and must give
``generate``'s tokens and ``sequences_scores``, with chunked prefill, with preemption forced by a
tiny block budget, and without leaking a block (the allocator's invariants hold after every
step). Every wait has a timeout."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_pair
from genfn.batching import beam_groups
from genfn.batching import blocks as B
from genfn.batching import scheduling as S
from genfn.batching.engine import Engine, engine_step, require_packed_forward
from genfn.batching.manager import ContinuousBatchingManager, sequence_ids
from genfn.batching.requests import RequestStatus, make_request
from genfn.batching.settings import request_settings
from genfn.config.batching import ContinuousBatchingConfig
from genfn.generation import generate

WAIT_S = 60

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair(seed=6)[1]


def _beam_generate(model, prompt, max_new_tokens, **settings):
    """generate's hypotheses (generated tokens only, each cut at its own length) and their scores."""
    out = generate(model, torch.tensor([prompt]), max_new_tokens=max_new_tokens, return_dict_in_generate=True,
                   output_scores=True, **settings)
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    rows = out.sequences[:, len(prompt):].tolist()
    return [row[:n] for row, n in zip(rows, lengths)], out.sequences_scores.tolist()


def _alone(model, prompt, max_new_tokens, **settings):
    tokens = generate(model, torch.tensor([prompt]), max_new_tokens=max_new_tokens, **settings)[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


BEAMS = {  # request id -> (prompt, max_new_tokens, settings)
    "beam": (list(range(3, 14)), 8, dict(num_beams=3, num_return_sequences=2)),
    "beam-lp": (list(range(20, 29)), 7, dict(num_beams=2, length_penalty=0.5, early_stopping=True)),
    "beam-never": ([9, 8, 7, 6, 5], 6, dict(num_beams=3, num_return_sequences=3, early_stopping="never",
                                           length_penalty=1.5)),
    "beam-sample": (list(range(40, 53)), 8, dict(num_beams=3, num_return_sequences=2, do_sample=True,
                                                 temperature=0.8, top_k=20, key=11)),
    "beam-penalty": ([4, 4, 5, 4, 6], 7, dict(num_beams=2, repetition_penalty=1.3, no_repeat_ngram_size=2)),
}
OTHERS = {
    "greedy": ([5, 6, 7], 6, dict(do_sample=False)),
    "greedy-long": (list(range(30, 52)), 9, dict(do_sample=False)),
    "sampled": ([11, 12, 13, 14], 7, dict(do_sample=True, temperature=0.9, key=5)),
}


def _run_engine(model, num_blocks, max_batch_tokens, block_size=4, width=16, max_steps=400, kind="fifo"):
    cache = require_packed_forward(model).init_packed_cache(model.spec, num_blocks, block_size)
    engine = Engine(model, cache, max_batch_tokens=max_batch_tokens, max_requests=8, table_width=width)
    state = S.init_scheduler(num_blocks, block_size, S.SchedulerPolicy(kind=kind, max_requests_per_batch=8,
                                                                       max_blocks_per_request=width))
    for rid, (prompt, limit, settings) in {**BEAMS, **OTHERS}.items():
        settings = dict(settings)
        key = settings.pop("key", None)
        resolved = request_settings(model, prompt, None, {**settings, "key": key} if key is not None else settings,
                                    max_new_tokens=limit)
        if resolved.beam is not None:
            request = beam_groups.leader_request(rid, prompt, resolved.settings, resolved.beam,
                                                 sequence_ids(rid, len(resolved.sequences)))
        else:
            request = make_request(rid, prompt, resolved.max_new_tokens, list(resolved.eos_token_ids),
                                   {"genfn": resolved.settings})
        state = S.add_request(state, request)
    ended, scores, preempted = {}, {}, set()
    for _ in range(max_steps):
        if not S.has_pending(state):
            break
        groups = state.groups
        state, outcome = engine_step(engine, state)
        B.check_invariants(state.allocator)
        for gid, group in groups.items():  # a group's beams sample in one forward, or none does
            sampling = {c.request_id for c in outcome.batch.chunks if c.samples} & set(group.members)
            assert len(sampling) in (0, len(group.members)), gid
        assert not outcome.failed, [r.error for r in outcome.failed]
        preempted.update(outcome.preempted)
        ended.update({r.request_id: r for r in outcome.finished})
        scores.update(outcome.sequence_scores)
    assert not S.has_pending(state), "the engine did not finish in time"
    assert not state.groups and B.num_free_blocks(state.allocator) == num_blocks and not any(state.allocator.refs)
    return ended, scores, preempted


def _check_against_generate(model, tokens, scores):
    """``tokens``: each sequence's generated tokens by id; ``scores``: each hypothesis' score."""
    for rid, (prompt, limit, settings) in BEAMS.items():
        expected, expected_scores = _beam_generate(model, prompt, limit, **settings)
        ids = sequence_ids(rid, settings.get("num_return_sequences", 1))
        assert [list(tokens[sid]) for sid in ids] == expected, rid
        assert [scores[sid] for sid in ids] == pytest.approx(expected_scores, abs=1e-4), rid
    for rid, (prompt, limit, settings) in OTHERS.items():
        assert list(tokens[rid]) == _alone(model, prompt, limit, **settings), rid


@pytest.mark.parametrize("num_blocks,max_batch_tokens", [(80, 64), (13, 8)], ids=["roomy", "tiny-budget-chunked"])
def test_beam_requests_in_a_mixed_batch_equal_generate(tiny, num_blocks, max_batch_tokens, monkeypatch):
    forks = []

    def counted_fork(alloc, source, target, num_tokens):
        out = real_fork(alloc, source, target, num_tokens)
        forks.append("copied" if out[2] is not None else "aligned" if out[1] == num_tokens else "recomputed")
        return out

    real_fork = B.fork
    monkeypatch.setattr(B, "fork", counted_fork)
    ended, scores, preempted = _run_engine(tiny, num_blocks, max_batch_tokens)
    _check_against_generate(tiny, {rid: r.generated_ids for rid, r in ended.items()}, scores)
    assert "copied" in forks  # a partial last block copied for a second child of a beam
    if num_blocks < 30:
        # The budget forced preemptions, beam groups among them (recomputed, then decoding together
        # again), and a fork with no block to spare (the child recomputed its partial block).
        assert any(isinstance(r, tuple) and r[1] == "beam" for r in preempted)
        assert "recomputed" in forks


@pytest.mark.parametrize("num_blocks,max_batch_tokens", [(80, 64), (13, 8)], ids=["roomy", "tiny-budget-chunked"])
def test_beam_requests_under_the_prefill_first_scheduler_equal_generate(tiny, num_blocks, max_batch_tokens):
    """Split-prefill continuations go first there: the beams of a group still decode together
    (checked each step by _run_engine), around prompts computed before them."""
    ended, scores, preempted = _run_engine(tiny, num_blocks, max_batch_tokens, kind="prefill_first")
    _check_against_generate(tiny, {rid: r.generated_ids for rid, r in ended.items()}, scores)
    if num_blocks < 30:
        assert any(isinstance(r, tuple) and r[1] == "beam" for r in preempted)


def test_beam_requests_through_the_compiled_batching_forward_equal_generate(tiny):
    """The manager's forward compiled (``default_compile_level=1``: ``torch.compile(fullgraph=True)``
    over padded token counts 8 and 16, two graphs for this one small model), beams beside greedy
    and sampled requests, under a small block budget (16 blocks of 4)."""
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=16, max_batch_tokens=16, max_requests_per_batch=8,
                                  max_blocks_per_request=16, default_compile_level=1)
    manager = ContinuousBatchingManager(tiny, None, cb)
    manager.start()
    try:
        ids = {rid: manager.add_sequences(prompt, rid, max_new_tokens=limit, **settings)
               for rid, (prompt, limit, settings) in {**BEAMS, **OTHERS}.items()}
        results = {}
        for _ in range(sum(len(v) for v in ids.values())):
            out = manager.get_result(timeout=20 * WAIT_S)  # the first forwards compile
            assert out is not None, "no result came"
            results[out.request_id] = out
        assert manager.engine.compiled and len(manager.engine._forwards) <= 2
        state = manager.scheduler.state
        assert B.num_free_blocks(state.allocator) == state.allocator.num_blocks, "blocks leaked"
    finally:
        manager.stop(timeout=WAIT_S)
    assert all(out.status == RequestStatus.FINISHED for out in results.values()), [o.error for o in results.values()]
    _check_against_generate(tiny, {rid: out.generated_tokens for rid, out in results.items()},
                            {rid: out.sequence_score for rid, out in results.items()})


def test_generate_batch_returns_the_best_hypotheses_with_their_scores(tiny):
    prompt, limit = list(range(3, 14)), 8
    results = tiny.generate_batch([prompt, [5, 6, 7]], max_new_tokens=limit, num_beams=4, num_return_sequences=3,
                                  length_penalty=0.8, continuous_batching_config=ContinuousBatchingConfig(page_size=4))
    ids = list(results)
    assert ids == sequence_ids("req_0", 3) + sequence_ids("req_1", 3)
    for offset, row in ((0, prompt), (3, [5, 6, 7])):
        expected, expected_scores = _beam_generate(tiny, row, limit, num_beams=4, num_return_sequences=3,
                                                   length_penalty=0.8)
        outs = [results[rid] for rid in ids[offset:offset + 3]]
        assert all(out.status == RequestStatus.FINISHED and out.prompt_ids == row for out in outs)
        assert [out.generated_tokens for out in outs] == expected
        assert [out.sequence_score for out in outs] == pytest.approx(expected_scores, abs=1e-4)
        assert all(out.finish_reason in ("stop", "length") for out in outs)


def test_cancelling_a_beam_request_ends_every_sequence_and_frees_every_block(tiny):
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=200, max_batch_tokens=16, max_requests_per_batch=8)
    manager = ContinuousBatchingManager(tiny, None, cb)
    manager.start()
    try:
        # min_new_tokens keeps EOS out, so the search runs long enough to be cancelled.
        ids = manager.add_sequences(list(range(3, 20)), "b", max_new_tokens=150, num_beams=3, num_return_sequences=2,
                                    min_new_tokens=150)
        greedy = manager.add_request([5, 6, 7], max_new_tokens=4, do_sample=False)
        assert manager.get_result(greedy, timeout=WAIT_S).status == RequestStatus.FINISHED
        manager.cancel_request("b.1")  # any sequence id cancels the request
        outs = [manager.get_result(rid, timeout=WAIT_S) for rid in ids]
        assert [out.status for out in outs] == [RequestStatus.CANCELLED] * 2
        with manager.pause():
            state = manager.scheduler.state
            assert not state.requests and not state.groups
            B.check_invariants(state.allocator)
            assert not any(state.allocator.refs)
    finally:
        manager.stop(timeout=WAIT_S)


def test_beam_settings_continuous_batching_cannot_run_are_refused(tiny):
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=64, max_batch_tokens=16, max_requests_per_batch=4)
    manager = ContinuousBatchingManager(tiny, None, cb)
    with pytest.raises(ValueError, match="num_beams"):
        manager.add_request([5, 6, 7], max_new_tokens=4, num_beams=6)
    with pytest.raises(ValueError, match="top_logprobs"):
        manager.add_request([5, 6, 7], max_new_tokens=4, num_beams=2, top_logprobs=2)
    with pytest.raises(ValueError, match="num_return_sequences"):
        manager.add_request([5, 6, 7], max_new_tokens=4, num_beams=2, num_return_sequences=3)


def test_a_forked_table_shares_the_full_blocks_and_copies_the_partial_one():
    alloc = B.ensure_capacity(B.init_allocator(4, 4), "parent", 6)  # blocks 0 (full) and 1 (partial)
    alloc, kept, copy = B.fork(alloc, "parent", "child", 6)
    assert (kept, copy) == (6, (1, 2)) and B.block_table(alloc, "child") == (0, 2)
    assert alloc.refs[0] == 2 and alloc.refs[1] == alloc.refs[2] == 1
    # No block to spare: the child keeps the full blocks, and recomputes the rest.
    alloc = B.ensure_capacity(alloc, "other", 4)
    alloc, kept, copy = B.fork(alloc, "parent", "late", 6)
    assert (kept, copy) == (4, None) and B.block_table(alloc, "late") == (0,) and alloc.refs[0] == 3
    alloc = B.rename(alloc, {"parent": "late2", "late": "parent"})
    assert B.block_table(alloc, "late2") == (0, 1) and B.block_table(alloc, "parent") == (0,)
    B.check_invariants(alloc)
    with pytest.raises(ValueError, match="already holds blocks"):
        B.fork(alloc, "late2", "child", 6)


def test_the_server_takes_beams_from_the_openai_clients_extra_body():
    import openai

    from genfn.serve import create_app
    from test_serve import ServerThread, tiny_chat_model

    model = tiny_chat_model()
    config = ContinuousBatchingConfig(page_size=16, num_blocks=128, max_batch_tokens=64, max_requests_per_batch=8)
    manager = ContinuousBatchingManager(model, continuous_batching_config=config)
    manager.start()
    try:
        with ServerThread(create_app(manager, model.tokenizer, model_name="tiny")) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0)
            prompt = "The quick brown fox"
            beams = dict(num_beams=3, length_penalty=0.7, early_stopping=True)
            greedy = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0)
            response = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, n=2,
                                                 extra_body=beams)
            stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, n=2,
                                               extra_body=beams, stream=True)
            streamed = ["", ""]
            for chunk in stream:
                for choice in chunk.choices:
                    streamed[choice.index] += choice.text
            with pytest.raises(openai.BadRequestError, match="num_beams"):
                client.completions.create(model="tiny", prompt=prompt, max_tokens=4, n=4, extra_body={"num_beams": 2})
    finally:
        manager.stop(timeout=WAIT_S)
    expected, _ = _beam_generate(model, model.tokenizer.encode(prompt), 8, num_beams=3, num_return_sequences=2,
                                 length_penalty=0.7, early_stopping=True)
    texts = [model.tokenizer.decode(tokens, skip_special_tokens=True) for tokens in expected]
    assert [choice.text for choice in response.choices] == texts == streamed
    assert greedy.choices[0].text == model.tokenizer.decode(
        _alone(model, model.tokenizer.encode("Hello"), 6, do_sample=False), skip_special_tokens=True)


def test_genfn_batch_reads_beam_settings_and_writes_the_best_hypothesis(tmp_path, capsys):
    import json

    import genfn
    from cli_support import build_tiny_model
    from genfn import cli

    (tmp_path / "model").mkdir()
    model_dir = build_tiny_model(tmp_path / "model")
    records = [{"id": "beam", "prompt": "The capital of France is", "max_tokens": 6, "num_beams": 3,
                "length_penalty": 0.6, "early_stopping": True},
               {"id": "greedy", "prompt": "Say hi", "max_tokens": 3}]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    assert cli.main(["batch", str(source), str(out), "--model", str(model_dir), "-q"]) == 0
    rows = {row["id"]: row for row in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    model = genfn.load(model_dir)
    ids = model.tokenizer(["The capital of France is"])["input_ids"][0].tolist()
    expected, scores = _beam_generate(model, ids, 6, num_beams=3, length_penalty=0.6, early_stopping=True)
    assert rows["beam"]["tokens"] == expected[0]
    assert rows["beam"]["sequence_score"] == pytest.approx(scores[0], abs=1e-4)
    assert "sequence_score" not in rows["greedy"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi", "num_beams": 2, "early_stopping": "sometimes"}) + "\n")
    assert cli.main(["batch", str(bad), str(tmp_path / "o.jsonl"), "--model", str(model_dir), "-q"]) == 2
    assert "early_stopping" in capsys.readouterr().err


@pytest.mark.parametrize("arch,overrides", [("Qwen2ForCausalLM", {}), ("MistralForCausalLM", {"sliding_window": 8})])
def test_beams_of_other_llama_family_models_equal_generate(arch, overrides):
    model = tiny_pair(arch, seed=4, **overrides)[1]
    prompts = [list(range(3, 17)), [5, 6, 7]]
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=64, max_batch_tokens=8, max_requests_per_batch=8)
    results = model.generate_batch(prompts, max_new_tokens=9, num_beams=3, num_return_sequences=2,
                                   continuous_batching_config=cb)
    for i, prompt in enumerate(prompts):
        expected, expected_scores = _beam_generate(model, prompt, 9, num_beams=3, num_return_sequences=2)
        outs = [results[rid] for rid in sequence_ids(f"req_{i}", 2)]
        assert [out.generated_tokens for out in outs] == expected
        assert [out.sequence_score for out in outs] == pytest.approx(expected_scores, abs=1e-4)


def test_nonfinite_logits_fail_the_whole_beam_group_and_free_its_blocks(tiny, monkeypatch):
    def poisoned(state, logits):
        state, beam_idx = real_select(state, logits)
        return state.replace(nonfinite=torch.ones_like(state.nonfinite)), beam_idx

    real_select = beam_groups.select_beams
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=64, max_batch_tokens=16, max_requests_per_batch=8)
    manager = ContinuousBatchingManager(tiny, None, cb)
    manager.start()
    try:
        greedy = manager.add_request([5, 6, 7], max_new_tokens=4, do_sample=False)
        assert manager.get_result(greedy, timeout=WAIT_S).status == RequestStatus.FINISHED
        monkeypatch.setattr(beam_groups, "select_beams", poisoned)
        ids = manager.add_sequences(list(range(3, 14)), "b", max_new_tokens=8, num_beams=2, num_return_sequences=2)
        outs = [manager.get_result(rid, timeout=WAIT_S) for rid in ids]
        assert all(out.status == RequestStatus.FAILED and "NonFiniteLogitsError" in out.error for out in outs)
        with manager.pause():
            state = manager.scheduler.state
            assert not state.requests and not state.groups and not any(state.allocator.refs)
    finally:
        manager.stop(timeout=WAIT_S)
