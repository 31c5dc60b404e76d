"""The batch-invariant mode (``genfn.deterministic``) on the families beyond Llama's plain layer:
SmolLM3 (layers without RoPE), Phi-4-mini (partial rotary), Phi-3 with LongRoPE, Gemma 2 (soft-caps)
and Gemma 3, the mixtures of experts (Qwen3-MoE, Mixtral, OLMoE). Their ops give every row its
bits alone (the experts float and GGUF-quantized); and on a tiny random model of each family,
every variant of the determinism report (alone, ``generate`` batches in order and shuffled,
continuous batching with and without chunked prefill and with prefix caching, 1 and 2 threads)
gives every request bitwise the reference's tokens, logprobs and logits, and the mode computes
the model the default mode computes (the same greedy tokens alone, logits within float32
rounding)."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_hf_model
from genfn import kernels
from genfn.determinism import check, run_generate
from genfn.kernels import invariant_ops
from genfn.models.model import from_hf_state_dict

pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"),
              pytest.mark.skipif(not kernels.decode_linear_available(), reason=kernels.kernel_status())]

# head_dim 16: LongRoPE takes 8 factors per list.
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
             "long_factor": [2.0 + 0.3 * i for i in range(8)]}
_GEMMA = dict(num_hidden_layers=4, head_dim=16, sliding_window=4, query_pre_attn_scalar=24)
FAMILIES = {
    "smollm3": ("SmolLM3ForCausalLM", dict(num_hidden_layers=4, no_rope_layer_interval=2)),  # layers 2 and 4: no RoPE
    "phi4_mini": ("Phi3ForCausalLM", dict(partial_rotary_factor=0.75, tie_word_embeddings=True)),
    # Original context 10: some prompts lie past it (long factors from their prefill on), others
    # cross it while they decode; in a batch, rows on both sides of it.
    "phi3_longrope": ("Phi3ForCausalLM", dict(max_position_embeddings=64, original_max_position_embeddings=10,
                                              rope_parameters=_LONGROPE)),
    # Gemma: 4 layers, sliding and global alternating, a window of 4, an attention scale of its
    # own; Gemma 2 soft-caps scores and logits (small caps, so they bite), Gemma 3 has per-head
    # q/k norms and its global layers' RoPE scaled linearly over their own base.
    "gemma2": ("Gemma2ForCausalLM", dict(_GEMMA, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3ForCausalLM", dict(_GEMMA, sliding_window_pattern=2, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # Mixtures of experts: 4 experts, 2 chosen per token.
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              norm_topk_prob=True)),
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=5)),
    "olmoe": ("OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2)),
}


def _model(name: str, dtype=torch.float32):
    arch, overrides = FAMILIES[name]
    if arch.startswith("Gemma"):
        import transformers

        config_class = transformers.Gemma2Config if arch == "Gemma2ForCausalLM" else transformers.Gemma3TextConfig
        torch.manual_seed(0)
        config = config_class(**{**dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                                        eos_token_id=2, pad_token_id=0), **overrides})
        hf_model = getattr(transformers, arch)(config).eval()
        config = {**config.to_dict(), "architectures": [arch]}
    else:
        hf_model, config = tiny_hf_model(arch, 0, **overrides)
    return from_hf_state_dict(config, hf_model.state_dict(), dtype=dtype)


def _prompts(count=6, seed=4):
    rng = random.Random(seed)
    return [[rng.randrange(3, 97) for _ in range(rng.randint(1, 20))] for _ in range(count)]


def assert_every_variant_bitwise(model, prompts, **settings):
    report = check(model, prompts, max_new_tokens=6, do_sample=True, seed=2, batch_sizes=(3, 6), chunk_tokens=5,
                   batch_invariant=True, **settings)
    expected = {"generate batch 6, shuffled", "continuous, chunked prefill", "continuous, prefix cache"}
    if settings.get("threads", (1, 2)):
        expected.add("alone, 1 thread")
    assert expected <= {c.variant for c in report.comparisons}
    for comparison in report.comparisons:
        assert comparison.identical == comparison.total, comparison
        assert comparison.max_logprob_diff == 0.0, comparison
        assert comparison.max_logit_diff in (None, 0.0), comparison


def assert_the_mode_computes_the_model(model, prompts, tolerance=1e-4):
    """Alone (where the default mode's LongRoPE choice is the row's own too), greedy: the same
    tokens inside and outside the mode, the chosen tokens' logits within float32 rounding."""
    settings = dict(max_new_tokens=6, do_sample=False)
    inside = run_generate(model, prompts, [0] * len(prompts), dict(settings, batch_invariant=True))
    outside = run_generate(model, prompts, [0] * len(prompts), settings)
    assert [r.tokens for r in inside] == [r.tokens for r in outside]
    for a, b in zip(inside, outside):
        assert max(abs(x - y) for x, y in zip(a.logits, b.logits)) < tolerance


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_runs_in_the_mode_with_every_request_bitwise_the_same(name):
    model = _model(name)
    prompts = _prompts()
    if name == "phi3_longrope":
        lengths = sorted(len(p) for p in prompts)
        assert lengths[0] < 10 - 6 and lengths[-1] > 10  # rows before, across and past the original context
    assert_every_variant_bitwise(model, prompts)
    assert_the_mode_computes_the_model(model, prompts)


