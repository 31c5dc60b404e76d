"""The batch-invariant mode (``genfn.deterministic``): its linears give every row its own bits
alone among 1..64 rows and more, its other kernels row 0, on 1 or 2 threads; and in the mode a
request's tokens and logprobs are bitwise the same alone, in ``generate`` batches, in continuous
batches of several sizes and orders, with and without chunked prefill, with prefix caching
(float32, bfloat16, Q8_0 blocks)."""

from __future__ import annotations

import random

import pytest
import torch

import genfn
from conftest import tiny_hf_model
from genfn import kernels
from genfn.batching import generate_batch
from genfn.config import ContinuousBatchingConfig, GenerationConfig
from genfn.determinism import check, run_generate
from genfn.kernels import invariant
from genfn.models.model import from_hf_state_dict
from genfn.quant.blocks import quantize
from genfn.models.quantized import quantize_params
from genfn.quant.kquants import quantize_k
from genfn.quant.weight import QuantizedWeight

pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"),
              pytest.mark.skipif(not kernels.decode_linear_available(), reason=kernels.kernel_status())]

DTYPES = [torch.float32, torch.bfloat16]
ROWS = (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64)


def _assert_row_zero_invariant(f, x):
    """``f(x[:1]) == f(x[:n])[:1]`` bitwise for each n of ``ROWS``, and 1 and 2 threads alike."""
    alone = f(x[:1])
    before = torch.get_num_threads()
    try:
        for n in ROWS:
            torch.set_num_threads(1)
            one = f(x[:n])
            assert torch.equal(one[:1], alone), f"row 0 changed among {n} rows"
            torch.set_num_threads(2)
            assert torch.equal(f(x[:n]), one), f"1 and 2 threads differ at {n} rows"
    finally:
        torch.set_num_threads(before)


