"""The step's stack of layers in one native call (genfn.kernels.decode_layer.run_stack) over a table of
its weights (stack_table): the bits of the per-layer ops, the cache written where they write it,
generate's tokens and logits unchanged, and bad arguments named."""

from __future__ import annotations

import pytest
import torch

from genfn.kernels import decode_layer
from genfn.models import llama
from genfn.quant.weight import QuantizedWeight
from test_decode_layer import (EPS, HEAD_DIM, K_FFN, K_HEADS, K_HIDDEN, K_KV_HEADS, PROMPTS, _kquant_layer,
                               _positions_rope, needs_bf16_dot, needs_vnni, tiny_pair_f32)  # noqa: F401 (a fixture)
from test_paged_native import needs_kernel


def _plain_layer(seed):
    gen = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.05):
        return torch.randn(*shape, generator=gen) * scale

    return {"attn_norm": 1 + w(K_HIDDEN, scale=0.1), "wqkv": w((K_HEADS + 2 * K_KV_HEADS) * HEAD_DIM, K_HIDDEN),
            "wo": w(K_HIDDEN, K_HEADS * HEAD_DIM), "mlp_norm": 1 + w(K_HIDDEN, scale=0.1),
            "w_gate_up": w(2 * K_FFN, K_HIDDEN), "w_down": w(K_HIDDEN, K_FFN)}


def _blocks_layer(seed, fmt):
    from genfn.quant.blocks import quantize

    return {name: QuantizedWeight.from_rows(quantize(w, fmt)) if name in decode_layer._LINEARS else w
            for name, w in _plain_layer(seed).items()}


# A stack may mix the kinds a layer takes: plain float32, tiles16 blocks (AVX512_VNNI), K-quant rows.
STACKS = {"plain": ("plain", "plain"), "kquant": ("q4_k_m", "q4_k_m_r8", "iq4_xs"),
          "mixed": pytest.param(("q4_1", "plain", "q4_k_m", "q8_0"), marks=needs_vnni)}


def _stack_layers(kinds):
    return [_plain_layer(i) if kind == "plain" else _kquant_layer(kind, seed=i) if kind.startswith(("q4_k", "iq4"))
            else _blocks_layer(i, kind) for i, kind in enumerate(kinds)]


