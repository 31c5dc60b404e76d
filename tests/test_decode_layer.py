"""A Llama decoder layer's decode step in two native calls (genfn/kernels/decode_layer.cpp,
``genfn.kernels.decode_layer``): each call equals the model's op-by-op layer, the model's static
cache and growing cache decodes take it, and what it does not take falls back to the op-by-op layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from genfn.kernels import decode_layer
from genfn.models import llama
from genfn.models.rope import apply_rope
from genfn.quant.weight import QuantizedWeight
from test_paged_native import needs_kernel
from conftest import fresh_model, record_native_layers

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FFN = 9, 3, 64, 576, 1536
EPS = 1e-5


def _layer(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.05):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return {"attn_norm": 1 + w(HIDDEN, scale=0.1), "wqkv": w(qkv_rows, HIDDEN), "wo": w(HIDDEN, HEADS * HEAD_DIM),
            "mlp_norm": 1 + w(HIDDEN, scale=0.1), "w_gate_up": w(2 * FFN, HIDDEN), "w_down": w(HIDDEN, FFN)}


def _rope(batch, dtype, seed=1):
    positions = torch.randint(0, 200, (batch, 1), generator=torch.Generator().manual_seed(seed))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)  # [B, 1, D]


def _reference_input(x, layer, cos, sin):
    """The op-by-op layer up to the cache write, rounding once per fused step as inductor does."""
    batch = x.shape[0]
    h = llama._rms_norm(x, layer["attn_norm"], EPS)
    qkv = F.linear(h.float(), layer["wqkv"].float()).to(x.dtype)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q = q.view(batch, 1, HEADS, HEAD_DIM).transpose(1, 2).float()
    k = k.view(batch, 1, KV_HEADS, HEAD_DIM).transpose(1, 2).float()
    q, k = apply_rope(q, cos.float(), sin.float()), apply_rope(k, cos.float(), sin.float())
    return torch.cat([q.transpose(1, 2).reshape(batch, -1), k.transpose(1, 2).reshape(batch, -1),
                      v.reshape(batch, -1).float()], dim=-1).to(x.dtype)


def _reference_output(x, q, keys, values, mask, layer):
    batch = x.shape[0]
    attn = F.scaled_dot_product_attention(q.unsqueeze(2).float(), keys.float(), values.float(),
                                          attn_mask=mask, enable_gqa=True).to(x.dtype)
    o = F.linear(attn.reshape(batch, 1, -1).float(), layer["wo"].float()).to(x.dtype)
    x1 = (x.float() + o.float()).to(x.dtype)
    h = llama._rms_norm(x1, layer["mlp_norm"], EPS)
    gate, up = F.linear(h.float(), layer["w_gate_up"].float()).to(x.dtype).chunk(2, dim=-1)
    act = (F.silu(gate.float()) * up.float()).to(x.dtype)
    down = F.linear(act.float(), layer["w_down"].float()).to(x.dtype)
    return (x1.float() + down.float()).to(x.dtype)


# The native bfloat16 layer dots bfloat16 pairs with vdpbf16ps; without AVX512_BF16 the op refuses
# bfloat16 (genfn then keeps torch's op-by-op bfloat16), so there is nothing of it to test.
needs_bf16_dot = pytest.mark.skipif(not decode_layer._BF16_DOT,
                                    reason="the bfloat16 layer needs AVX512_BF16 (this CPU has none)")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_dot)]
# bfloat16: the reference rounds the attention's probabilities differently (SDPA on float32), so
# an intermediate may land one bfloat16 step away, ~0.03 at the residual stream's magnitude.
TOL = {torch.float32: 2e-5, torch.bfloat16: 6e-2}


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_attention_input_equals_norm_projection_and_rope(dtype, batch):
    layer = _layer(dtype)
    x = torch.randn(batch, 1, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    cos, sin = _rope(batch, dtype)
    out = decode_layer.attention_input(x, layer, cos, sin, EPS, HEADS, KV_HEADS)
    expected = _reference_input(x, layer, cos, sin)
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, span", [(1, 1), (1, 100), (3, 57), (8, 200)])
def test_layer_output_equals_attention_projection_and_mlp(dtype, batch, span):
    """The cache sliced to the attended span (a strided view), a mask with holes (left padding)."""
    gen = torch.Generator().manual_seed(3)
    layer = _layer(dtype, seed=4)
    x = torch.randn(batch, 1, HIDDEN, generator=gen).to(dtype)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    keys = torch.randn(batch, KV_HEADS, 256, HEAD_DIM, generator=gen).to(dtype)[:, :, :span]
    values = torch.randn(batch, KV_HEADS, 256, HEAD_DIM, generator=gen).to(dtype)[:, :, :span]
    mask = torch.rand(batch, 1, 1, span, generator=gen) < 0.7
    mask[..., -1] = True
    out = decode_layer.layer_output(x, q, keys, values, mask, layer, EPS)
    expected = _reference_output(x, q, keys, values, mask, layer)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_kernel
def test_bad_arguments_name_the_op_and_the_argument():
    layer = _layer(torch.float32)
    x = torch.randn(1, 1, HIDDEN)
    cos, sin = _rope(1, torch.float32)
    with pytest.raises(RuntimeError, match="decode_attention_input: wqkv must be"):
        decode_layer.attention_input(x, {**layer, "wqkv": layer["wqkv"][:-1]}, cos, sin, EPS, HEADS, KV_HEADS)
    q = torch.randn(1, HEADS, HEAD_DIM)
    keys = torch.randn(1, KV_HEADS, 8, HEAD_DIM)
    mask = torch.ones(1, 1, 1, 8, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="decode_layer_output: visible must be a bool"):
        decode_layer.layer_output(x, q, keys, keys, mask.float(), layer, EPS)
    rows = decode_layer.MAX_LAYER_ROWS + 1
    with pytest.raises(RuntimeError, match="decode_layer_output: x must be \\[M, hidden\\]"):
        decode_layer.layer_output(torch.randn(rows, 1, HIDDEN), q.expand(rows, -1, -1), keys.expand(rows, -1, -1, -1),
                                  keys.expand(rows, -1, -1, -1), mask.expand(rows, -1, -1, -1), layer, EPS)
    with pytest.raises(RuntimeError, match="decode_layer_output: keys and values must be \\[B, kv_heads"):
        decode_layer.layer_output(torch.randn(3, 1, HIDDEN), q.expand(3, -1, -1), keys.expand(2, -1, -1, -1),
                                  keys.expand(2, -1, -1, -1), mask.expand(3, -1, -1, -1), layer, EPS)


@needs_kernel
def test_what_the_native_layer_does_not_take_runs_op_by_op():
    layer = _layer(torch.float32)
    keys = torch.zeros(1, dtype=torch.float32)
    x = torch.randn(2, 1, HIDDEN)
    assert decode_layer.takes(x, layer, keys, HEAD_DIM)
    assert decode_layer.takes(torch.randn(2, 5, HIDDEN), layer, keys, HEAD_DIM)  # a verification's drafts
    rows = decode_layer.MAX_LAYER_ROWS
    assert decode_layer.takes(torch.randn(rows, 1, HIDDEN), layer, keys, HEAD_DIM)
    assert not decode_layer.takes(torch.randn(rows + 1, 1, HIDDEN), layer, keys, HEAD_DIM)  # a GEMM's work
    assert not decode_layer.takes(torch.randn(1, rows + 1, HIDDEN), layer, keys, HEAD_DIM)  # a prefill
    assert not decode_layer.takes(x, {**layer, "bqkv": torch.zeros(1)}, keys, HEAD_DIM)
    assert not decode_layer.takes(x, layer, keys, 24)  # head_dim not a multiple of 16
    assert not decode_layer.takes(x, layer, keys.bfloat16(), HEAD_DIM)  # cache in another dtype
    quantized = QuantizedWeight.__new__(QuantizedWeight)
    assert not decode_layer.takes(x, {**layer, "w_down": quantized}, keys, HEAD_DIM)
    # Eager bfloat16 keeps transformers' op-by-op rounding; only a compiled step takes it natively.
    bf16 = {name: w.bfloat16() for name, w in layer.items()}
    assert not decode_layer.takes(x.bfloat16(), bf16, keys.bfloat16(), HEAD_DIM)
    with torch.enable_grad():
        assert not decode_layer.takes(x.requires_grad_(), layer, keys, HEAD_DIM)


@pytest.fixture(scope="module")
def tiny_pair_f32():
    from conftest import tiny_pair

    return tiny_pair(seed=7, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)


PROMPTS = torch.tensor([[5, 17, 3, 88, 41, 9], [0, 0, 12, 7, 60, 33], [0, 0, 0, 1, 44, 90]])
GENERATE = dict(attention_mask=(PROMPTS != 0).long(), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                pad_token_id=0, return_dict_in_generate=True, output_logits=True, cache_implementation="static",
                max_cache_len=32, disable_compile=True)


# generate's default growing cache takes the layer as the static one does (its write hands back the
# layer's whole cache); the left-padded rows leave masked slots in both.
CACHES = {"static": {}, "dynamic": {"cache_implementation": None, "max_cache_len": None}}


@needs_kernel
@pytest.mark.parametrize("cache", CACHES)
def test_a_decode_takes_the_native_layer_and_keeps_transformers_tokens(tiny_pair_f32, monkeypatch, cache):
    import genfn

    hf, model = tiny_pair_f32
    settings = {key: value for key, value in {**GENERATE, **CACHES[cache]}.items() if value is not None}
    calls = []
    record_native_layers(monkeypatch, calls)
    ours = genfn.generate(model, PROMPTS, **settings)
    assert calls and all(took for seq, took in calls if seq == 1)  # every decode layer of every step
    assert not any(took for seq, took in calls if seq > 1)  # the prompts' 18 tokens are a prefill
    monkeypatch.setattr(decode_layer, "layer_kind", lambda *a: None)
    plain = genfn.generate(fresh_model(model), PROMPTS, **settings)
    assert torch.equal(ours.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(plain.logits), atol=2e-5, rtol=2e-5)
    with torch.no_grad():
        theirs = hf.generate(PROMPTS, attention_mask=GENERATE["attention_mask"], max_new_tokens=12, min_new_tokens=12,
                             do_sample=False, pad_token_id=0)
    assert torch.equal(ours.sequences, theirs)


def _quantized_layer(fmt, seed=5):
    from genfn.quant.blocks import quantize

    layer = _layer(torch.float32, seed)
    return {name: QuantizedWeight.from_rows(quantize(w, fmt)) if name in decode_layer._LINEARS else w
            for name, w in layer.items()}


def _quantized_reference(x, q, keys, values, mask, layer, cos, sin):
    """The op-by-op quantized layer: the same quant_linear calls between float32 elementwise ops."""
    from genfn.kernels import linear

    batch = x.shape[0]
    h = llama._rms_norm(x, layer["attn_norm"], EPS)
    qkv = linear(h, layer["wqkv"])
    qr, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    qr = apply_rope(qr.view(batch, 1, HEADS, HEAD_DIM).transpose(1, 2), cos, sin)
    k = apply_rope(k.view(batch, 1, KV_HEADS, HEAD_DIM).transpose(1, 2), cos, sin)
    qkv = torch.cat([qr.transpose(1, 2).reshape(batch, -1), k.transpose(1, 2).reshape(batch, -1),
                     v.reshape(batch, -1)], dim=-1)
    attn = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True)
    x1 = x + linear(attn.reshape(batch, 1, -1), layer["wo"])
    gate, up = linear(llama._rms_norm(x1, layer["mlp_norm"], EPS), layer["w_gate_up"]).chunk(2, dim=-1)
    return qkv, x1 + linear(F.silu(gate) * up, layer["w_down"])


needs_vnni = pytest.mark.skipif(not decode_layer._VNNI, reason="the quantized layer needs AVX512_VNNI")


@needs_kernel
@needs_vnni
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "q5_0", "q5_1"])
@pytest.mark.parametrize("batch, span", [(1, 40), (3, 57), (8, 9)])
def test_quantized_layer_equals_the_op_by_op_quantized_layer(fmt, batch, span):
    gen = torch.Generator().manual_seed(6)
    layer = _quantized_layer(fmt)
    x = torch.randn(batch, 1, HIDDEN, generator=gen)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    keys = torch.randn(batch, KV_HEADS, 64, HEAD_DIM, generator=gen)[:, :, :span]
    values = torch.randn(batch, KV_HEADS, 64, HEAD_DIM, generator=gen)[:, :, :span]
    mask = torch.rand(batch, 1, 1, span, generator=gen) < 0.8
    mask[..., -1] = True
    cos, sin = _rope(batch, torch.float32)
    assert decode_layer.takes(x, layer, keys, HEAD_DIM)
    qkv = decode_layer.attention_input(x, layer, cos, sin, EPS, HEADS, KV_HEADS)
    out = decode_layer.layer_output(x, q, keys, values, mask, layer, EPS)
    expected_qkv, expected_out = _quantized_reference(x, q, keys, values, mask, layer, cos, sin)
    torch.testing.assert_close(qkv, expected_qkv, atol=1e-4, rtol=1e-4)
    # Each linear quantizes its input to 8 bits, and float32 sums in another order can move one
    # code of the MLP's inputs by a step (~0.03 of the input's scale): then every output moves a
    # little. A wrong tile, scale or row moves outputs by their own magnitude (~3 here).
    torch.testing.assert_close(out, expected_out, atol=5e-2, rtol=0)
    assert (out - expected_out).abs().mean() < 2e-3


@needs_kernel
@needs_vnni
def test_the_quantized_layer_takes_float32_activations_and_names_bad_weights():
    layer = _quantized_layer("q4_1")
    keys = torch.zeros(1)
    x = torch.randn(1, 1, HIDDEN)
    assert decode_layer.takes(x, layer, keys, HEAD_DIM)
    assert not decode_layer.takes(x.bfloat16(), layer, keys.bfloat16(), HEAD_DIM)
    assert not decode_layer.takes(x, {**layer, "wo": _layer(torch.float32)["wo"]}, keys, HEAD_DIM)  # mixed
    cos, sin = _rope(1, torch.float32)
    wqkv = layer["wqkv"]
    with pytest.raises(RuntimeError, match=r"decode_attention_input_quant: wqkv's kind must be 0 \(q4_0\), .* or 4"):
        torch.ops.genfn_kernels.decode_attention_input_quant(x[:, 0], layer["attn_norm"], wqkv.codes, wqkv.scales,
                                                              wqkv.mins, 7, cos[:, 0], sin[:, 0], EPS, HEADS, KV_HEADS)
    q, cache = torch.randn(1, HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, 8, HEAD_DIM)
    mask = torch.ones(1, 1, 1, 8, dtype=torch.bool)
    short = {**layer, "w_down": _quantized_layer("q4_1")["wo"]}  # [576, 576] where [576, 1536] belongs
    with pytest.raises(RuntimeError, match="decode_layer_output_quant: w_gate_up's codes must be"):
        decode_layer.layer_output(x, q, cache, cache, mask, short, EPS)


@needs_kernel
@needs_vnni
def test_a_quantized_static_cache_decode_takes_the_quantized_layer(tiny_pair_f32, monkeypatch):
    import genfn
    from genfn.models.model import Model
    from genfn.models.quantized import quantize_params

    _, model = tiny_pair_f32
    quantized = Model(model.spec, quantize_params(model.params, "q8_0"), model.apply_fn, model.init_cache_fn)
    calls = []
    record_native_layers(monkeypatch, calls)
    ours = genfn.generate(quantized, PROMPTS, **GENERATE)
    assert calls and all(took for seq, took in calls if seq == 1)
    monkeypatch.setattr(decode_layer, "layer_kind", lambda *a: None)
    plain = genfn.generate(fresh_model(quantized), PROMPTS, **GENERATE)
    # float32 sums in another order can move an activation's 8-bit code by one: close, not equal.
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(plain.logits), atol=2e-3, rtol=2e-3)


def _positions_rope(positions, dtype):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    emb = torch.cat([positions.float().unsqueeze(-1) * inv_freq] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


FORMATS = [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_dot),
    pytest.param("q4_1", marks=needs_vnni), pytest.param("q8_0", marks=needs_vnni)]


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch, seq", [(1, 11), (2, 3), (1, 16), (1, 9), (3, 5)])
def test_a_rows_drafts_get_the_bits_of_each_token_alone(fmt, batch, seq):
    """A verification's S tokens of a row, in one call (keys of the row shared, a causal mask, more
    tokens than a linear group holds), equal each token's own one-token call bit for bit."""
    dtype = torch.float32 if isinstance(fmt, str) else fmt
    layer = _quantized_layer(fmt, seed=8) if isinstance(fmt, str) else _layer(dtype, seed=8)
    inputs = _draft_inputs(batch, seq, HIDDEN, HEADS, KV_HEADS, dtype, seed=9)
    # (Eager bfloat16 takes the ops inside compiled steps only; the ops themselves run here.)
    assert decode_layer.takes(inputs[0], layer, inputs[3], HEAD_DIM) or dtype == torch.bfloat16
    _assert_each_token_gets_its_bits_alone(layer, inputs, HEADS, KV_HEADS)


