"""The native stack of layers over continuous batching's paged cache
(genfn.kernels.decode_layer.run_paged_stack): the dense stack's bits over the same keys wherever the
blocks lie, and a short request's logits in continuous batching those of generate alone."""

from __future__ import annotations

import types

import pytest
import torch

from genfn.kernels import decode_layer
from genfn.models import packed
from test_decode_layer import EPS, HEAD_DIM, K_HEADS, K_KV_HEADS, needs_vnni, tiny_pair_f32  # noqa: F401 (a fixture)
from test_decode_stack import STACKS, _stack_layers, _step_inputs
from test_paged_native import needs_kernel

BLOCK = 4


def _paged_copy(keys, values, slots, window=None, seed=5):
    """The dense cache ``[L, B, Hkv, T, D]`` laid out in shuffled blocks of ``BLOCK`` slots (a sink block
    last), with what ``run_paged_stack`` reads of a ``BatchInputs`` for each row's tokens at ``slots [B, S]``,
    and the dense step's causal mask over the same positions (the last ``window`` of them)."""
    layers, batch, kv_heads, total, head_dim = keys.shape
    width = total // BLOCK
    tables = torch.randperm(batch * width, generator=torch.Generator().manual_seed(seed)).view(batch, width)
    paged = [torch.zeros(layers, batch * width + 1, kv_heads, BLOCK, head_dim) for _ in range(2)]
    for b in range(batch):
        for j in range(width):
            for cache, dense in zip(paged, (keys, values)):
                cache[:, tables[b, j]] = dense[:, b, :, j * BLOCK:(j + 1) * BLOCK]
    positions = slots.reshape(-1)
    rows = torch.arange(batch).repeat_interleave(slots.shape[1])
    inputs = types.SimpleNamespace(slot_mapping=tables[rows, positions // BLOCK] * BLOCK + positions % BLOCK,
                                   block_tables=tables.contiguous(), request_index=rows, positions=positions)
    span = torch.arange(int(slots.max()) + 1)
    visible = span <= slots[:, None, :, None]
    if window is not None:
        visible &= span > slots[:, None, :, None] - window
    return paged, inputs, visible, tables


def _dense_view(paged, tables):
    """The paged cache back in the dense layout."""
    cache = paged[:, tables]  # [L, B, W, Hkv, BLOCK, D]
    return cache.permute(0, 1, 3, 2, 4, 5).reshape(*cache.shape[:2], cache.shape[3], -1, cache.shape[-1])


@needs_kernel
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("kinds", list(STACKS.values()), ids=list(STACKS))
@pytest.mark.parametrize("batch, seq", [(1, 1), (3, 1), (2, 5)])
def test_the_paged_stack_gives_the_dense_stacks_bits_and_cache(kinds, batch, seq, window):
    """Decode tokens of several requests, or drafts of one (each attending the ones before it), with
    their blocks anywhere in the cache: the bits the static cache's stack gives over the same keys."""
    layers = _stack_layers(kinds)
    x, cos, sin, keys, values, slots, _ = _step_inputs(batch, seq, len(layers) + 1)
    (paged_keys, paged_values), inputs, visible, tables = _paged_copy(keys, values, slots, window)
    table = decode_layer.stack_table(layers, x.dtype, K_HEADS, K_KV_HEADS, HEAD_DIM)
    dense = decode_layer.run_stack(x, table, len(layers), cos, sin, keys, values, slots, visible, EPS)
    out = decode_layer.run_paged_stack(x.reshape(batch * seq, -1), table, len(layers), cos.reshape(batch * seq, -1),
                                       sin.reshape(batch * seq, -1), paged_keys, paged_values, inputs, EPS, window)
    assert torch.equal(out, dense.reshape(batch * seq, -1))
    assert torch.equal(_dense_view(paged_keys, tables), keys) and torch.equal(_dense_view(paged_values, tables), values)


@needs_kernel
def test_bad_paged_stack_arguments_name_the_op_and_what_is_wrong():
    layers = _stack_layers(("plain", "plain"))
    x, cos, sin, keys, values, slots, _ = _step_inputs(2, 1, 2)
    (paged_keys, paged_values), inputs, _, _ = _paged_copy(keys, values, slots)
    table = decode_layer.stack_table(layers, x.dtype, K_HEADS, K_KV_HEADS, HEAD_DIM)

    def run(**changes):
        decode_layer.run_paged_stack(x.reshape(2, -1), table, 2, cos.reshape(2, -1), sin.reshape(2, -1), paged_keys,
                                     paged_values, types.SimpleNamespace(**{**vars(inputs), **changes}), EPS, None)

    slots_total = paged_keys.shape[1] * BLOCK
    with pytest.raises(RuntimeError, match=f"decode_stack_paged: slot {slots_total} is outside the cache's"):
        run(slot_mapping=torch.tensor([0, slots_total]))
    with pytest.raises(RuntimeError, match=r"decode_stack_paged: token 1 \(request 2, position 27\) is outside"):
        run(request_index=torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match=r"decode_stack_paged: token 0 \(request 0, position 48\) is outside"):
        run(positions=torch.tensor([48, 27]))
    with pytest.raises(RuntimeError, match="decode_stack_paged: block 99 of request 1 is outside"):
        run(block_tables=torch.cat([inputs.block_tables[:1], torch.full((1, 12), 99)]))
    with pytest.raises(RuntimeError, match=r"decode_stack_paged: positions must be contiguous int64 \[M\]"):
        run(positions=torch.tensor([20]))
    with pytest.raises(RuntimeError, match="decode_stack_paged: keys and values must be .layers, blocks"):
        decode_layer.run_paged_stack(x.reshape(2, -1), table, 2, cos.reshape(2, -1), sin.reshape(2, -1),
                                     paged_keys[0], paged_values[0], inputs, EPS, None)


# Prompts of at most MAX_LAYER_ROWS tokens: generate alone runs their prefill on the static cache's
# stack too, so every forward of both sides is the native stack.
PROMPTS = ([5, 17, 3, 88, 41, 9], [12, 7, 60, 33], [1, 44, 90, 8, 8, 21, 70, 2, 19, 5, 61])


def _alone(model, prompt, new_tokens):
    """generate's tokens of ``prompt`` alone, and its raw logprobs of them."""
    import genfn
    from genfn.strategies.token_choice import chosen_logprobs

    out = genfn.generate(model, torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, return_dict_in_generate=True, output_logits=True, disable_compile=True)
    tokens = out.sequences[0, len(prompt):]
    logits = torch.cat(out.logits)
    return tokens.tolist(), chosen_logprobs(logits, tokens).tolist()


@needs_kernel
@pytest.mark.parametrize("fmt", [None, pytest.param("q4_1", marks=needs_vnni)])
def test_continuous_batching_gives_a_short_requests_generate_logits_on_the_stack(tiny_pair_f32, monkeypatch, fmt):
    """Requests decoding beside each other, their prompts cut into chunks by a 16-token budget: every
    forward takes the paged stack, and each request's tokens and raw logprobs are those of
    ``generate`` alone, bit for bit (each token reduced on its own, over its own keys in order)."""
    from batching_support import run_requests
    from genfn import ContinuousBatchingConfig
    from genfn.models.model import Model
    from genfn.models.quantized import quantize_params

    _, model = tiny_pair_f32
    if fmt:
        model = Model(model.spec, quantize_params(model.params, fmt), model.apply_fn, model.init_cache_fn)
    tokens = []
    run_paged_stack = decode_layer.run_paged_stack
    monkeypatch.setattr(decode_layer, "run_paged_stack",
                        lambda x, *a: tokens.append(x.shape[0]) or run_paged_stack(x, *a))
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=32, max_batch_tokens=16, max_requests_per_batch=4,
                                  max_blocks_per_request=8)
    outputs, _ = run_requests(model, [(p, 10, {"do_sample": False}) for p in PROMPTS], cb)
    assert tokens and max(tokens) <= decode_layer.MAX_LAYER_ROWS and 3 in tokens  # three requests decoding
    for prompt, out in zip(PROMPTS, outputs):
        assert (out.generated_tokens, out.logprobs) == _alone(model, prompt, 10)