def _step_inputs(batch, seq, layers, slots_total=48, seed=3):
    """x, cos, sin, a [L, B, Hkv, T, D] cache with filled slots, each row's S new slots (rows at
    different lengths, as a static cache's left-padded rows are) and a causal mask with holes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, K_HIDDEN, generator=gen)
    lengths = torch.tensor([20 + 7 * b for b in range(batch)])
    slots = lengths[:, None] + torch.arange(seq)  # [B, S]
    cos, sin = _positions_rope(slots, torch.float32)
    keys = torch.randn(layers, batch, K_KV_HEADS, slots_total, HEAD_DIM, generator=gen)
    values = torch.randn(layers, batch, K_KV_HEADS, slots_total, HEAD_DIM, generator=gen)
    span = int(slots.max()) + 1
    visible = (torch.rand(batch, 1, seq, span, generator=gen) < 0.8) & (torch.arange(span) <= slots[:, None, :, None])
    visible |= torch.arange(span) == slots[:, None, :, None]  # a token always sees itself
    return x, cos, sin, keys, values, slots, visible


def _layer_by_layer(layers, x, cos, sin, keys, values, slots, visible):
    """The per-layer ops with the cache write between them, as the model code runs them one by one."""
    batch, seq = x.shape[:2]
    q_size, kv_size = K_HEADS * HEAD_DIM, K_KV_HEADS * HEAD_DIM
    rows = torch.arange(batch)[:, None]
    for i, layer in enumerate(layers):
        qkv = decode_layer.attention_input(x, layer, cos, sin, EPS, K_HEADS, K_KV_HEADS)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        keys[i].permute(0, 2, 1, 3)[rows, slots] = k.reshape(batch, seq, K_KV_HEADS, HEAD_DIM)
        values[i].permute(0, 2, 1, 3)[rows, slots] = v.reshape(batch, seq, K_KV_HEADS, HEAD_DIM)
        span = visible.shape[-1]
        x = decode_layer.layer_output(x, q.reshape(-1, K_HEADS, HEAD_DIM), keys[i][:, :, :span],
                                      values[i][:, :, :span], visible, layer, EPS)
    return x


def _table(layers, dtype=torch.float32):
    return decode_layer.stack_table(layers, dtype, K_HEADS, K_KV_HEADS, HEAD_DIM)


@needs_kernel
@pytest.mark.parametrize("kinds", list(STACKS.values()), ids=list(STACKS))
# (1, 4) and (1, 8): one group of rows, quantized whole by each thread for wqkv and gate_up, and past
# four rows the gate/up tiles paired (arrange_layer_inputs), where the layer ops share both out.
@pytest.mark.parametrize("batch, seq", [(1, 1), (3, 1), (1, 4), (1, 8), (2, 5)])
def test_the_stack_gives_the_layer_ops_bits_and_cache(kinds, batch, seq):
    layers = _stack_layers(kinds)
    x, cos, sin, keys, values, slots, visible = _step_inputs(batch, seq, len(layers) + 1)
    assert decode_layer.stack_takes(x, keys, HEAD_DIM)
    table = _table(layers)
    assert table is not None
    stacked_keys, stacked_values = keys.clone(), values.clone()
    out = decode_layer.run_stack(x, table, len(layers), cos, sin, stacked_keys, stacked_values, slots, visible, EPS)
    expected = _layer_by_layer(layers, x, cos, sin, keys, values, slots, visible)
    assert torch.equal(out, expected)
    assert torch.equal(stacked_keys, keys) and torch.equal(stacked_values, values)  # the last layer's untouched


@needs_kernel
def test_the_stack_runs_the_tables_first_layers_and_keeps_its_weights_alive():
    """An early exit runs the table's first few layers; the table holds its weights, so it outlives
    the params it was built from."""
    layers = _stack_layers(("plain", "q4_k_m", "plain"))
    x, cos, sin, keys, values, slots, visible = _step_inputs(2, 1, 3)
    table = _table(layers)
    first_two = layers[:2]
    del layers
    import gc

    gc.collect()
    stacked_keys, stacked_values = keys.clone(), values.clone()
    out = decode_layer.run_stack(x, table, 2, cos, sin, stacked_keys, stacked_values, slots, visible, EPS)
    assert torch.equal(out, _layer_by_layer(first_two, x, cos, sin, keys, values, slots, visible))
    assert torch.equal(stacked_keys, keys) and torch.equal(stacked_values, values)


@needs_kernel
@needs_bf16_dot
@pytest.mark.parametrize("batch, seq", [(1, 1), (3, 1), (2, 5)])
def test_a_bfloat16_stack_gives_the_layer_ops_bits_and_cache(batch, seq):
    """A compiled bfloat16 step's stack (eagerly ``stack_takes`` leaves bfloat16 to transformers'
    op-by-op rounding; the table is the same either way)."""
    layers = [{name: w.bfloat16() for name, w in _plain_layer(i).items()} for i in range(2)]
    x, cos, sin, keys, values, slots, visible = (t.bfloat16() if t.is_floating_point() else t
                                                 for t in _step_inputs(batch, seq, 3))
    assert not decode_layer.stack_takes(x, keys, HEAD_DIM)  # eager
    stacked_keys, stacked_values = keys.clone(), values.clone()
    out = decode_layer.run_stack(x, _table(layers, torch.bfloat16), 2, cos, sin, stacked_keys, stacked_values, slots,
                                 visible, EPS)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, _layer_by_layer(layers, x, cos, sin, keys, values, slots, visible))
    assert torch.equal(stacked_keys, keys) and torch.equal(stacked_values, values)


@needs_kernel
def test_a_stack_the_native_step_does_not_take_has_no_table_or_does_not_run():
    layers = _stack_layers(("plain", "plain"))
    x, _, _, keys, *_ = _step_inputs(1, 1, 2)
    assert _table([layers[0], {**layers[1], "bqkv": torch.zeros(1)}]) is None
    assert _table([layers[0], {**layers[1], "wo": layers[1]["wo"].clone().requires_grad_()}]) is None
    assert _table(layers, torch.bfloat16) is None  # float32 weights
    assert decode_layer.stack_table(layers, torch.float32, K_HEADS, K_KV_HEADS, 24) is None  # head_dim
    assert not decode_layer.stack_takes(torch.randn(1, 40, K_HIDDEN), keys, HEAD_DIM)  # a prefill
    assert not decode_layer.stack_takes(x.bfloat16(), keys.bfloat16(), HEAD_DIM)  # eager bfloat16


def _raw_stack(layers):
    """The table op's arguments for plain layers."""
    weights = [w for layer in layers for w in (layer["attn_norm"], layer["mlp_norm"],
                                               *(layer[name] for name in decode_layer._LINEARS))]
    return weights, [0] * len(layers)


