"""Prompt-lookup speculation inside continuous batching (``genfn.batching.speculation``).

A request with ``prompt_lookup_num_tokens`` carries drafts copied from its own tokens in its row
of the packed forward; verification keeps what the model agrees with. The engine step runs here
as a function of the scheduler's state (``engine_step``), so each step's outcome is visible:
greedy requests give the tokens they give without speculation (and ``generate``'s) while steps
keep several tokens, on a native Llama and on a wrapped transformers GPT-2, with chunked
prefill, preemption by a tiny block budget and shared prefixes; seeded sampled requests give
plain sampling's tokens; EOS, ``max_new_tokens`` and stop strings reached inside a kept run of
drafts end the request where plain decoding ends it; the allocator's invariants hold after
every step and every block comes back. Every wait has a timeout."""

from __future__ import annotations

import random

import pytest
import torch

from batching_support import drive
from conftest import tiny_pair
from genfn.batching import scheduling as S
from genfn.batching.manager import ContinuousBatchingManager
from genfn.batching.requests import RequestStatus, make_request
from genfn.batching.settings import request_settings
from genfn.config.batching import ContinuousBatchingConfig
from genfn.generation import generate

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

WAIT_S = 60
EOS = 2


def _wrapped_gpt2():
    import transformers

    import genfn

    config = transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=1,
                                     eos_token_id=EOS, initializer_range=0.3)
    torch.manual_seed(4)
    return genfn.from_module(transformers.GPT2LMHeadModel(config).eval())


@pytest.fixture(scope="module")
def llama():
    return tiny_pair("LlamaForCausalLM", seed=4)[1]


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "GPT2LMHeadModel"])
def family_model(request, llama):
    return llama if request.param == "LlamaForCausalLM" else _wrapped_gpt2()


def _alone(model, prompt, limit, **settings):
    tokens = generate(model, torch.tensor([prompt]), max_new_tokens=limit, **settings)[0, len(prompt):].tolist()
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


def _copy_prompts(seed: int, count: int, system_len: int = 9):
    """Prompts that repeat themselves (what prompt lookup drafts from), half after a shared system prefix."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 97) for _ in range(system_len)]
    prompts = []
    for i in range(count):
        piece = [rng.randrange(3, 97) for _ in range(rng.randint(3, 7))]
        prompt = piece * 3
        prompts.append(system + prompt if i % 2 else prompt)
    return prompts


def test_prompt_lookup_greedy_equals_plain_decoding_with_chunking_preemption_and_sharing(family_model):
    model = family_model
    prompts = _copy_prompts(7, 8)
    limits = [random.Random(i).randint(6, 24) for i in range(len(prompts))]
    # Every other request speculates: plain and speculative rows share each batch.
    requests = [(p, n, {"do_sample": False, **({"prompt_lookup_num_tokens": 4} if i % 2 == 0 else {})})
                for i, (p, n) in enumerate(zip(prompts, limits))]
    plain = [(p, n, {"do_sample": False}) for p, n in zip(prompts, limits)]
    # 4-token blocks, 16 blocks and 12 tokens per forward: prompts are chunked, requests preempted.
    sizes = dict(blocks=16, size=4, budget=12, rows=4, width=16)
    tokens, most, _, preempted, reused = drive(model, requests, **sizes)
    reference, _, _, _, _ = drive(model, plain, **sizes)
    assert tokens == reference
    assert most > 1, "no step kept a draft"
    assert preempted > 0 and reused > 0, (preempted, reused)
    for out, prompt, limit in zip(tokens, prompts, limits):
        assert out == _alone(model, prompt, limit, do_sample=False)


def test_sampled_requests_with_a_key_give_plain_samplings_tokens(llama):
    prompts = _copy_prompts(3, 6)
    settings = [{"do_sample": True, "temperature": 0.3, "top_k": 8, "repetition_penalty": 1.1, "seed": 40 + i}
                for i in range(len(prompts))]
    speculative = [(p, 20, {**s, "prompt_lookup_num_tokens": 3}) for p, s in zip(prompts, settings)]
    tokens, most, _, _, _ = drive(llama, speculative)
    assert most > 1
    for out, prompt, s in zip(tokens, prompts, settings):
        s = dict(s)
        key = s.pop("seed")
        assert out == _alone(llama, prompt, 20, key=key, **s)


def test_max_new_tokens_inside_a_kept_run_ends_where_plain_decoding_ends(llama):
    prompt = _copy_prompts(4, 4)[3]  # greedy falls into a 4-token cycle: runs of kept drafts
    requests = [(prompt, limit, {"do_sample": False, "prompt_lookup_num_tokens": 6}) for limit in range(1, 13)]
    tokens, most, _, _, _ = drive(llama, requests, blocks=64, budget=64, rows=12)
    full = _alone(llama, prompt, 12, do_sample=False)
    assert most > 2
    for limit, out in zip(range(1, 13), tokens):
        assert out == full[:limit]


def _long_run(model):
    """A prompt whose greedy continuation repeats an 8-token cycle (drafts kept in runs), and that continuation."""
    prompt = _copy_prompts(11, 4)[3]
    generated = _alone(model, prompt, 24, do_sample=False)
    assert EOS not in generated and len(set(generated)) < len(generated) // 2, generated
    return prompt, generated


def test_eos_inside_a_kept_run_ends_where_plain_decoding_ends(llama):
    prompt, generated = _long_run(llama)
    # A token first seen late in a repeating continuation: speculation keeps runs around it.
    late = [i for i, token in enumerate(generated) if i >= 6 and token not in generated[:i]]
    index = late[0] if late else len(generated) - 1
    eos = generated[index]
    settings = {"do_sample": False, "eos_token_id": eos}
    tokens, _, _, _, _ = drive(llama, [(prompt, 24, {**settings, "prompt_lookup_num_tokens": 5})])
    plain, _, _, _, _ = drive(llama, [(prompt, 24, settings)])
    assert tokens == plain and tokens[0] == generated[:generated.index(eos) + 1]


class _ToyTokenizer:
    """Tokens spell themselves: 'a'..'d', then 'aa'.. and 'aaa'.., over the tiny model's 97 ids."""

    def __init__(self, vocab_size=97):
        import itertools

        words = ["".join(p) for n in (1, 2, 3) for p in itertools.product("abcd", repeat=n)]
        self.vocab = {w: i for i, w in enumerate(words[:vocab_size])}
        self.words = {i: w for w, i in self.vocab.items()}

    def get_vocab(self):
        return dict(self.vocab)