def _draft_inputs(batch, seq, hidden, heads, kv_heads, dtype=torch.float32, seed=9):
    """x, cos, sin, keys, values, mask and q of S tokens of each of B rows: a verification's drafts,
    at the end of a 40-slot span of each row's cache, under a causal mask with holes."""
    gen = torch.Generator().manual_seed(seed)
    span = 40
    x = torch.randn(batch, seq, hidden, generator=gen).to(dtype)
    cos, sin = _positions_rope(span - seq + torch.arange(seq).expand(batch, seq), dtype)
    keys = torch.randn(batch, kv_heads, 64, HEAD_DIM, generator=gen).to(dtype)[:, :, :span]
    values = torch.randn(batch, kv_heads, 64, HEAD_DIM, generator=gen).to(dtype)[:, :, :span]
    mask = torch.rand(batch, 1, 1, span, generator=gen) < 0.8
    mask = mask & (torch.arange(span) <= span - seq + torch.arange(seq)[:, None])  # [B, 1, S, A], causal
    q = torch.randn(batch * seq, heads, HEAD_DIM, generator=gen).to(dtype)
    return x, cos, sin, keys, values, mask, q


def _assert_each_token_gets_its_bits_alone(layer, inputs, heads, kv_heads):
    """Both calls on all of ``inputs``' tokens at once equal, bit for bit, each token's own calls."""
    x, cos, sin, keys, values, mask, q = inputs
    batch, seq = x.shape[:2]
    qkv = decode_layer.attention_input(x, layer, cos, sin, EPS, heads, kv_heads)
    out = decode_layer.layer_output(x, q, keys, values, mask, layer, EPS)
    assert out.shape == x.shape
    for b in range(batch):
        for s in range(seq):
            token = x[b:b + 1, s:s + 1]
            alone = decode_layer.attention_input(token, layer, cos[b:b + 1, s:s + 1], sin[b:b + 1, s:s + 1], EPS,
                                                 heads, kv_heads)
            assert torch.equal(qkv[b * seq + s], alone[0]), (b, s)
            alone = decode_layer.layer_output(token, q[b * seq + s:b * seq + s + 1], keys[b:b + 1], values[b:b + 1],
                                              mask[b:b + 1, :, s:s + 1], layer, EPS)
            assert torch.equal(out[b, s], alone[0, 0]), (b, s)