@needs_kernel
def test_bad_table_arguments_name_the_op_and_what_is_wrong():
    weights, layout = _raw_stack(_stack_layers(("plain", "plain")))
    ops = torch.ops.genfn_kernels

    def build(weights=weights, layout=layout, dtype=torch.float32, heads=K_HEADS, head_dim=HEAD_DIM):
        ops.decode_stack_table(weights, layout, dtype, K_HIDDEN, heads, K_KV_HEADS, head_dim)

    build()
    with pytest.raises(RuntimeError, match="decode_stack_table: the layout must describe every weight"):
        build(weights=weights + [weights[0]])
    with pytest.raises(RuntimeError, match="decode_stack_table: the weights end before"):
        build(weights=weights[:-1])
    with pytest.raises(RuntimeError, match="decode_stack_table: a layer's kind must be 0"):
        build(layout=[7, 7])
    with pytest.raises(RuntimeError, match=r"decode_stack_table: wqkv must be \["):
        build(weights=[weights[0], weights[1], weights[3]] + weights[3:])
    with pytest.raises(RuntimeError, match="decode_stack_table: dtype must be float32 or bfloat16"):
        build(dtype=torch.float16)
    with pytest.raises(RuntimeError, match="decode_stack_table: .* kv heads of head_dim 24"):
        build(head_dim=24)
    with pytest.raises(RuntimeError, match=r"decode_stack_table: attn_norm must be \[hidden\] in x's dtype"):
        build(dtype=torch.bfloat16)  # float32 weights


@needs_kernel
def test_bad_stack_arguments_name_the_op_and_what_is_wrong():
    layers = _stack_layers(("plain", "plain"))
    x, cos, sin, keys, values, slots, visible = _step_inputs(1, 1, 2)
    table = _table(layers)

    def run(table=table, count=2, slots=slots, keys=keys, x=x):
        decode_layer.run_stack(x, table, count, cos, sin, keys, keys.clone(), slots, visible, EPS)

    run()
    with pytest.raises(RuntimeError, match="decode_stack: slot 48 is outside the cache's 48 slots"):
        run(slots=torch.tensor([[48]]))
    with pytest.raises(RuntimeError, match=r"decode_stack: layers must be 1 to 1 \(the table's 2, the cache's 1\)"):
        run(keys=keys[:1])
    with pytest.raises(RuntimeError, match="decode_stack: layers must be 1 to 2"):
        run(count=3)
    with pytest.raises(RuntimeError, match="decode_stack: table is not a stack table"):
        run(table=table.clone())  # its bytes, not the table
    with pytest.raises(RuntimeError, match="decode_stack: table must be what decode_stack_table returned"):
        run(table=torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match=rf"decode_stack: x must be \[M, {K_HIDDEN}\] in Float"):
        run(x=torch.randn(1, 1, 32))


GENERATE = dict(attention_mask=(PROMPTS != 0).long(), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                pad_token_id=0, return_dict_in_generate=True, output_logits=True, disable_compile=True)


@needs_kernel
@pytest.mark.parametrize("fmt", [None, pytest.param("q4_1", marks=needs_vnni)])
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_eager_generate_takes_the_stack_and_keeps_its_tokens_and_logits(tiny_pair_f32, monkeypatch, fmt, cache):
    """Left-padded rows (their own slots) and prompt lookup's verifications (several tokens a row):
    the stack gives what the layers one by one give, bit for bit."""
    import genfn
    from genfn.models.model import Model
    from genfn.models.quantized import quantize_params

    _, model = tiny_pair_f32
    if fmt:
        model = Model(model.spec, quantize_params(model.params, fmt), model.apply_fn, model.init_cache_fn)
    settings = dict(GENERATE, **({"cache_implementation": "static", "max_cache_len": 48} if cache == "static" else {}))
    lookup = torch.tensor([[5, 17, 3, 88, 41, 9, 5, 17, 3, 88, 41, 9, 5, 17, 3]])
    lookup_settings = dict(settings, attention_mask=None, prompt_lookup_num_tokens=6, output_logits=False)
    stacks = []
    run_stack = decode_layer.run_stack
    monkeypatch.setattr(decode_layer, "run_stack", lambda x, *a: stacks.append(x.shape[:2]) or run_stack(x, *a))
    ours = genfn.generate(model, PROMPTS, **settings)
    ours_lookup = genfn.generate(model, lookup, **lookup_settings)
    assert (3, 1) in stacks and any(seq > 1 for _, seq in stacks)  # decode steps and verifications
    monkeypatch.setattr(llama, "_native_stack", lambda *a: None)
    layers = genfn.generate(model, PROMPTS, **settings)
    assert torch.equal(ours.sequences, layers.sequences)
    assert torch.equal(torch.stack(ours.logits), torch.stack(layers.logits))
    assert torch.equal(ours_lookup.sequences, genfn.generate(model, lookup, **lookup_settings).sequences)