def test_a_stop_string_inside_a_kept_run_ends_where_plain_decoding_ends(llama):
    toy = _ToyTokenizer()
    prompt, generated = _long_run(llama)
    speculative, most, _, _, _ = drive(llama, [(prompt, 24, {"do_sample": False, "prompt_lookup_num_tokens": 5})])
    assert speculative[0] == generated and most > 2
    for index in (len(generated) // 2, len(generated) - 3):
        stop = toy.words[generated[index]]
        settings = {"do_sample": False, "stop_strings": [stop], "tokenizer": toy}
        tokens, _, _, _, _ = drive(llama, [(prompt, 24, {**settings, "prompt_lookup_num_tokens": 5})])
        plain, _, _, _, _ = drive(llama, [(prompt, 24, settings)])
        assert tokens == plain and len(tokens[0]) <= index + 1, stop


def test_the_manager_reports_one_logprob_per_token_and_counts_every_token(llama):
    prompts = _copy_prompts(9, 4)
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=64, max_batch_tokens=32, max_requests_per_batch=4)

    def run(**extra):
        manager = ContinuousBatchingManager(llama, None, cb)
        manager.start()
        try:
            ids = [manager.add_request(p, max_new_tokens=16, do_sample=False, top_logprobs=2, **extra)
                   for p in prompts]
            outs = {}
            for _ in ids:
                out = manager.get_result(timeout=WAIT_S)
                assert out is not None, "no result came"
                outs[out.request_id] = out
            return [outs[i] for i in ids], manager.metrics()
        finally:
            manager.stop(timeout=WAIT_S)

    plain, _ = run()
    speculative, metrics = run(prompt_lookup_num_tokens=4)
    for a, b in zip(plain, speculative):
        assert b.status == RequestStatus.FINISHED and b.generated_tokens == a.generated_tokens
        assert len(b.logprobs) == len(b.top_logprobs) == len(b.generated_tokens)
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
        assert [[t for t, _ in pairs] for pairs in b.top_logprobs] == [[t for t, _ in pairs] for pairs in a.top_logprobs]
    assert metrics.generation_tokens_total == sum(len(b.generated_tokens) for b in speculative)


def test_mtp_and_lookup_with_guidance_are_refused_by_name(llama):
    # Draft models, early exit and lookup under a grammar run (tests/test_batching_draft.py).
    with pytest.raises(ValueError, match="use_mtp"):
        request_settings(llama, [5, 6, 7], None, {"use_mtp": True}, max_new_tokens=4)
    with pytest.raises(ValueError, match="guidance_scale"):
        request_settings(llama, [5, 6, 7], None, {"prompt_lookup_num_tokens": 3, "guidance_scale": 2.0},
                         max_new_tokens=4)


