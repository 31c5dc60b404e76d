"""The dense cache's native prefill attention (genfn/kernels/prefill_attention.cpp,
``genfn.kernels.prefill_attention``): many queries per row against a static cache's slots, equal to
``scaled_dot_product_attention`` with the same boolean mask, never reading a tile of keys the mask
hides from a whole tile of queries."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from genfn import kernels
from genfn.cache.static import init_static_cache
from genfn.kernels import packed_gemm
from genfn.kernels.packed_gemm import bf16_gemm_available, bf16_gemm_preferred
from genfn.models.llama import attention_mask
from test_decode_layer import needs_vnni
from test_paged_native import needs_kernel


def _case(batch, heads, kv_heads, seq, span, head_dim, *, pad=0, start=0, window=None, seed=0,
          dtype=torch.float32):
    """q [B, H, S, D] laid out as the model's (heads transposed out of [B, S, H, D]), keys and
    values a prefix slice of a longer cache, and the model's own mask for S queries from slot
    ``start`` with row 0 left-padded by ``pad`` slots."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
    keys = torch.randn(batch, kv_heads, span + 8, head_dim, generator=gen).to(dtype)[:, :, :span]
    values = torch.randn(batch, kv_heads, span + 8, head_dim, generator=gen).to(dtype)[:, :, :span]
    cache = init_static_cache(1, batch, kv_heads, span + 8, head_dim)
    cache.valid[:, :start + seq] = True
    cache.valid[0, :pad] = False
    slots = (start + torch.arange(seq)).expand(batch, seq)
    return q, keys, values, attention_mask(cache, slots, span, window)


def _sdpa(q, keys, values, mask):
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


def _assert_attends_like_sdpa(out, q, keys, values, mask):
    """float32: SDPA's values within float32 rounding. bfloat16: the kernel sums in float32 and
    rounds once, so its output is float32 SDPA's on the same bfloat16 inputs within half a
    bfloat16 step (2^-8 relative; torch's bfloat16 SDPA, which rounds its probabilities, is not)."""
    assert out.dtype == q.dtype
    if q.dtype == torch.float32:
        torch.testing.assert_close(out, _sdpa(q, keys, values, mask), atol=3e-6, rtol=3e-6)
    else:
        expected = _sdpa(q.float(), keys.float(), values.float(), mask)
        torch.testing.assert_close(out.float(), expected, atol=1e-5, rtol=2 ** -8)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, extra", [
    ((1, 9, 3, 130, 130, 64), {}),                      # SmolLM2's heads, a partial last tile of each kind
    ((2, 9, 3, 37, 45, 64), {"pad": 5, "start": 3}),    # left padding, slots filled before the chunk
    ((1, 32, 8, 100, 160, 64), {"start": 60}),          # a later chunk over a filled cache
    ((2, 4, 4, 20, 20, 128), {"pad": 19}),              # padding up to the last slot
    ((2, 6, 2, 17, 17, 16), {}),
    ((1, 8, 1, 33, 40, 256), {"start": 7}),
    ((1, 4, 2, 150, 150, 32), {"window": 24}),          # a sliding window: tiles hidden on both sides
])
def test_prefill_attention_equals_sdpa(shape, extra, dtype):
    q, keys, values, mask = _case(*shape, **extra, dtype=dtype)
    out = kernels.prefill_attention(q, keys, values, mask)
    assert out is not None and out.shape == q.shape
    _assert_attends_like_sdpa(out, q, keys, values, mask)
    # The result lies in [B, S, H, D] memory: the model's reshape to [B, S, H * D] copies nothing.
    assert out.transpose(1, 2).is_contiguous()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tile_hidden_from_every_query_is_never_read(dtype):
    """Causal queries 0..63 never see slots 64.. : NaN there cannot reach them (a kernel that
    computed the hidden tile and masked afterwards would multiply NaN values by zero weights)."""
    q, keys, values, mask = _case(1, 9, 3, 64, 192, 64, start=0, dtype=dtype)
    mask[..., 64:] = False
    keys[:, :, 64:], values[:, :, 64:] = float("nan"), float("nan")
    out = kernels.prefill_attention(q, keys, values, mask)
    clean = [t[:, :, :64] for t in (keys, values)]
    _assert_attends_like_sdpa(out, q, *clean, mask[..., :64])