def _assert_every_row_as_alone(f, x, rows=tuple(range(1, 65))):
    """``f(x[:n])[i] == f(x[i:i + 1])`` bitwise for every row ``i`` of every ``n`` in ``rows``, on
    1 and 2 threads (each row alone computed on 1 thread). Returns the rows alone."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([f(x[i:i + 1]) for i in range(max(rows))])
        for n in rows:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                together = f(x[:n])
                differ = (together != alone[:n]).flatten(1).any(1).nonzero().flatten().tolist()
                assert not differ, f"among {n} rows on {threads} threads, rows {differ} differ from themselves alone"
    finally:
        torch.set_num_threads(before)
    return alone


@pytest.mark.parametrize("dtype", DTYPES)
# Odd k (a masked last step of the k loop), odd n (rows past the last block of 4 weight rows),
# weights of several L2 panels (300 x 256: 5 panels in float32, 3 in bfloat16) that two threads
# share, k = 1000, whose float32 rows fill the kernel's 24 KiB tile at 6 rows (bfloat16: 8), and
# k = 1500 at 4 float32 rows: every tile of up to 6 (float32) or 8 (bfloat16) rows by blocks of
# 4 or 2 weight rows, and the tails of fewer rows at 64 rows and below.
@pytest.mark.parametrize("k, n", [(64, 97), (100, 48), (33, 13), (256, 300), (1000, 40), (1500, 22)])
def test_invariant_linear_gives_every_row_its_bits_alone_at_1_to_64_rows(dtype, k, n):
    torch.manual_seed(0)
    weight = (torch.randn(n, k) / k ** 0.5).to(dtype)
    x = torch.randn(64, k).to(dtype)
    alone = _assert_every_row_as_alone(lambda rows: invariant.linear(rows, weight), x)
    # A row alone is the decode kernel's one-row path, the one a batch-1 step takes outside the mode.
    assert torch.equal(alone, torch.cat([kernels.linear(x[i:i + 1], weight) for i in range(len(x))]))
    assert (alone - torch.nn.functional.linear(x, weight)).abs().max() < (0.05 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_linear_past_64_rows_and_its_refusals(dtype):
    # 300 rows of 512 inputs: more than the kernel's 256 KiB group of rows (128 float32 rows, 256
    # bfloat16), so the weight streams once per group.
    torch.manual_seed(4)
    weight = (torch.randn(40, 512) / 23).to(dtype)
    x = torch.randn(300, 512).to(dtype)
    _assert_every_row_as_alone(lambda rows: invariant.linear(rows, weight), x, rows=(1, 65, 137, 300))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        invariant.linear(x.half(), weight.half())
    with pytest.raises(RuntimeError, match="invariant_linear: float32 or bfloat16"):
        torch.ops.genfn_kernels.invariant_linear(x.float(), weight.double())


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q4_k", "q6_k"])
def test_invariant_quantized_linear_gives_every_row_its_bits_alone_past_64_rows(fmt):
    torch.manual_seed(1)
    if fmt.endswith("_k"):
        weight = quantize_k(torch.randn(40, 256) / 16, fmt)
        x = torch.randn(130, 256)
    else:
        weight = QuantizedWeight.from_rows(quantize(torch.randn(40, 96) / 10, fmt))
        x = torch.randn(130, 96)
    _assert_every_row_as_alone(lambda rows: invariant.linear(rows, weight), x,
                               rows=(*range(1, 18), 31, 33, 63, 64, 65, 127, 130))


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_norm_rope_and_swiglu_are_per_row(dtype):
    torch.manual_seed(2)
    hidden, heads, kv_heads, head_dim = 64, 4, 2, 16
    x, delta = torch.randn(64, hidden).to(dtype), torch.randn(64, hidden).to(dtype)
    weight = torch.randn(hidden).to(dtype)
    qkv = torch.randn(64, (heads + 2 * kv_heads) * head_dim).to(dtype)
    cos, sin = torch.randn(64, head_dim).to(dtype), torch.randn(64, head_dim).to(dtype)
    _assert_row_zero_invariant(lambda rows: invariant.rms_norm(rows, weight, 1e-5), x)
    _assert_row_zero_invariant(lambda rows: torch.cat(invariant.add_rms_norm(rows, delta[:len(rows)], weight, 1e-5),
                                                      dim=-1), x)
    _assert_row_zero_invariant(lambda rows: torch.cat([t.flatten(1) for t in invariant.rope_qkv(
        rows, cos[:len(rows)], sin[:len(rows)], heads, kv_heads)], dim=-1), qkv)
    _assert_row_zero_invariant(invariant.silu_mul, torch.randn(64, 2 * hidden).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_and_paged_attention_give_each_query_the_same_bits_however_it_is_batched(dtype):
    """A query's attention is the same alone (one decode row), among a prefill chunk's queries of
    one row, among rows of a left-padded batch, and from the paged cache through its block table."""
    torch.manual_seed(3)
    heads, kv_heads, head_dim, length, block = 4, 2, 32, 37, 4
    keys = torch.randn(1, kv_heads, length, head_dim).to(dtype)
    values = torch.randn(1, kv_heads, length, head_dim).to(dtype)
    q = torch.randn(1, length, heads, head_dim).to(dtype)  # query s sees positions 0..s
    causal = (torch.arange(length)[None, :] <= torch.arange(length)[:, None]).view(1, 1, length, length)
    chunk = invariant.dense_attention(q, keys, values, causal)  # [length, H, D]
    last = length - 1
    alone = invariant.dense_attention(q[:, last:], keys, values, causal[:, :, last:])
    assert torch.equal(alone[0], chunk[last])
    # Left padding: the same keys after 5 masked slots, next to another row.
    pad = 5
    padded_keys = torch.cat([torch.randn(1, kv_heads, pad, head_dim).to(dtype), keys], dim=2)
    padded_values = torch.cat([torch.randn(1, kv_heads, pad, head_dim).to(dtype), values], dim=2)
    other_keys, other_values = torch.randn_like(padded_keys), torch.randn_like(padded_values)
    mask = torch.zeros(2, 1, 1, pad + length, dtype=torch.bool)
    mask[0, 0, 0, pad:] = True
    mask[1, 0, 0, :20] = True
    padded = invariant.dense_attention(torch.cat([q[:, last:], torch.randn_like(q[:, last:])]),
                                       torch.cat([padded_keys, other_keys]), torch.cat([padded_values, other_values]),
                                       mask)
    assert torch.equal(padded[0], chunk[last])
    # The paged cache: the same keys in shuffled blocks, with every query of the chunk at once.
    num_blocks = (length + block - 1) // block
    order = torch.randperm(num_blocks + 3)[:num_blocks]
    cache_k = torch.zeros(num_blocks + 4, kv_heads, block, head_dim, dtype=dtype)
    cache_v = torch.zeros_like(cache_k)
    for logical, physical in enumerate(order.tolist()):
        span = slice(logical * block, min(length, (logical + 1) * block))
        width = span.stop - span.start
        cache_k[physical, :, :width] = keys[0, :, span]
        cache_v[physical, :, :width] = values[0, :, span]
    tables = order.view(1, -1)
    paged = invariant.paged_attention(q[0].contiguous(), cache_k, cache_v, tables,
                                      torch.zeros(length, dtype=torch.int64), torch.arange(length), None)
    assert torch.equal(paged, chunk)


# ----------------------------------------------------------------------------------------------
# End to end on a tiny model


def _model(dtype=torch.float32, fmt=None):
    hf_model, config = tiny_hf_model()
    model = from_hf_state_dict(config, hf_model.state_dict(), dtype=dtype)
    if fmt is not None:
        model.params = quantize_params(model.params, fmt)
    return model


def _prompts(count=8, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 97) for _ in range(rng.randint(1, 24))] for _ in range(count)]


def test_the_mode_is_a_scoped_context_that_restores_the_previous_one():
    assert not invariant.batch_invariant()
    with genfn.deterministic():
        assert invariant.batch_invariant()
        with genfn.deterministic(False):
            assert not invariant.batch_invariant()
        assert invariant.batch_invariant()
    assert not invariant.batch_invariant()
    with pytest.raises(TypeError, match="enabled"):
        with genfn.deterministic("yes"):
            pass
    with pytest.raises(TypeError, match="batch_invariant"):
        GenerationConfig(batch_invariant="yes")
    with pytest.raises(TypeError, match="batch_invariant"):
        ContinuousBatchingConfig(batch_invariant=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_the_mode_every_variant_of_the_report_is_bitwise_the_reference(dtype):
    """generate alone, batches of 3 and 8 (in order and shuffled), continuous batching with and
    without chunked prefill and with prefix caching, 1 and 2 threads: every request's tokens,
    logprobs and logits the same bits; sampled, so that every step's logits matter."""
    model = _model(dtype)
    report = check(model, _prompts(), max_new_tokens=10, do_sample=True, seed=3, batch_sizes=(3, 8),
                   chunk_tokens=5, batch_invariant=True)
    assert report.settings["batch_invariant"] is True
    assert "continuous, prefix cache" in [c.variant for c in report.comparisons]
    for comparison in report.comparisons:
        assert comparison.identical == comparison.total, comparison
        assert comparison.max_logprob_diff == 0.0, comparison
        assert comparison.max_logit_diff in (None, 0.0), comparison