def test_genfn_batch_reads_prompt_lookup_num_tokens_and_checks_it():
    from genfn.cli.batch import read_requests
    from genfn.cli.common import UserError

    (request,) = read_requests('{"prompt": "copy this", "prompt_lookup_num_tokens": 4}', default_max=8)
    assert request.settings["prompt_lookup_num_tokens"] == 4 and request.settings["do_sample"] is False
    with pytest.raises(UserError, match="line 1"):
        read_requests('{"prompt": "copy this", "prompt_lookup_num_tokens": 0}', default_max=8)


@pytest.fixture(scope="module")
def served():
    from genfn.serve import create_app
    from test_serve import MODEL, ServerThread, tiny_chat_model

    openai = pytest.importorskip("openai")
    model = tiny_chat_model()
    config = ContinuousBatchingConfig(page_size=16, num_blocks=256, max_batch_tokens=128, max_requests_per_batch=8)
    manager = ContinuousBatchingManager(model, continuous_batching_config=config)
    manager.start()
    app = create_app(manager, model.tokenizer, model_name=MODEL)
    try:
        with ServerThread(app) as running:
            yield openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0), MODEL
    finally:
        manager.stop(block=True, timeout=WAIT_S)


def test_the_server_takes_prompt_lookup_through_extra_body_with_the_openai_client(served):
    import openai

    client, model_name = served
    prompt = "copy: the cat sat on the mat. the cat sat on the mat. the cat sat on"
    plain = client.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0)
    for k in (1, 5):
        speculative = client.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0,
                                                extra_body={"prompt_lookup_num_tokens": k})
        assert speculative.choices[0].text == plain.choices[0].text
        assert speculative.usage.completion_tokens == plain.usage.completion_tokens
    chat = dict(model=model_name, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0)
    assert (client.chat.completions.create(**chat, extra_body={"prompt_lookup_num_tokens": 3}).choices[0].message.content
            == client.chat.completions.create(**chat).choices[0].message.content)
    with pytest.raises(openai.BadRequestError, match="prompt_lookup_num_tokens"):
        client.completions.create(model=model_name, prompt=prompt, max_tokens=4,
                                  extra_body={"prompt_lookup_num_tokens": 0})


def test_the_forward_gives_logits_at_every_drafted_position_planned_or_padded(llama):
    """A drafted chunk's extra ``logits_index`` entries give the dense model's logits at the last
    token and every draft: through the eager planned forward (exact ``E``) and the unplanned one
    the compiled engine runs (``E`` padded to a static size)."""
    from genfn.batching import speculation as SP
    from genfn.batching.engine import packed_plan
    from genfn.batching.inputs import build_batch_inputs
    from genfn.models import packed

    prompt = [5, 6, 7, 8, 9] * 3
    size, blocks = 4, 16
    r = request_settings(llama, prompt, None, {"prompt_lookup_num_tokens": 3}, max_new_tokens=8)
    state = S.add_request(S.init_scheduler(blocks, size), make_request(0, prompt, 8, [EOS], {"genfn": r.settings}))
    state, batch = S.schedule(state, 64)
    state, batch = SP.add_drafts(state, batch, token_budget=64, max_len=64)
    (chunk,) = batch.chunks
    assert chunk.num_drafts == 3 and chunk.token_ids[-3:] == (5, 6, 7)
    tokens = list(chunk.token_ids)
    dense, _ = llama.apply(torch.tensor([tokens]), torch.arange(len(tokens)).unsqueeze(0),
                           llama.init_cache(1, len(tokens) + 1))
    expected = dense[0, -4:]  # the last prompt token, then the drafts
    planned_inputs = build_batch_inputs(state.allocator, batch, num_rows=2)
    plan = packed_plan(batch, size, num_rows=2)
    planned, _ = packed.apply_packed(llama.spec, packed.pack_params(llama.params), planned_inputs,
                                     packed.init_packed_cache(llama.spec, blocks, size), plan)
    padded_inputs = build_batch_inputs(state.allocator, batch, num_tokens=32, num_rows=2, num_extra_logits=8)
    padded, _ = packed.apply_packed(llama.spec, llama.params, padded_inputs,
                                    packed.init_packed_cache(llama.spec, blocks, size))
    for logits in (planned, padded):
        got = torch.cat([logits[2:5], logits[0:1]])  # extras (last token, drafts 1-2), then the row's own
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