@needs_kernel
def test_a_query_that_sees_nothing_gets_zeros_not_nan():
    q, keys, values, mask = _case(2, 9, 3, 20, 20, 64)
    mask[0, :, 3] = False
    out = kernels.prefill_attention(q, keys, values, mask)
    assert torch.equal(out[0, :, 3], torch.zeros_like(out[0, :, 3]))
    torch.testing.assert_close(out[1], _sdpa(q, keys, values, mask)[1], atol=3e-6, rtol=3e-6)


@needs_kernel
def test_what_the_kernel_does_not_take_falls_back_to_the_caller():
    q, keys, values, mask = _case(1, 9, 3, 20, 20, 64)
    few = kernels.MIN_PREFILL_QUERIES - 1
    assert kernels.prefill_attention(q[:, :, :few], keys, values, mask[:, :, :few]) is None
    assert kernels.prefill_attention(q.half(), keys.half(), values.half(), mask) is None
    assert kernels.prefill_attention(q.bfloat16(), keys, values, mask) is None  # dtypes that differ
    assert kernels.prefill_attention(q, keys, values, mask.float()) is None  # an additive mask
    with torch.enable_grad():
        assert kernels.prefill_attention(q.requires_grad_(), keys, values, mask) is None


@needs_kernel
def test_bad_arguments_get_a_clear_error():
    q, keys, values, mask = _case(1, 9, 3, 20, 20, 64)
    op = torch.ops.genfn_kernels.prefill_attention
    with pytest.raises(RuntimeError, match="mask must be bool"):
        op(q, keys, values, mask.float(), 0.125)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        op(q[:, :8], keys, values, mask, 0.125)
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16, all one dtype"):
        op(q.double(), keys.double(), values.double(), mask, 0.125)
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16, all one dtype"):
        op(q.bfloat16(), keys, values, mask, 0.125)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_the_op_is_one_graph_node(dtype):
    """Inside ``torch.compile`` the op traces through its fake implementation (strides and dtype
    included: the reshape after it sees the layout the op returns) and returns the eager op's values."""
    q, keys, values, mask = _case(2, 9, 3, 24, 30, 64, pad=4, start=6, dtype=dtype)

    def attend(q, keys, values, mask):
        return kernels.prefill_attention(q, keys, values, mask).transpose(1, 2).reshape(2, 24, -1) * 2

    eager = attend(q, keys, values, mask)  # first: loads the kernels outside the trace
    out = torch.compile(attend, backend="aot_eager", fullgraph=True)(q, keys, values, mask)
    assert out.dtype == dtype
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    expected = _sdpa(q.float(), keys.float(), values.float(), mask).transpose(1, 2).reshape(2, 24, -1) * 2
    tolerance = 6e-6 if dtype == torch.float32 else 2 ** -8  # bfloat16: half a step, as above
    torch.testing.assert_close(out.float(), expected, atol=6e-6, rtol=tolerance)