def test_the_generation_config_flag_runs_generate_in_the_mode():
    model = _model()
    prompts = _prompts(4, seed=5)
    settings = dict(max_new_tokens=6, do_sample=False)
    alone = run_generate(model, prompts, [0] * 4, dict(settings, batch_invariant=True), 1)
    batched = run_generate(model, prompts, [0] * 4, dict(settings, batch_invariant=True), 4)
    assert [r.logits for r in alone] == [r.logits for r in batched]
    with genfn.deterministic():
        in_context = run_generate(model, prompts, [0] * 4, settings, 1)
    assert [r.logits for r in in_context] == [r.logits for r in alone]


@pytest.mark.parametrize("dtype, fmt", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "q8_0")])
def test_generate_batch_in_the_mode_gives_each_request_the_same_bits_in_any_company(dtype, fmt):
    """The ContinuousBatchingConfig flag: one request alone vs among 3, 5 and 8 others in shuffled
    orders, with chunked prefill at two budgets and without: the same tokens and logprobs."""
    model = _model(dtype, fmt)
    prompts = _prompts(9, seed=7)

    def run(order, budget, chunked):
        cb = ContinuousBatchingConfig(page_size=4, num_blocks=256, max_batch_tokens=budget,
                                      max_requests_per_batch=len(order), batch_invariant=True)
        out = generate_batch(model, [prompts[i] for i in order], continuous_batching_config=cb, max_new_tokens=8,
                             do_sample=True, seed=11, chunked_prefill=chunked)
        return {i: (list(r.generated_tokens), list(r.logprobs)) for i, r in zip(order, out.values())}

    alone = {i: run([i], 64, False)[i] for i in range(len(prompts))}
    rng = random.Random(0)
    for size, budget, chunked in ((4, 7, True), (6, 64, False), (9, 13, True)):
        order = rng.sample(range(len(prompts)), size)
        together = run(order, budget, chunked)
        for i in order:
            assert together[i] == alone[i], f"request {i} among {size} (budget {budget}, chunked {chunked})"


