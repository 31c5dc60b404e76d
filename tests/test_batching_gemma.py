"""Continuous batching for Gemma 2 / Gemma 3 (``genfn.models.gemma_packed``) and for LongRoPE
models (Phi-3 with rope_type 'longrope', factors picked per request): greedy requests equal
``generate`` request by request and seeded sampled requests equal ``generate`` with the same key,
in batches that chunk prompts (some longer than Gemma's sliding window, some crossing LongRoPE's
original context) and are preempted by a tiny block budget. Every wait has a timeout."""

from __future__ import annotations

import random

import pytest
import torch

from genfn.batching.requests import RequestStatus
from genfn.config.batching import ContinuousBatchingConfig
from genfn.generation import generate
from genfn.models.registry import packed_forward
from batching_support import run_requests

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# A window of 4 on alternate layers; Gemma 2 soft-caps scores and logits with small caps (so they
# bite); Gemma 3 has q/k norms and a linearly scaled global base of its own.
_GEMMA = dict(num_hidden_layers=4, head_dim=16, sliding_window=4, query_pre_attn_scalar=24)
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
             "long_factor": [2.0 + 0.3 * i for i in range(8)]}
MODELS = {
    "gemma2": ("Gemma2ForCausalLM", dict(_GEMMA, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3ForCausalLM", dict(_GEMMA, sliding_window_pattern=2, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # Original context 12: some prompts lie past it (long factors from their prefill on), the
    # others cross it while they decode (the cached prompt stays on the short factors).
    "phi3_longrope": ("Phi3ForCausalLM", dict(max_position_embeddings=128, original_max_position_embeddings=12,
                                              rope_parameters=_LONGROPE)),
}


def _pair(arch, overrides):
    from genfn.models.model import from_hf_state_dict

    config_class = {"Gemma2ForCausalLM": transformers.Gemma2Config,
                    "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
                    "Phi3ForCausalLM": transformers.Phi3Config}[arch]
    torch.manual_seed(0)
    settings = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                    initializer_range=0.2)  # sharp attention: a wrong rotation or mask changes tokens
    config = config_class(**{**settings, **overrides})
    hf = getattr(transformers, arch)(config).eval()
    config_dict = config.to_dict()
    config_dict["architectures"] = [arch]
    return from_hf_state_dict(config_dict, hf.state_dict())


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return _pair(*MODELS[request.param])


def _alone(model, prompt, max_new_tokens, **settings):
    out = generate(model, torch.tensor([prompt]), max_new_tokens=max_new_tokens, disable_compile=True, **settings)
    tokens = out[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def _requests(seed=11):
    rng = random.Random(seed)
    requests = []
    for i in range(10):
        # 2 to 20 tokens: past the window of 4, and on both sides of LongRoPE's original context of 12.
        prompt = [rng.randrange(3, 97) for _ in range(rng.randint(2, 20))]
        settings = {"do_sample": False} if i % 3 else {"do_sample": True, "temperature": 0.8, "top_k": 20,
                                                        "seed": 500 + i}
        requests.append((prompt, rng.randint(6, 12), settings))
    return requests


def test_generate_batch_equals_generate_request_by_request(model):
    assert packed_forward(model) is not None
    requests = _requests()
    assert any(len(p) > 12 for p, _, _ in requests) and any(len(p) + n > 12 >= len(p) for p, n, _ in requests)
    # 10 blocks of 4 tokens and 8 tokens per forward: prompts are chunked, requests preempted.
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=10, max_batch_tokens=8, max_requests_per_batch=4)
    outputs, stats = run_requests(model, requests, cb)
    assert stats["preempted"] > 0, dict(stats)
    for i, (out, (prompt, limit, settings)) in enumerate(zip(outputs, requests)):
        assert out.status == RequestStatus.FINISHED, out.error
        settings = dict(settings)
        seed = settings.pop("seed", None)
        expected = _alone(model, prompt, limit, key=seed, **settings) if seed is not None else \
            _alone(model, prompt, limit, **settings)
        assert out.generated_tokens == expected, f"request {i} ({settings})"


def test_gemma2_soft_capped_scores_take_the_native_paged_op():
    """Gemma 2's decode rows (and short prefill chunks) attend through ``paged_query_attention``
    with the cap (once they took the reference attention), and its greedy tokens stay generate's."""
    from genfn import kernels
    from batching_support import drive

    if not kernels.decode_linear_available():
        pytest.skip(f"native kernels unavailable: {kernels.kernel_status()}")
    model = _pair(*MODELS["gemma2"])
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    with torch.profiler.profile() as profile:
        tokens, *_ = drive(model, [(p, 8, {"do_sample": False}) for p in prompts])
    calls = sum(e.count for e in profile.key_averages() if e.key == "genfn_kernels::paged_query_attention")
    assert calls >= model.spec.num_layers
    assert tokens == [_alone(model, p, 8, do_sample=False) for p in prompts]


def test_longrope_prompts_share_cached_blocks_only_on_their_side_of_the_original_context():
    """Prefix caching on, one prompt at a time so each finds the previous ones' blocks cached: the
    prompt of 18 tokens (past the original context of 12, keys on the long factors) must not take
    the blocks of the 10-token prompt it starts with (short factors); the 11-token prompt takes the
    10-token one's 2 blocks, the 17-token one the 18-token one's 4. Tokens equal ``generate``'s."""
    from batching_support import WAIT_S
    from genfn.batching import ContinuousBatchingManager

    model = _pair(*MODELS["phi3_longrope"])
    rng = random.Random(5)
    shared = [rng.randrange(3, 97) for _ in range(18)]
    prompts = [shared[:10], shared[:18], shared[:11], shared[:17]]
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=40, max_batch_tokens=16, max_requests_per_batch=4)
    manager = ContinuousBatchingManager(model, None, cb)
    manager.start()
    try:
        outputs = []
        for prompt in prompts:
            manager.add_request(prompt, max_new_tokens=6, do_sample=False)
            outputs.append(manager.get_result(timeout=WAIT_S))
            assert outputs[-1] is not None, "no result came"
        reused = manager.stats["reused_tokens"]
    finally:
        manager.stop(timeout=WAIT_S)
    assert reused == 8 + 16  # none for the long prompt after the short one
    for out, prompt in zip(outputs, prompts):
        assert out.generated_tokens == _alone(model, prompt, 6, do_sample=False), len(prompt)