@needs_kernel
@pytest.mark.parametrize("arch, overrides", [("LlamaForCausalLM", {}), ("MistralForCausalLM", {"sliding_window": 6})])
def test_a_padded_prefill_through_the_kernel_matches_transformers(monkeypatch, arch, overrides):
    """A batch of left-padded 40-token prompts (past MIN_PREFILL_QUERIES, so every layer's
    attention is the native op's): transformers' logits at every real token."""
    from conftest import padded_prompts, tiny_pair
    from genfn.models import llama, prefill_layer

    calls = []

    def counted(*args):
        out = kernels.prefill_attention(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(llama, "prefill_attention", counted)
    monkeypatch.setattr(prefill_layer, "prefill_attention", counted)
    hf, gm = tiny_pair(arch, **overrides)
    ids, mask = padded_prompts(length=40)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        logits, _ = gm.apply(ids, positions, gm.init_cache(ids.shape[0], 48), mask)
    assert calls and all(calls)
    real = mask.bool()
    assert (expected[real] - logits[real]).abs().max() < 1e-4


@needs_kernel
def test_a_layer_to_differentiate_keeps_the_op_by_op_layer():
    """The native ops have no backward: with a norm weight that needs a gradient (or x), under
    grad mode, the layer stays op by op."""
    from conftest import tiny_pair
    from genfn.models import prefill_layer

    _, gm = tiny_pair()
    layer = dict(gm.params["layers"][0])
    x = torch.randn(1, 20, gm.spec.hidden_size)
    with torch.no_grad():
        assert prefill_layer.takes(gm.spec, layer, x)
    with torch.enable_grad():
        assert prefill_layer.takes(gm.spec, layer, x)
        layer["attn_norm"] = layer["attn_norm"].clone().requires_grad_(True)
        assert not prefill_layer.takes(gm.spec, layer, x)
        assert not prefill_layer.takes(gm.spec, dict(gm.params["layers"][0]), x.clone().requires_grad_(True))


@needs_kernel
def test_a_padded_bfloat16_prefill_through_the_native_layer_keeps_transformers_greedy_tokens(monkeypatch):
    """bfloat16 weights and activations, a batch of left-padded 40-token prompts: every layer runs
    the native prefill layer (row ops and attention in bfloat16), and at every real token the
    greedy pick is transformers' (in bfloat16 too), the logits within bfloat16 rounding of its;
    greedy decoding after the prefill gives transformers' tokens."""
    import genfn
    from conftest import padded_prompts, tiny_hf_model
    from genfn.models import prefill_layer
    from genfn.models.model import from_hf_state_dict

    layers = []
    native_layer = prefill_layer.prefill_layer

    def counted(spec, layer, i, x, *args):
        layers.append(x.dtype)
        return native_layer(spec, layer, i, x, *args)

    monkeypatch.setattr(prefill_layer, "prefill_layer", counted)
    gemms = []
    on_gemm = prefill_layer._on_bf16_gemm
    monkeypatch.setattr(prefill_layer, "_on_bf16_gemm", lambda x, w: gemms.append(on_gemm(x, w)) or gemms[-1])
    hf, config = tiny_hf_model()
    hf = hf.to(torch.bfloat16)
    gm = from_hf_state_dict(config, hf.state_dict(), dtype=torch.bfloat16)
    ids, mask = padded_prompts(length=40)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
        logits, _ = gm.apply(ids, positions, gm.init_cache(ids.shape[0], 48), mask)
    assert layers == [torch.bfloat16] * gm.spec.num_layers
    # the four linears of every layer on genfn's bfloat16 GEMM, where it is the faster (no AMX)
    assert gemms == [bf16_gemm_preferred()] * 4 * gm.spec.num_layers
    real = mask.bool()
    assert torch.equal(logits[real].argmax(-1), expected[real].argmax(-1))
    assert (expected[real] - logits[real]).abs().max() < 0.05
    greedy = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(genfn.generate(gm, ids, **greedy), hf.generate(input_ids=ids, **greedy))


@needs_kernel
@pytest.mark.skipif(not bf16_gemm_available(), reason="compares the prefill on genfn's bfloat16 GEMM with torch's: that GEMM needs AVX512_BF16, which this CPU lacks (its prefill runs torch's GEMM, which the test above checks against transformers)")
def test_the_bfloat16_prefill_on_genfn_s_gemm_is_within_rounding_of_torch_s():
    """The native layer's linears on genfn's GEMM (and SwiGLU fused into gate/up) against the same
    layer on torch's GEMM and the separate SwiGLU pass: both sum in float32 and round once, in
    another order, so the logits agree within bfloat16 rounding, and the greedy picks agree."""
    from conftest import padded_prompts, tiny_hf_model
    from genfn.models import prefill_layer
    from genfn.models.model import from_hf_state_dict

    hf, config = tiny_hf_model()
    gm = from_hf_state_dict(config, hf.to(torch.bfloat16).state_dict(), dtype=torch.bfloat16)
    ids, mask = padded_prompts(length=40)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = {}
    for on_gemm in (True, False):
        with pytest.MonkeyPatch.context() as patch, torch.no_grad():
            # genfn's GEMM where it is built, also on a CPU with AMX (where oneDNN's is the default)
            patch.setattr(packed_gemm, "_ONEDNN_AMX_BF16", not on_gemm)
            if not on_gemm:
                patch.setattr(prefill_layer, "_on_bf16_gemm", lambda x, w: False)
            logits[on_gemm], _ = gm.apply(ids, positions, gm.init_cache(ids.shape[0], 48), mask)
    real = mask.bool()
    ours, torchs = logits[True][real].float(), logits[False][real].float()
    assert not torch.equal(ours, torchs)  # the paths differ, so the comparison means something
    assert (ours - torchs).abs().max() <= 4 * 2 ** -8 * torchs.abs().max()
    assert torch.equal(ours.argmax(-1), torchs.argmax(-1))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad, seq", [(5, 40), (61, 70), (64, 130), (3, 17)])
def test_a_left_padded_row_gets_the_bits_of_its_prompt_alone(dtype, pad, seq):
    """Key tiles start at a row's first visible slot, so a prompt left-padded by ``pad`` slots in a
    batch (its keys shifted against slot 0) gets, query for query, the bits it gets alone; before, a
    query's sums grouped its keys by where they fell in tiles counted from slot 0."""
    gen = torch.Generator().manual_seed(8)
    heads, kv_heads, head_dim = 9, 3, 64
    q = torch.randn(1, seq, heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
    keys = torch.randn(1, kv_heads, seq, head_dim, generator=gen).to(dtype)
    values = torch.randn(1, kv_heads, seq, head_dim, generator=gen).to(dtype)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril().view(1, 1, seq, seq)
    alone = kernels.prefill_attention(q, keys, values, causal)
    # The same prompt as row 1 of a batch, after `pad` padding slots whose keys hold other values.
    span = pad + seq
    padded_q = torch.randn(2, seq, heads, head_dim, generator=gen).to(dtype).transpose(1, 2).contiguous()
    padded_q[1] = q[0]
    padded_keys = torch.randn(2, kv_heads, span, head_dim, generator=gen).to(dtype)
    padded_values = torch.randn(2, kv_heads, span, head_dim, generator=gen).to(dtype)
    padded_keys[1, :, pad:], padded_values[1, :, pad:] = keys[0], values[0]
    mask = torch.zeros(2, 1, seq, span, dtype=torch.bool)
    mask[:, :, :, pad:] = causal[0]
    mask[0, :, :, :] |= torch.ones(seq, span, dtype=torch.bool).tril(pad)  # row 0: its own longer context
    batched = kernels.prefill_attention(padded_q, padded_keys, padded_values, mask)
    assert torch.equal(batched[1], alone[0])


@needs_kernel
@needs_vnni
@pytest.mark.parametrize("short_len", [50, 9])
def test_generate_gives_a_left_padded_q4_1_row_its_logits_alone(short_len):
    """Block-quantized layers (a row's products the same at any row count): a row left-padded in a
    batch beside a prompt of 110 tokens gets the logits it gets alone at every step, bit for bit.
    A prompt of at least MIN_PREFILL_QUERIES tokens takes the prefill kernel either way, its key
    tiles starting at its first real slot; a shorter one runs alone as a few-token forward whose
    queries walk their keys (the native decode layer), and its queries walk them in the batch too
    (``prefill_layer.prefill_rows``). Its decode steps walk its keys as alone."""
    import genfn
    from conftest import tiny_pair
    from genfn.models.model import Model
    from genfn.models.quantized import quantize_params

    # head_dim 64, SmolLM2's: with 16 a short row's prefill-kernel sums happened to equal its walk's.
    _, model = tiny_pair(seed=7, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    model = Model(model.spec, quantize_params(model.params, "q4_1"), model.apply_fn, model.init_cache_fn)
    gen = torch.Generator().manual_seed(3)
    short, long = torch.randint(3, 97, (short_len,), generator=gen), torch.randint(3, 97, (110,), generator=gen)
    settings = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, return_dict_in_generate=True,
                    output_logits=True, disable_compile=True)
    alone = genfn.generate(model, short[None], **settings)
    ids = torch.zeros(2, 110, dtype=torch.long)
    ids[0, 110 - short_len:], ids[1] = short, long
    batched = genfn.generate(model, ids, attention_mask=(ids != 0).long(), pad_token_id=0, **settings)
    assert torch.equal(torch.stack([step[0] for step in batched.logits]), torch.stack([s[0] for s in alone.logits]))


def test_prefill_rows_walks_the_rows_that_would_run_alone_as_few_token_forwards():
    """A forward of MIN_PREFILL_QUERIES tokens a row or more walks the rows of fewer real tokens
    (left padding counts for nothing), and starts each row's key tiles at its first real slot."""
    from genfn.kernels import MIN_PREFILL_QUERIES
    from genfn.models.prefill_layer import prefill_rows

    seq = MIN_PREFILL_QUERIES + 3
    cache = init_static_cache(1, 3, 2, 32, 16)
    real = torch.tensor([seq, MIN_PREFILL_QUERIES - 1, MIN_PREFILL_QUERIES])
    attention = (torch.arange(seq) >= seq - real.unsqueeze(1)).long()  # left-padded rows
    cache.valid[:, :seq] = attention.bool()
    plan = prefill_rows(cache, attention, seq, 32)
    assert plan.walked.tolist() == [1]
    assert plan.first_slots.tolist() == (seq - real).tolist()
    assert prefill_rows(cache, None, seq, 32).walked is None  # no mask: every row is all real tokens
    assert prefill_rows(cache, attention[:, :MIN_PREFILL_QUERIES - 1], MIN_PREFILL_QUERIES - 1, 32) is None