@needs_kernel
@pytest.mark.parametrize("fmt", [None, pytest.param("q4_1", marks=needs_vnni)])
def test_prompt_lookup_verifies_in_the_native_layer_and_keeps_greedy_tokens(tiny_pair_f32, monkeypatch, fmt):
    """Quantized activations turn the op-by-op layer's other float32 rounding into other tokens;
    the drafts verified as tokens of the fused layer give greedy's own, every time."""
    import genfn
    from genfn.models.model import Model
    from genfn.models.quantized import quantize_params

    _, model = tiny_pair_f32
    if fmt:
        model = Model(model.spec, quantize_params(model.params, fmt), model.apply_fn, model.init_cache_fn)
    prompt = torch.tensor([[5, 17, 3, 88, 41, 9, 5, 17, 3, 88, 41, 9, 5, 17, 3]])
    settings = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0, cache_implementation="static",
                    max_cache_len=64, disable_compile=True, return_dict_in_generate=True)
    greedy = genfn.generate(model, prompt, **settings)
    seqs = []
    record_native_layers(monkeypatch, seqs)
    looked_up = genfn.generate(model, prompt, prompt_lookup_num_tokens=10, **settings)
    assert any(seq > 1 and took for seq, took in seqs)  # verifications ran in the fused layer
    assert looked_up.acceptance["total_accepted"] > 0
    assert torch.equal(looked_up.sequences, greedy.sequences)