@needs_kernel
def test_the_eager_batching_forward_builds_the_stacks_table_once(tiny_pair_f32, monkeypatch):
    """The engine's params carry the stack's table (``Model.functional``'s, kept by ``pack_params``),
    built once for every forward of the engine, whatever its token count."""
    from batching_support import run_requests
    from conftest import fresh_model
    from genfn import ContinuousBatchingConfig

    model = fresh_model(tiny_pair_f32[1])
    builds, forwards = [], []
    stack_table, run_paged_stack = decode_layer.stack_table, decode_layer.run_paged_stack
    monkeypatch.setattr(decode_layer, "stack_table", lambda layers, *a: builds.append(len(layers)) or
                        stack_table(layers, *a))
    monkeypatch.setattr(decode_layer, "run_paged_stack",
                        lambda x, *a: forwards.append(x.shape[0]) or run_paged_stack(x, *a))
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=32, max_batch_tokens=16, max_requests_per_batch=4,
                                  max_blocks_per_request=8)
    outputs, _ = run_requests(model, [(p, 6, {"do_sample": False}) for p in PROMPTS], cb)
    assert len(set(forwards)) > 1 and builds == [len(model.params["layers"])]
    for prompt, out in zip(PROMPTS, outputs):
        assert out.generated_tokens == _alone(model, prompt, 6)[0]