def test_long_rope_in_a_generate_batch_picks_each_rows_factors_by_that_row():
    """Outside the mode a batch's furthest position picks LongRoPE's factors for every row (as
    transformers does per forward); in the mode each row's own does, so a short prompt beside a
    long one keeps its short factors and its tokens."""
    model = _model("phi3_longrope")
    short, long = [5, 6, 7], list(range(3, 23))
    settings = dict(max_new_tokens=4, do_sample=False, batch_invariant=True)
    alone = run_generate(model, [short], [0], settings)[0]
    beside = run_generate(model, [short, long], [0, 0], settings, size=2)[0]
    assert beside.tokens == alone.tokens and beside.logits == alone.logits


@pytest.mark.parametrize("name", ["gemma2", "mixtral"])
def test_bfloat16_gemma_and_experts_are_bitwise_the_same_in_every_variant(name):
    assert_every_variant_bitwise(_model(name, torch.bfloat16), _prompts(5, seed=6), threads=())


@pytest.mark.parametrize("name", ["gemma2", "qwen3_moe", "phi3_longrope"])
def test_in_the_mode_the_compiled_step_gives_the_eager_bits(name):
    """Gemma's elementwise ops and the experts are opaque ops, LongRoPE's cos/sin eager ones:
    the compiled decode step computes the eager step's bits."""
    report = check(_model(name), _prompts(3, seed=9), max_new_tokens=5, do_sample=True, batch_sizes=(),
                   continuous=False, threads=(), compiled=True, batch_invariant=True)
    compiled = report.comparison("alone, compiled")
    assert compiled.identical == compiled.total
    assert compiled.max_logprob_diff == 0.0 and compiled.max_logit_diff == 0.0


# ----------------------------------------------------------------------------------------------
# The ops, row by row