# GGUF K-quant layers: every linear K-quant rows, as a Q4_K_M file mixes them (q/k Q4_K stacked
# beside a Q6_K v, o Q5_K, gate/up Q4_K, down Q6_K), or all of one format. K-quant rows need inputs
# in multiples of 256 (576 is not): a layer of 512 wide, 8 heads over 2 kv heads.
K_HEADS, K_KV_HEADS, K_HIDDEN, K_FFN = 8, 2, 512, 768
K_MIXES = {"q4_k_m": {"wq_k": "q4_k", "wv": "q6_k", "wo": "q5_k", "w_gate_up": "q4_k", "w_down": "q6_k"},
           # as a GGUF load keeps a Q4_K_M layer: its Q4_K matrices interleaved 8 rows to a group
           "q4_k_m_r8": {"wq_k": "q4_k_r8", "wv": "q6_k", "wo": "q4_k_r8", "w_gate_up": "q4_k_r8", "w_down": "q6_k"},
           "q5_k": dict.fromkeys(("wq_k", "wv", "wo", "w_gate_up", "w_down"), "q5_k"),
           "iq4_xs": dict.fromkeys(("wq_k", "wv", "wo", "w_gate_up", "w_down"), "iq4_xs"),
           "iq4_nl": dict.fromkeys(("wq_k", "wv", "wo", "w_gate_up", "w_down"), "iq4_nl")}