@needs_kernel
def test_an_eager_run_builds_the_stacks_table_once_and_keeps_its_tokens_and_logits(tiny_pair_f32, monkeypatch):
    """The run's params carry the stack's table (``llama.step_params``, made once per model by
    ``Model.functional``): its steps neither build one again nor hand every weight to the native call,
    a later run builds none, and they give what steps that build their own give."""
    import genfn
    from conftest import fresh_model
    from genfn.models import registry

    model = fresh_model(tiny_pair_f32[1])
    builds = []
    stack_table = decode_layer.stack_table
    monkeypatch.setattr(decode_layer, "stack_table", lambda layers, *a: builds.append(len(layers)) or
                        stack_table(layers, *a))
    settings = dict(GENERATE, cache_implementation="static", max_cache_len=48)
    ours = genfn.generate(model, PROMPTS, **settings)
    assert builds == [len(model.params["layers"])]
    genfn.generate(model, PROMPTS, **settings)
    assert builds == [len(model.params["layers"])]
    monkeypatch.setattr(registry, "step_params", lambda spec, params: params)
    builds.clear()
    every_step = genfn.generate(fresh_model(model), PROMPTS, **settings)
    assert len(builds) == GENERATE["max_new_tokens"] - 1  # the prefill's first token takes no stack
    assert torch.equal(ours.sequences, every_step.sequences)
    assert torch.equal(torch.stack(ours.logits), torch.stack(every_step.logits))


def test_a_steps_params_carry_a_table_where_the_family_declares_one():
    from conftest import tiny_pair
    from genfn.models import registry

    _, llama_model = tiny_pair("LlamaForCausalLM", seed=1)
    _, gemma_model = tiny_pair("Gemma2ForCausalLM", seed=1)
    params = llama_model.functional().params
    if decode_layer.decode_linear_available():
        table = params[llama.STACK_TABLE]
        assert table.dtype == torch.uint8 and table.dim() == 1
    assert llama.STACK_TABLE not in llama_model.params
    assert registry.step_params(gemma_model.spec, gemma_model.params) is gemma_model.params


@needs_kernel
def test_a_compiled_step_takes_the_stack_and_keeps_the_layer_calls_bits(tiny_pair_f32, monkeypatch):
    """Inside a compiled step the stack writes the cache in place (inductor hands it the state's own
    buffers) and gives the per-layer calls' logits bit for bit."""
    import genfn

    _, model = tiny_pair_f32
    settings = dict(GENERATE, cache_implementation="static", max_cache_len=48, disable_compile=False)

    def run():
        with torch.profiler.profile() as profile:
            out = genfn.generate(model, PROMPTS, **settings)
        counts = {e.key: e.count for e in profile.key_averages()}
        return out, counts.get("genfn_kernels::decode_stack", 0), counts.get("genfn_kernels::decode_stack_table", 0)

    run()
    ours, stacks, tables = run()  # compiled already: the graph takes the table built outside it
    assert stacks >= GENERATE["max_new_tokens"] - 1 and tables <= 1
    monkeypatch.setattr(llama, "_native_stack", lambda *a: None)
    layers, stacks, _ = run()  # dynamo guards on the function: the step is traced again, layer by layer
    assert stacks == 0
    assert torch.equal(ours.sequences, layers.sequences)
    assert torch.equal(torch.stack(ours.logits), torch.stack(layers.logits))