def test_in_the_mode_the_compiled_step_gives_the_eager_bits():
    """The compiled decode step (traced in the mode, keyed on it) against the eager one: the same
    tokens, logprobs and logits to the bit (RoPE's cos/sin are eager's inside the graph too)."""
    model = _model()
    report = check(model, _prompts(3, seed=9), max_new_tokens=6, do_sample=True, batch_sizes=(), continuous=False,
                   threads=(), compiled=True, batch_invariant=True)
    compiled = report.comparison("alone, compiled")
    assert compiled.identical == compiled.total
    assert compiled.max_logprob_diff == 0.0 and compiled.max_logit_diff == 0.0


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Olmo2ForCausalLM"])
def test_the_q_k_norm_variants_run_in_the_mode_with_every_request_bitwise_the_same(arch):
    """Qwen3 (per-head q/k norms) and OLMo 2 (q/k norms over the projections, post-norms): every
    variant of the report bitwise the reference, and the mode computes the model outside it does
    (the chosen tokens' logits within float32 rounding)."""
    hf_model, config = tiny_hf_model(arch, head_dim=16)
    model = from_hf_state_dict(config, hf_model.state_dict())
    prompts = _prompts(6, seed=4)
    report = check(model, prompts, max_new_tokens=6, do_sample=True, seed=2, batch_sizes=(3, 6), chunk_tokens=5,
                   batch_invariant=True)
    for comparison in report.comparisons:
        assert comparison.identical == comparison.total, comparison
        assert comparison.max_logprob_diff == 0.0, comparison
        assert comparison.max_logit_diff in (None, 0.0), comparison
    settings = dict(max_new_tokens=6, do_sample=False)
    inside = run_generate(model, prompts, [0] * 6, dict(settings, batch_invariant=True))
    outside = run_generate(model, prompts, [0] * 6, settings)
    assert [r.tokens for r in inside] == [r.tokens for r in outside]
    for a, b in zip(inside, outside):
        assert max(abs(x - y) for x, y in zip(a.logits, b.logits)) < 1e-4


def test_the_mode_refuses_a_tensor_parallel_shard():
    import dataclasses

    from genfn.models.invariant_layers import check_invariant_spec

    spec = dataclasses.replace(_model().spec, tensor_shard=object())  # any shard: the mode has no TP path yet
    with pytest.raises(ValueError, match="batch-invariant mode.*under tensor parallelism"):
        check_invariant_spec(spec)


def _gpt2_module():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=1,
                                     eos_token_id=2)
    return genfn.from_module(transformers.GPT2LMHeadModel(config).eval())


def test_the_mode_refuses_a_family_without_an_invariant_forward():
    # A wrapped module's forward reduces in shape-dependent orders: in the mode it must say so, not run.
    model = _gpt2_module()
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="batch-invariant mode .* runs Llama, .*Gemma 3 on one process; a wrapped "
                                         "module .* has no invariant forward yet .*GPT-OSS.*: run it outside"):
        genfn.generate(model, ids, max_new_tokens=2, batch_invariant=True)
    with pytest.raises(ValueError, match="batch-invariant mode.*no invariant forward"):
        generate_batch(model, [[5, 6, 7]], max_new_tokens=2,
                       continuous_batching_config=ContinuousBatchingConfig(batch_invariant=True))
    assert genfn.generate(model, ids, max_new_tokens=2).shape == (1, 5)  # outside the mode it runs


def test_the_refusal_names_every_registry_family_that_runs_in_the_mode():
    # Each native architecture of the registry: the name the refusal gives it, None where it refuses.
    from genfn.kernels.invariant import INVARIANT_FAMILIES, no_invariant_forward
    from genfn.models.registry import ARCHITECTURES

    names = {"LlamaForCausalLM": "Llama", "MistralForCausalLM": "Mistral", "Qwen2ForCausalLM": "Qwen2",
             "Qwen3ForCausalLM": "Qwen3", "SmolLM3ForCausalLM": "SmolLM3", "Olmo2ForCausalLM": "OLMo 2",
             "Phi3ForCausalLM": "Phi-3", "Qwen3MoeForCausalLM": "Qwen3-MoE", "MixtralForCausalLM": "Mixtral",
             "OlmoeForCausalLM": "OLMoE", "Gemma2ForCausalLM": "Gemma 2", "Gemma3ForCausalLM": "Gemma 3",
             "GptOssForCausalLM": None}
    assert set(ARCHITECTURES) == set(names), "a family joined the registry: say whether it runs in the mode"
    running = INVARIANT_FAMILIES.split(", ")
    for arch, name in names.items():
        assert (name is None) == (not any(item.startswith(name or "-") for item in running)), arch
    message = no_invariant_forward("GPT-OSS")
    assert "GPT-OSS, T5, BART" in message and "tensor parallelism" in message and INVARIANT_FAMILIES in message