def _kquant_layer(mix, seed=10):
    from genfn.quant.kquants import cat_k, quantize_k, repack_r8
    from genfn.quant.stack import RowStack

    gen = torch.Generator().manual_seed(seed)
    formats = K_MIXES[mix]

    def w(rows, cols, name):
        if formats[name] == "q4_k_r8":
            return repack_r8(quantize_k(torch.randn(rows, cols, generator=gen) * 0.05, "q4_k"))
        return quantize_k(torch.randn(rows, cols, generator=gen) * 0.05, formats[name])

    q_k_rows, v_rows = (K_HEADS + K_KV_HEADS) * HEAD_DIM, K_KV_HEADS * HEAD_DIM
    wq_k, wv = w(q_k_rows, K_HIDDEN, "wq_k"), w(v_rows, K_HIDDEN, "wv")
    wqkv = RowStack((wq_k, wv)) if wq_k.format != wv.format else cat_k([wq_k, wv])  # as the loader fuses them
    return {"attn_norm": 1 + torch.randn(K_HIDDEN, generator=gen) * 0.1, "wqkv": wqkv,
            "wo": w(K_HIDDEN, K_HEADS * HEAD_DIM, "wo"), "mlp_norm": 1 + torch.randn(K_HIDDEN, generator=gen) * 0.1,
            "w_gate_up": w(2 * K_FFN, K_HIDDEN, "w_gate_up"), "w_down": w(K_HIDDEN, K_FFN, "w_down")}