@needs_kernel
def test_a_compiled_apply_on_params_without_a_table_builds_one_in_its_graph():
    """A loop of the user's own that compiles ``apply`` over the model's plain params (no
    ``step_params``): the graph builds the stack's table itself and gives the eager step's logits."""
    from conftest import tiny_pair

    _, model = tiny_pair("LlamaForCausalLM", seed=1)
    ids, positions = torch.tensor([[5, 17, 3, 88]]), torch.arange(4)[None]
    with torch.no_grad():
        _, cache = model.apply(ids, positions, model.init_cache(1, 32))

        def step(params, tokens, positions, cache):
            return model.apply_fn(model.spec, params, tokens, positions, cache)[0]

        eager = step(model.params, ids[:, -1:], positions[:, -1:] + 1, cache)
        compiled = torch.compile(step, fullgraph=True)
        compiled(model.params, ids[:, -1:], positions[:, -1:] + 1, cache)
        with torch.profiler.profile() as profile:
            ours = compiled(model.params, ids[:, -1:], positions[:, -1:] + 1, cache)
    counts = {e.key: e.count for e in profile.key_averages()}
    assert counts.get("genfn_kernels::decode_stack_table") == 1 and counts.get("genfn_kernels::decode_stack") == 1
    assert torch.equal(ours, eager)


@needs_kernel
def test_a_draft_models_rounds_build_no_table(monkeypatch):
    """An assistant's draft steps read its params through ``Model.functional`` every round: the table
    is made once per model, not once per round (as it was, eager and inside a compiled step)."""
    import genfn
    from conftest import tiny_pair

    _, target = tiny_pair("LlamaForCausalLM", seed=1)
    _, assistant = tiny_pair("LlamaForCausalLM", seed=2)
    builds = []
    stack_table = decode_layer.stack_table
    monkeypatch.setattr(decode_layer, "stack_table", lambda layers, *a: builds.append(len(layers)) or
                        stack_table(layers, *a))
    out = genfn.generate(target, torch.tensor([[5, 17, 3, 88, 41, 9]]), max_new_tokens=24, min_new_tokens=24,
                         assistant_model=assistant, do_sample=False, cache_implementation="static", max_cache_len=64,
                         disable_compile=True)
    assert out.shape[1] == 30
    assert len(builds) == 2  # the target's and the assistant's


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads", [(16, 1), (32, 2)])
def test_more_query_heads_a_kv_head_than_the_attention_holds_keep_transformers_tokens(heads, kv_heads):
    # 16 query heads to a kv head, twice the attention's registers (decode_attention.cpp's kMaxGroups):
    # one task per (row, kv head) takes them all at once (one thread, or rows times kv heads even).
    import genfn
    from conftest import tiny_pair

    hf_model, model = tiny_pair(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=heads * 16,
                                head_dim=16)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            expected = hf_model.generate(ids, max_new_tokens=8, do_sample=False)
            for count in (1, 2):
                torch.set_num_threads(count)
                out = genfn.generate(model, ids, max_new_tokens=8, do_sample=False, cache_implementation="static",
                                     max_cache_len=32, disable_compile=True)
                assert torch.equal(out, expected), f"{count} threads"
    finally:
        torch.set_num_threads(threads)


# Shapes the fixed fixtures do not reach: head dims that are not powers of two, wide query groups,
# widths that are not multiples of the block sizes (those linears stay float beside quantized ones).
ODD_SHAPES = {"dim48_group12": dict(num_attention_heads=12, num_key_value_heads=1, hidden_size=96, head_dim=48,
                                    intermediate_size=256),
              "dim80_group9": dict(num_attention_heads=27, num_key_value_heads=3, hidden_size=432, head_dim=80,
                                   intermediate_size=96),
              "dim112_kv5": dict(num_attention_heads=10, num_key_value_heads=5, hidden_size=160, head_dim=112,
                                 intermediate_size=352)}


@needs_kernel
@pytest.mark.parametrize("shape", list(ODD_SHAPES.values()), ids=list(ODD_SHAPES))
def test_odd_shapes_keep_transformers_tokens_in_steps_and_lookup_rounds(shape):
    import genfn
    from conftest import padded_prompts, tiny_pair

    hf_model, model = tiny_pair(num_hidden_layers=2, **shape)
    ids, mask = padded_prompts(batch=3, length=9, seed=4)
    lookup = torch.tensor([[5, 17, 3, 88, 41, 9, 5, 17, 3, 88, 41, 9, 5, 17, 3]])
    settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                    cache_implementation="static", max_cache_len=40, disable_compile=True)
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            expected = hf_model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                                         do_sample=False, pad_token_id=0)
            expected_lookup = hf_model.generate(lookup, max_new_tokens=8, min_new_tokens=8, do_sample=False)
            for count in (1, 2):
                torch.set_num_threads(count)
                assert torch.equal(genfn.generate(model, ids, attention_mask=mask, **settings), expected)
                assert torch.equal(genfn.generate(model, lookup, prompt_lookup_num_tokens=5, **settings),
                                   expected_lookup)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@needs_vnni