def _record_stack_choices(monkeypatch) -> list:
    """``(tokens, whether the paged stack runs them)`` of every packed forward from now on (traced
    ones once per graph)."""
    choices = []
    paged_stack = packed._paged_stack

    def recorded(spec, layers, x, cache, plan):
        stack = paged_stack(spec, layers, x, cache, plan)
        choices.append((x.shape[0], stack is not None))
        return stack

    monkeypatch.setattr(packed, "_paged_stack", recorded)
    return choices


@needs_kernel
def test_a_batch_of_more_tokens_than_the_stack_takes_runs_layer_by_layer(tiny_pair_f32, monkeypatch):
    """A prefill of 20 tokens runs the packed layers op by op; the decode steps after it the stack."""
    from batching_support import run_requests
    from genfn import ContinuousBatchingConfig

    _, model = tiny_pair_f32
    sizes = _record_stack_choices(monkeypatch)
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=32, max_batch_tokens=64, max_requests_per_batch=4,
                                  max_blocks_per_request=8)
    prompt = list(range(3, 23))
    (out,), _ = run_requests(model, [(prompt, 4, {"do_sample": False})], cb)
    assert sizes[0] == (20, False) and all(taken for _, taken in sizes[1:]) and len(sizes) == 4
    assert out.generated_tokens == _alone(model, prompt, 4)[0]


@needs_kernel
def test_the_compiled_batching_forward_takes_the_paged_stack(tiny_pair_f32):
    """Compiled (padded token counts of 8 and 16), the forward runs the paged stack inside its graph
    (its cache write functionalized and reinplaced) and gives generate's tokens."""
    from batching_support import run_engine

    _, model = tiny_pair_f32
    requests = {i: (p, 6, {"do_sample": False}) for i, p in enumerate(PROMPTS)}
    with torch.profiler.profile() as profile:
        ended, _ = run_engine(model, requests, 32, 16, 4, width=8, compile={"fullgraph": True})
    assert any(e.key == "genfn_kernels::decode_stack_paged" and e.count > 0 for e in profile.key_averages())
    for i, prompt in enumerate(PROMPTS):
        assert list(ended[i].generated_ids) == _alone(model, prompt, 6)[0]


@needs_kernel
@needs_vnni
def test_a_multi_query_models_short_prompts_keep_generates_logits_in_a_batch_of_many():
    """16 query heads over one kv head: a batch of more than 16 tokens runs the packed forward op by
    op, whose decode rows and short prompts attend through the paged walk. That walk refused more
    than 8 heads a kv head and fell back to torch's attention, so ulp differences moved 8-bit
    activation codes: logprobs up to 6e-3 apart from generate's (beam search then kept other beams).
    The walk takes any group now, 8 heads at a time as the stack's."""
    from conftest import tiny_pair
    from batching_support import run_requests
    from genfn import ContinuousBatchingConfig
    from genfn.models.model import Model
    from genfn.models.quantized import quantize_params

    _, model = tiny_pair(num_attention_heads=16, num_key_value_heads=1, hidden_size=480, head_dim=32,
                         intermediate_size=96, num_hidden_layers=2, seed=18)
    model = Model(model.spec, quantize_params(model.params, "q4_0"), model.apply_fn, model.init_cache_fn)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 97, (n,), generator=gen).tolist() for n in (5, 9, 14, 3, 11, 7, 16, 2, 12, 8, 11, 6)]
    cb = ContinuousBatchingConfig(max_batch_tokens=128, max_requests_per_batch=12)
    outputs, _ = run_requests(model, [(p, 6, {"do_sample": False}) for p in prompts], cb)
    for prompt, out in zip(prompts, outputs):
        assert (out.generated_tokens, out.logprobs) == _alone(model, prompt, 6)


@needs_kernel
@needs_vnni
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_block_quantized_requests_get_generates_logits_in_mixed_forwards(tiny_pair_f32, fmt):
    """Whole prompts of 20-30 tokens prefilled together (op by op: their keys and values through the
    native prefill kernel, as generate's prefill), then decoding beside each other on the stack, one
    joining while the others decode: every row's raw logprobs are generate's alone, bit for bit. The
    block-quantized products give a row the same bits at any row count, and the row ops
    (``row_ops.h``) are one code for the packed forward and the stack."""
    import random

    from batching_support import run_requests
    from genfn import ContinuousBatchingConfig
    from genfn.models.model import Model
    from genfn.models.quantized import quantize_params

    _, model = tiny_pair_f32
    model = Model(model.spec, quantize_params(model.params, fmt), model.apply_fn, model.init_cache_fn)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 97) for _ in range(n)] for n in (20, 30, 25, 24)]
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=96, max_batch_tokens=80, max_requests_per_batch=4,
                                  max_blocks_per_request=16)
    outputs, _ = run_requests(model, [(p, 12, {"do_sample": False}) for p in prompts], cb, chunked_prefill=False)
    for prompt, out in zip(prompts, outputs):
        assert (out.generated_tokens, out.logprobs) == _alone(model, prompt, 12)