@pytest.fixture(params=["avx512", "avx2"])
def kquant_isa(request):
    from genfn.kernels import kquant

    if not kquant.kquant_available():
        pytest.skip(f"the K-quant kernels are {kquant.kquant_status()}")
    if request.param == "avx512" and torch.ops.genfn_kquant.kquant_isa() < 2:
        pytest.skip("this CPU has no AVX-512 path (the avx2 case runs its AVX2 path)")
    kquant.force_isa(request.param)
    yield request.param
    kquant.force_isa(None)


def _layer_rms_norm(x, weight):
    """The fused layer's RMS norm, which is the packed forward's native one (``row_ops.h``: each row's
    squares summed in 16 lanes; torch's mean sums them in another order, a last bit apart, which can
    move an 8-bit input code)."""
    from genfn.kernels import invariant

    return invariant.rms_norm(x, weight, EPS)


@needs_kernel
@pytest.mark.parametrize("mix", list(K_MIXES))
@pytest.mark.parametrize("batch, seq", [(1, 1), (3, 1), (8, 1), (2, 6)])
def test_kquant_layer_equals_the_op_by_op_kquant_layer(kquant_isa, mix, batch, seq):
    """The op-by-op layer's kquant_linear calls (each a RowStack part's own) between float32
    elementwise ops: given the fused layer's norm, its q/k/v projection bit for bit."""
    from genfn.kernels import linear

    layer = _kquant_layer(mix)
    x, cos, sin, keys, values, mask, q = _draft_inputs(batch, seq, K_HIDDEN, K_HEADS, K_KV_HEADS, seed=11)
    assert decode_layer.kquantized(layer) and decode_layer.takes(x, layer, keys, HEAD_DIM)
    qkv = decode_layer.attention_input(x, layer, cos, sin, EPS, K_HEADS, K_KV_HEADS)
    out = decode_layer.layer_output(x, q, keys, values, mask, layer, EPS)
    rows = batch * seq
    expected = linear(_layer_rms_norm(x, layer["attn_norm"]), layer["wqkv"]).reshape(rows, -1)
    q_size, kv_size = K_HEADS * HEAD_DIM, K_KV_HEADS * HEAD_DIM
    qr, k, v = expected.split([q_size, kv_size, kv_size], dim=-1)
    rope = (cos.reshape(rows, 1, HEAD_DIM), sin.reshape(rows, 1, HEAD_DIM))  # each row a batch of one token
    qr = apply_rope(qr.view(rows, 1, K_HEADS, HEAD_DIM).transpose(1, 2), *rope).transpose(1, 2)
    k = apply_rope(k.view(rows, 1, K_KV_HEADS, HEAD_DIM).transpose(1, 2), *rope).transpose(1, 2)
    assert torch.equal(qkv[:, q_size + kv_size:], v)  # the same row kernels on the same 8-bit codes
    # The layer's RoPE rounds a * cos - b * sin once (the compiler fuses a multiply-add), torch twice.
    torch.testing.assert_close(qkv[:, :q_size + kv_size], torch.cat([qr.reshape(rows, -1), k.reshape(rows, -1)], -1),
                               atol=1e-6, rtol=1e-6)
    attn = F.scaled_dot_product_attention(q.view(batch, seq, K_HEADS, HEAD_DIM).transpose(1, 2), keys, values,
                                          attn_mask=mask, enable_gqa=True).transpose(1, 2)
    x1 = x + linear(attn.reshape(batch, seq, -1), layer["wo"])
    gate, up = linear(_layer_rms_norm(x1, layer["mlp_norm"]), layer["w_gate_up"]).chunk(2, dim=-1)
    expected_out = x1 + linear(F.silu(gate) * up, layer["w_down"])
    # The rest is the same linears between ops whose float32 differs in a last bit (SDPA's softmax,
    # the layer's SiLU within 2 ulp of expf), and each last bit can move an 8-bit input code by a
    # step: outputs move by ~1e-3 then; a wrong part, row or scale moves them by their own size (~1).
    torch.testing.assert_close(out, expected_out, atol=2e-2, rtol=0)
    assert (out - expected_out).abs().mean() < 5e-4