def test_layers_mixing_tiles_and_k_quant_rows_run_the_stack_with_the_layer_ops_bits(tmp_path, monkeypatch):
    """A Q4_K_M file of a 576-wide model keeps its Q5_0 matrices as tiles beside Q4_K/Q6_K rows: such
    a layer ran op by op (the stack took one kind a layer). The stack takes it now, each linear
    through its own kind's kernel, with the bits of the layer op by op. So too a Q5_K_M file's
    layers, whose q/k/v stacks Q5_1 q/k on a Q8_0 v (no tile kind holds both): the stack runs the
    parts of one linear in turn (layers 3 and 4, the latter all tiles), as it does a Q5_0 q/k beside a
    Q8_0 v (kept in their own formats, not widened into one: every layer's q/k/v here)."""
    import genfn
    from genfn.quant.stack import RowStack
    from test_load_memory import write_file

    tiles = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q5_0",
             "ffn_up": "Q5_0"}
    q5_1 = {"attn_q": "Q5_1", "attn_k": "Q5_1", "attn_v": "Q8_0", "attn_output": "Q5_1", "ffn_gate": "Q5_1",
            "ffn_up": "Q5_1"}
    types = {0: dict(tiles, ffn_down="Q6_K"), 1: dict(tiles, attn_output="Q4_K", ffn_down="Q4_K"),
             2: dict(tiles, ffn_down="Q8_0"), 3: dict(q5_1, ffn_down="Q5_K"), 4: dict(q5_1, ffn_down="Q5_1")}
    model = genfn.load(write_file(tmp_path / "mixed.gguf", types=types, embed="Q8_0", output=None), quantize="gguf")
    assert [decode_layer.layer_kind(layer, torch.float32) for layer in model.params["layers"]] == [3, 3, 3, 3, 3]
    stacked = model.params["layers"][4]["wqkv"]
    assert isinstance(stacked, RowStack) and [p.format for p in stacked.parts] == ["q5_1", "q8_0"]
    stacked = model.params["layers"][2]["wqkv"]
    assert isinstance(stacked, RowStack) and [p.format for p in stacked.parts] == ["q5_0", "q8_0"]
    assert not decode_layer.takes(torch.zeros(1, 1, 256), model.params["layers"][0], torch.zeros(1, 2, 8, 64), 64)
    ids = torch.tensor([[5, 17, 42, 7, 99, 3], [8, 9, 10, 11, 12, 13]])
    settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, return_dict_in_generate=True,
                    output_logits=True, disable_compile=True, cache_implementation="static", max_cache_len=40,
                    attention_mask=torch.ones_like(ids), pad_token_id=0)
    stacks = []
    run_stack = decode_layer.run_stack
    monkeypatch.setattr(decode_layer, "run_stack", lambda x, *a: stacks.append(x.shape[:2]) or run_stack(x, *a))
    ours = genfn.generate(model, ids, **settings)
    assert stacks
    # Prompt-lookup rounds of 8 rows: each thread quantizes wqkv's and gate_up's x whole, and the
    # tiles gate/up runs paired (arrange_layer_inputs), where the layer ops share both out (the
    # assisted strategy returns no logits: its tokens). The prompt repeats, so lookup has drafts
    # (a round with none runs one row).
    looped = torch.tensor([[5, 17, 42, 7, 5, 17, 42, 7, 5, 17]])
    lookup = dict(settings, prompt_lookup_num_tokens=7, num_assistant_tokens_schedule="constant",
                  attention_mask=torch.ones_like(looped), output_logits=False)
    stacks.clear()
    ours_lookup = genfn.generate(model, looped, **lookup)
    assert (1, 8) in stacks
    monkeypatch.setattr(llama, "_native_stack", lambda *a: None)
    layers = genfn.generate(model, ids, **settings)
    assert torch.equal(ours.sequences, layers.sequences)
    assert torch.equal(torch.stack(ours.logits), torch.stack(layers.logits))
    layers_lookup = genfn.generate(model, looped, **lookup)
    assert torch.equal(ours_lookup.sequences, layers_lookup.sequences)
