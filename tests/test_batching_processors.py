"""Watermarking (SynthID's state included), classifier-free guidance and token healing inside
continuous batching: each request, in a batch mixed with plain greedy and sampled requests,
chunked and preempted by a tiny block budget, equals ``generate`` with the same settings and key,
and every block is free at the end. Every wait has a timeout."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_pair
from genfn.batching.manager import ContinuousBatchingManager
from genfn.batching.requests import RequestStatus
from genfn.config import SynthIDTextWatermarkingConfig, WatermarkingConfig
from genfn.config.batching import ContinuousBatchingConfig
from genfn.generation import generate
from batching_support import run_engine, run_requests
from genfn.batching import blocks as B
from genfn.batching.guidance_groups import partner_id
from genfn.batching.requests import sequence_ids

WAIT_S = 60

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# 12 blocks of 4 tokens, 12 tokens per forward: prompts are chunked, requests preempted.
TIGHT = dict(page_size=4, num_blocks=12, max_batch_tokens=12, max_requests_per_batch=4)
SYNTHID_A = SynthIDTextWatermarkingConfig(ngram_len=3, keys=[654, 400, 836, 123], context_history_size=64)
SYNTHID_B = SynthIDTextWatermarkingConfig(ngram_len=2, keys=[11, 22, 33], context_history_size=64)


@pytest.fixture(scope="module")
def llama():
    return tiny_pair("LlamaForCausalLM", seed=4)[1]


def _run(model, requests, cb=None, chunked_prefill=True):
    return run_requests(model, requests, ContinuousBatchingConfig(**(cb or TIGHT)), chunked_prefill)


def _alone(model, prompt, limit, settings, **extra):
    """generate's tokens for one request (the key of a seeded request is its seed)."""
    settings = dict(settings)
    seed = settings.pop("seed", None)
    if seed is not None:
        settings["key"] = seed
    negative = settings.pop("negative_prompt_ids", None)
    if negative is not None:
        settings["negative_prompt_ids"] = torch.tensor([negative])
    out = generate(model, torch.tensor([prompt]), max_new_tokens=limit, **settings, **extra)
    tokens = out[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def _mixed(settings_list, seed=11, max_prompt=20):
    """Requests with random prompts: each setting, interleaved with plain greedy and sampled ones."""
    rng = random.Random(seed)
    plain = [{"do_sample": False}, {"do_sample": True, "temperature": 0.9, "top_k": 30, "seed": 900}]
    requests = []
    for i, settings in enumerate(settings_list):
        for s in (settings, plain[i % 2]):
            prompt = [rng.randrange(3, 97) for _ in range(rng.randint(2, max_prompt))]
            requests.append((prompt, rng.randint(6, 12), s))
    return requests


def _check(model, requests, outputs):
    for i, (out, (prompt, limit, settings)) in enumerate(zip(outputs, requests)):
        assert out.status == RequestStatus.FINISHED, out.error
        assert out.generated_tokens == _alone(model, prompt, limit, settings), f"request {i} ({settings})"


def test_watermarked_requests_equal_generate_in_a_preempted_batch(llama):
    settings = [
        {"do_sample": True, "seed": 3, "watermarking_config": WatermarkingConfig(bias=6.0)},
        {"do_sample": False, "watermarking_config": WatermarkingConfig(bias=4.0)},  # greedy: bias decides
        # another green-list key and scheme in the same batch (they cannot merge into one processor)
        {"do_sample": True, "seed": 4, "watermarking_config": WatermarkingConfig(bias=5.0, hashing_key=7,
                                                                                  seeding_scheme="selfhash",
                                                                                  context_width=2)},
        {"do_sample": True, "seed": 5, "top_k": 40, "watermarking_config": SYNTHID_A},
        {"do_sample": True, "seed": 6, "watermarking_config": SYNTHID_B},  # another SynthID in the same batch
        {"do_sample": True, "seed": 7, "watermarking_config": SYNTHID_A},  # shares A's group
        {"do_sample": False, "watermarking_config": SYNTHID_A, "renormalize_logits": True},
    ]
    requests = _mixed(settings)
    outputs, stats = _run(llama, requests)
    assert stats["preempted"] > 0, dict(stats)
    _check(llama, requests, outputs)


def test_synthid_state_is_what_generate_carries(llama):
    """SynthID's processor reweights differently once its context history holds a repeated context:
    with a one-token n-gram context and a long output, the state decides the tokens, and a fresh
    state every step would differ from generate."""
    config = SynthIDTextWatermarkingConfig(ngram_len=2, keys=[5, 9, 13, 17], context_history_size=8)
    prompt = [5, 17, 33, 8]
    settings = {"do_sample": True, "seed": 21, "temperature": 2.0, "watermarking_config": config}
    requests = [(prompt, 24, settings), ([40, 41], 10, {"do_sample": False})]
    outputs, _ = _run(llama, requests)
    _check(llama, requests, outputs)
    unmarked = _alone(llama, prompt, 24, {"do_sample": True, "seed": 21, "temperature": 2.0})
    assert outputs[0].generated_tokens != unmarked  # the watermark did change the tokens


def test_guided_requests_equal_generate_in_a_preempted_batch(llama):
    settings = [
        {"do_sample": False, "guidance_scale": 1.5},  # unconditional prompt: the prompt's last token
        {"do_sample": True, "seed": 8, "guidance_scale": 2.0, "negative_prompt_ids": [7, 8, 9, 10, 11]},
        {"do_sample": False, "guidance_scale": 3.0, "negative_prompt_ids": [50, 51], "repetition_penalty": 1.3},
        {"do_sample": True, "seed": 9, "guidance_scale": 1.5, "watermarking_config": SYNTHID_B},
    ]
    requests = _mixed(settings, seed=12)
    outputs, stats = _run(llama, requests)
    assert stats["preempted"] > 0, dict(stats)
    _check(llama, requests, outputs)
    plain = _alone(llama, requests[0][0], requests[0][1], {"do_sample": False})
    assert outputs[0].generated_tokens != plain  # guidance changed the greedy tokens


def test_guided_sequences_each_equal_generate(llama):
    prompt = [9, 30, 31, 32, 60]
    settings = {"do_sample": True, "seed": 4, "guidance_scale": 2.0, "num_return_sequences": 3}
    manager = ContinuousBatchingManager(llama, None, ContinuousBatchingConfig(**TIGHT), chunked_prefill=True)
    manager.start()
    try:
        ids = manager.add_sequences(prompt, max_new_tokens=8, **settings)
        results = {}
        while len(results) < len(ids):
            out = manager.get_result(timeout=WAIT_S)
            assert out is not None, "no result came"
            results[out.request_id] = out
    finally:
        manager.stop(timeout=WAIT_S)
    expected = generate(llama, torch.tensor([prompt]), max_new_tokens=8, key=4, do_sample=True, guidance_scale=2.0,
                        num_return_sequences=3)
    for j, rid in enumerate(ids):
        tokens = expected[j, len(prompt):].tolist()
        if 2 in tokens:
            tokens = tokens[:tokens.index(2) + 1]
        assert results[rid].generated_tokens == tokens, f"sequence {j}"


GUIDED = {  # request id -> (prompt, max_new_tokens, settings)
    "negative": ([9, 30, 31, 32, 60, 61, 62], 8, dict(do_sample=False, guidance_scale=3.0,
                                                    negative_prompt_ids=[[50, 51, 52, 53, 54, 55]])),
    "last-token": (list(range(10, 25)), 8, dict(do_sample=True, seed=8, guidance_scale=2.0, top_k=30)),
    "two": ([9, 30, 31, 32, 60], 6, dict(do_sample=True, seed=4, guidance_scale=2.0, num_return_sequences=2)),
    "plain": ([5, 6, 7, 8], 6, dict(do_sample=False)),
    "sampled": (list(range(40, 52)), 7, dict(do_sample=True, seed=5)),
}


@pytest.mark.parametrize("num_blocks,max_batch_tokens", [(64, 64), (12, 8)], ids=["roomy", "tiny-budget-chunked"])
def test_the_unconditional_branch_is_a_row_with_blocks_in_the_budget(llama, num_blocks, max_batch_tokens):
    """A guided request's unconditional request holds blocks of the paged cache (the allocator
    lists its table, ``generate``'s unconditional input then the generated tokens), decodes in the
    same forwards as its request, and is preempted with it; every request equals generate."""
    seen_tables = {}

    def on_step(state, outcome):
        sampled = {c.request_id for c in outcome.batch.chunks if c.samples}
        for rid in ("negative", "last-token", "two", "two.1"):
            assert (rid in sampled) == (partner_id(rid) in sampled), rid  # one forward, or neither
            table = B.block_table(state.allocator, partner_id(rid))
            seen_tables[rid] = max(seen_tables.get(rid, 0), len(table))

    ended, seen = run_engine(llama, GUIDED, num_blocks, max_batch_tokens, 8, on_step=on_step)
    for rid, (prompt, limit, settings) in GUIDED.items():
        settings = dict(settings)
        negative = settings.pop("negative_prompt_ids", None)
        count = settings.pop("num_return_sequences", 1)
        extra = {} if negative is None else {"negative_prompt_ids": torch.tensor(negative)}
        expected = generate(llama, torch.tensor([prompt]), max_new_tokens=limit, num_return_sequences=count,
                            **({"key": settings.pop("seed")} if "seed" in settings else {}), **settings, **extra)
        for j, sid in enumerate(sequence_ids(rid, count)):
            tokens = expected[j, len(prompt):].tolist()
            eos = llama.generation_config.eos_token_id
            assert list(ended[sid].generated_ids) == (tokens[:tokens.index(eos) + 1] if eos in tokens else tokens), sid
    # The unconditional requests held their own blocks, 4 tokens a block: the negative prompt (6
    # tokens) or the prompt's last token, then the generated tokens computed before the last step.
    for rid, unconditional in (("negative", 6), ("last-token", 1), ("two", 1), ("two.1", 1)):
        computed = unconditional + len(ended[rid].generated_ids) - 2
        assert seen_tables[rid] >= -(-computed // 4) and seen_tables[rid] > 0, rid
    assert not any(isinstance(r, tuple) and r[1] == "unconditional" for r in ended)  # never reported
    if num_blocks < 30:
        assert partner_id("negative") in seen["preempted"] or partner_id("last-token") in seen["preempted"]


def test_without_chunked_prefill_the_settings_still_equal_generate(llama):
    settings = [{"do_sample": True, "seed": 2, "watermarking_config": SYNTHID_A},
                {"do_sample": False, "guidance_scale": 2.5}]
    requests = _mixed(settings, seed=13, max_prompt=10)
    cb = dict(TIGHT, num_blocks=32, max_batch_tokens=32)
    outputs, _ = _run(llama, requests, cb, chunked_prefill=False)
    _check(llama, requests, outputs)


def test_token_healing_runs_the_healed_prompt_as_generate():
    from hf_tokenizer import hf_smollm2_tokenizer

    tokenizer = hf_smollm2_tokenizer()
    model = tiny_pair("LlamaForCausalLM", seed=6, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)[1]
    # The first prompt splits "brown" into "br" + "own": healing re-tokenizes it (a new prompt).
    split = tokenizer("The quick br")["input_ids"] + tokenizer("own fox jum", add_special_tokens=False)["input_ids"]
    prompts = [split, tokenizer('The link is <a href="http:')["input_ids"], tokenizer("x = [1, 2,")["input_ids"]]
    requests = []
    for i, prompt in enumerate(prompts):
        requests.append((prompt, 5, {"token_healing": True, "tokenizer": tokenizer, "do_sample": bool(i % 2),
                                     "seed": 30 + i}))
        requests.append((prompt, 5, {"do_sample": False}))
    outputs, _ = _run(model, requests, dict(TIGHT, num_blocks=24))
    for i, (out, (prompt, limit, settings)) in enumerate(zip(outputs, requests)):
        assert out.status == RequestStatus.FINISHED, out.error
        settings = dict(settings)
        seed = settings.pop("seed", None)
        if settings.get("do_sample"):
            settings["key"] = seed
        expected = generate(model, torch.tensor([prompt]), max_new_tokens=limit, **settings)[0].tolist()
        got = list(out.prompt_ids) + list(out.generated_tokens)
        assert got == expected[:len(got)] and len(got) >= len(expected) - limit, f"request {i}"
        if i == 0:
            assert list(out.prompt_ids) != prompt  # the healed prompt is the one that ran


def test_contrastive_search_is_still_refused_naming_the_setting(llama):
    manager = ContinuousBatchingManager(llama, None, ContinuousBatchingConfig(**TIGHT))
    with pytest.raises(ValueError, match="penalty_alpha=0.6"):
        manager.add_request([5, 6, 7], max_new_tokens=2, penalty_alpha=0.6, top_k=4)


def test_the_server_runs_these_settings_through_the_openai_client():
    """Through the official client's extra_body, each setting gives generate's tokens; a negative
    prompt without guidance is refused naming the field."""
    import openai

    from genfn.serve import create_app
    from test_serve import ServerThread, tiny_chat_model

    model = tiny_chat_model()
    tokenizer = model.tokenizer
    manager = ContinuousBatchingManager(model, None, ContinuousBatchingConfig(page_size=16, num_blocks=32))
    manager.start()
    try:
        with ServerThread(create_app(manager, tokenizer, model_name="tiny")) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0)
            prompt = tokenizer.encode("The link is <a href=\"http:")
            synthid = {"ngram_len": 2, "keys": [3, 5, 7], "context_history_size": 16}
            extras = [{"guidance_scale": 2.0, "negative_prompt_ids": [5, 6, 7]},
                      {"watermarking_config": synthid},
                      {"watermarking_config": {"bias": 5.0}},
                      {"token_healing": True}]
            for extra in extras:
                response = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                                     extra_body=extra)
                settings = dict(extra)
                if "negative_prompt_ids" in settings:
                    settings["negative_prompt_ids"] = torch.tensor([settings["negative_prompt_ids"]])
                if "watermarking_config" in settings:
                    from genfn.config.watermarking import watermarking_config_from_dict

                    settings["watermarking_config"] = watermarking_config_from_dict(settings["watermarking_config"])
                expected = generate(model, torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                                    tokenizer=tokenizer, **settings)[0].tolist()
                healed_len = len(expected) - response.usage.completion_tokens
                assert response.choices[0].text == tokenizer.decode(expected[healed_len:]), extra
            with pytest.raises(openai.BadRequestError, match="negative_prompt_ids"):
                client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                          extra_body={"negative_prompt_ids": [5]})
    finally:
        manager.stop(timeout=WAIT_S)