def _assert_every_row_as_alone(f, x, rows=(1, 2, 3, 7, 8, 9, 16, 17, 31, 33, 64)):
    """``f(x[:n])[i] == f(x[i:i + 1])`` bitwise for every row ``i`` of each ``n``, on 1 and 2 threads."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([f(x[i:i + 1]) for i in range(max(rows))])
        for n in rows:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                differ = (f(x[:n]) != alone[:n]).flatten(1).any(1).nonzero().flatten().tolist()
                assert not differ, f"among {n} rows on {threads} threads, rows {differ} differ from themselves alone"
    finally:
        torch.set_num_threads(before)
    return alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_elementwise_ops_give_every_row_its_bits_alone(dtype):
    torch.manual_seed(5)
    hidden = 72  # not a multiple of 16 or 32: every row ends in a vector tail
    x = (torch.randn(64, 2 * hidden) * 3).to(dtype)
    weight = (torch.randn(hidden) * 0.1).to(dtype)
    alone = _assert_every_row_as_alone(invariant_ops.gelu_tanh_mul, x)
    gate, up = x.float().chunk(2, dim=-1)
    reference = torch.nn.functional.gelu(gate, approximate="tanh") * up
    rtol, atol = (8e-3, 1e-3) if dtype == torch.bfloat16 else (1e-5, 1e-5)  # a bfloat16 result: one rounding
    assert torch.allclose(alone.float(), reference, rtol=rtol, atol=atol)
    normed = _assert_every_row_as_alone(lambda rows: invariant_ops.gemma_rms_norm(rows, weight, 1e-6), x[:, :hidden])
    xf = x[:, :hidden].float()
    reference = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + weight.float())
    assert torch.allclose(normed.float(), reference, rtol=rtol, atol=atol)
    logits = torch.randn(64, 97) * 20
    capped = _assert_every_row_as_alone(lambda rows: invariant_ops.soft_cap(rows, 3.0), logits)
    assert torch.allclose(capped, torch.tanh(logits / 3.0) * 3.0, atol=1e-6)


@pytest.mark.parametrize("head_dim", [16, 256])
def test_soft_capped_attention_gives_each_query_its_bits_in_the_dense_and_the_paged_cache(head_dim):
    """Gemma's attention (its own scale, soft-capped scores, head_dim up to 256): a query alone is
    the same bits as among a prefill chunk's queries, and from the paged cache through its table."""
    torch.manual_seed(6)
    heads, kv_heads, length, block = 4, 2, 21, 4
    keys = torch.randn(1, kv_heads, length, head_dim)
    values = torch.randn(1, kv_heads, length, head_dim)
    q = torch.randn(1, length, heads, head_dim) * 2
    causal = (torch.arange(length)[None, :] <= torch.arange(length)[:, None]).view(1, 1, length, length)
    options = dict(scale=24 ** -0.5, softcap=5.0)
    chunk = invariant_ops.dense_attention(q, keys, values, causal, **options)
    for s in (0, 7, length - 1):
        alone = invariant_ops.dense_attention(q[:, s:s + 1], keys, values, causal[:, :, s:s + 1], **options)
        assert torch.equal(alone[0], chunk[s])
    scores = torch.einsum("bshd,bhtd->bhst", q, keys.repeat_interleave(2, dim=1)) * options["scale"]
    scores = (torch.tanh(scores / 5.0) * 5.0).masked_fill(~causal, float("-inf"))
    reference = torch.einsum("bhst,bhtd->bshd", scores.softmax(-1), values.repeat_interleave(2, dim=1))
    assert (chunk - reference[0]).abs().max() < 1e-5
    num_blocks = (length + block - 1) // block
    order = torch.randperm(num_blocks + 2)[:num_blocks]
    cache_k = torch.zeros(num_blocks + 3, kv_heads, block, head_dim)
    cache_v = torch.zeros_like(cache_k)
    for logical, physical in enumerate(order.tolist()):
        span = slice(logical * block, min(length, (logical + 1) * block))
        cache_k[physical, :, :span.stop - span.start] = keys[0, :, span]
        cache_v[physical, :, :span.stop - span.start] = values[0, :, span]
    paged = invariant_ops.paged_attention(q[0].contiguous(), cache_k, cache_v, order.view(1, -1),
                                          torch.zeros(length, dtype=torch.int64), torch.arange(length), None, **options)
    assert torch.equal(paged, chunk)
    with pytest.raises(ValueError, match="softcap"):
        invariant_ops.dense_attention(q, keys, values, causal, softcap=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normalize", [False, True])
def test_the_experts_mlp_gives_every_row_its_bits_alone(dtype, normalize):
    """Each row's routing and its experts' sum are the row's own, alone or among up to 64 rows,
    grouped by expert (eager) or with every expert on every row (inside a compiled step)."""
    torch.manual_seed(7)
    experts, hidden, inner = 6, 48, 40
    router = torch.randn(experts, hidden).to(dtype)
    gate_up = (torch.randn(experts, 2 * inner, hidden) / 7).to(dtype)
    down = (torch.randn(experts, hidden, inner) / 6).to(dtype)
    x = torch.randn(64, hidden).to(dtype)
    alone = _assert_every_row_as_alone(lambda rows: invariant_ops.moe_mlp(rows, router, gate_up, down, 2, normalize),
                                       x)
    dense = invariant_ops._moe_rows(x, router, gate_up, down, 2, normalize, grouped=False)
    assert torch.equal(dense, alone)
    from genfn.models.moe import moe_mlp
    from types import SimpleNamespace

    spec = SimpleNamespace(experts_per_token=2, norm_topk_prob=normalize)
    reference = moe_mlp(spec, dict(router=router, experts_gate_up=gate_up, experts_down=down), x)
    assert (alone.float() - reference.float()).abs().max() < (0.05 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_quantized_experts_give_every_row_its_bits_alone(fmt):
    """A GGUF file's expert stacks (``QuantizedExperts``) in the mode: each row's sum its own,
    grouped by expert (eager) or every expert on every row (inside a compiled step) alike."""
    from genfn.quant import QuantizedExperts, quantize, quantize_k

    def stack(values):
        flat = values.reshape(-1, values.shape[-1])
        return QuantizedExperts.from_blocks(quantize_k(flat, fmt) if fmt == "q4_k" else quantize(flat, fmt),
                                            values.shape[0])

    torch.manual_seed(8)
    experts, hidden, inner = 4, 256, 256  # K-quant blocks span 256 inputs
    router = torch.randn(experts, hidden)
    gate_up, down = stack(torch.randn(experts, 2 * inner, hidden) / 16), stack(torch.randn(experts, hidden, inner) / 16)
    x = torch.randn(33, hidden)
    alone = _assert_every_row_as_alone(lambda rows: invariant_ops.moe_mlp(rows, router, gate_up, down, 2, True), x,
                                       rows=(1, 2, 9, 33))
    assert torch.equal(invariant_ops._moe_rows(x, router, gate_up, down, 2, True, grouped=False), alone)