@needs_kernel
@pytest.mark.parametrize("mix", list(K_MIXES))
@pytest.mark.parametrize("batch, seq", [(1, 11), (1, 16), (3, 5)])
def test_a_rows_kquant_drafts_get_the_bits_of_each_token_alone(kquant_isa, mix, batch, seq):
    """test_a_rows_drafts_get_the_bits_of_each_token_alone for K-quant layers: the row kernels'
    groups of a call's tokens (11 as 6 and 5, 16 as 8 and 8) give each token its lone step's bits."""
    layer = _kquant_layer(mix, seed=12)
    inputs = _draft_inputs(batch, seq, K_HIDDEN, K_HEADS, K_KV_HEADS, seed=13)
    assert decode_layer.takes(inputs[0], layer, inputs[3], HEAD_DIM)
    _assert_each_token_gets_its_bits_alone(layer, inputs, K_HEADS, K_KV_HEADS)


@needs_kernel
def test_the_kquant_layer_takes_float32_and_names_bad_weights():
    from genfn.kernels import kquant

    if not kquant.kquant_available():
        pytest.skip(f"the K-quant kernels are {kquant.kquant_status()}")
    layer = _kquant_layer("q4_k_m")
    x, cos, sin, keys, values, mask, q = _draft_inputs(1, 1, K_HIDDEN, K_HEADS, K_KV_HEADS, seed=11)
    assert not decode_layer.takes(x.bfloat16(), layer, keys.bfloat16(), HEAD_DIM)
    assert not decode_layer.takes(x, {**layer, "wo": layer["wo"].dequantize()}, keys, HEAD_DIM)  # mixed kinds
    ops = torch.ops.genfn_kernels
    wqkv = layer["wqkv"].parts
    with pytest.raises(RuntimeError, match="decode_attention_input_kquant: wqkv's formats must be"):
        ops.decode_attention_input_kquant(x[:, 0], layer["attn_norm"], [p.data for p in wqkv], [0, 9], cos[:, 0],
                                          sin[:, 0], EPS, K_HEADS, K_KV_HEADS)
    with pytest.raises(RuntimeError, match="decode_attention_input_kquant: wqkv must have 768 rows in all"):
        ops.decode_attention_input_kquant(x[:, 0], layer["attn_norm"], [wqkv[0].data], [0], cos[:, 0], sin[:, 0],
                                          EPS, K_HEADS, K_KV_HEADS)
    short = {**layer, "w_down": layer["wo"]}  # [512, 512] where [512, 768] belongs
    with pytest.raises(RuntimeError, match="decode_layer_output_kquant: w_down's part 0 must be uint8"):
        decode_layer.layer_output(x, q, keys, values, mask, short, EPS)