def test_genfn_batch_runs_these_settings_from_the_file(tmp_path, capsys):
    import json

    import genfn
    from cli_support import CHAT_TEMPLATE, build_tiny_model
    from genfn import cli

    (tmp_path / "model").mkdir()
    model_dir = build_tiny_model(tmp_path / "model", chat_template=CHAT_TEMPLATE)
    model = genfn.load(model_dir)
    lines = [{"id": "cfg", "prompt": "Say hi to", "max_tokens": 5, "guidance_scale": 2.0,
              "negative_prompt_ids": [5, 6]},
             {"id": "synthid", "prompt": "Say hi to", "max_tokens": 5, "temperature": 0.9, "seed": 3,
              "watermarking_config": {"ngram_len": 2, "keys": [3, 5, 7]}},
             {"id": "plain", "prompt": "Once", "max_tokens": 5}]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert cli.main(["batch", str(source), str(out), "--model", str(model_dir), "-q"]) == 0
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    from genfn.config.watermarking import watermarking_config_from_dict

    expected = {"cfg": dict(guidance_scale=2.0, negative_prompt_ids=torch.tensor([[5, 6]])),
                "synthid": dict(do_sample=True, temperature=0.9, key=3,
                                watermarking_config=watermarking_config_from_dict(lines[1]["watermarking_config"])),
                "plain": {}}
    for line in lines:
        ids = model.tokenizer([line["prompt"]])["input_ids"]
        tokens = generate(model, ids, max_new_tokens=5, **expected[line["id"]])[0, ids.shape[1]:].tolist()
        assert rows[line["id"]]["tokens"] == tokens[:len(rows[line["id"]]["tokens"])], line["id"]
    source.write_text('{"prompt": "hi", "negative_prompt_ids": [4]}\n')
    assert cli.main(["batch", str(source), str(tmp_path / "bad.jsonl"), "-q"]) == 2
    assert "negative_prompt_ids" in capsys.readouterr().err


def test_rows_with_different_watermarks_merge_into_one_batch_chain(llama):
    """Two green-list keys and schemes and two SynthID keys in one batch chain: each row's scores
    are what its own chain gives alone (merging them as one processor would refuse the batch)."""
    from genfn.batching.row_state import merge_request_chains
    from genfn.batching.settings import request_settings
    from genfn.processors.context import LogitsContext

    configs = [WatermarkingConfig(bias=2.0), WatermarkingConfig(bias=3.0, hashing_key=7, seeding_scheme="selfhash"),
               SYNTHID_A, SYNTHID_B, None]
    chains = [request_settings(llama, [5, 6, 7], None, {"watermarking_config": c, "do_sample": True, "top_k": 20},
                               max_new_tokens=4).settings.chain for c in configs]
    merged = merge_request_chains(chains, [True] * len(chains), num_rows=6)
    torch.manual_seed(0)
    logits = torch.randn(6, llama.vocab_size)
    tokens = torch.randint(3, 97, (6, 9))
    ctx = LogitsContext(tokens=tokens, cur_len=torch.full((6,), 9), prompt_len=torch.full((6,), 3))
    scores, _ = merged.apply(logits, ctx, merged.init_state(6))
    for row, chain in enumerate(chains):
        one = LogitsContext(tokens=tokens[row:row + 1], cur_len=torch.tensor([9]), prompt_len=torch.tensor([3]))
        if chain.stateful:
            alone, _ = chain.apply(logits[row:row + 1], one, chain.init_state(1))
        else:
            alone = chain(logits[row:row + 1], one)
        assert torch.equal(scores[row], alone[0]), configs[row]


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel"])
def test_other_families_run_guidance_and_watermarks_as_generate(arch):
    from test_batching_families import FAMILIES, _wrapped_gpt2

    model = _wrapped_gpt2() if arch == "GPT2LMHeadModel" else tiny_pair(arch, seed=4, **FAMILIES[arch])[1]
    settings = [{"do_sample": False, "guidance_scale": 2.0, "negative_prompt_ids": [7, 8, 9]},
                {"do_sample": True, "seed": 5, "watermarking_config": SYNTHID_A},
                {"do_sample": True, "seed": 6, "watermarking_config": WatermarkingConfig(bias=5.0)}]
    requests = _mixed(settings, seed=14)
    outputs, _ = _run(model, requests)
    _check(model, requests, outputs)
