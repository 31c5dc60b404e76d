"""K-quants (Q4_K, Q5_K, Q6_K; IQ4_NL and IQ4_XS too, test_iq4.py has theirs alone) kept as the file
stores them: dequantization bit for bit against the gguf package, the native kernel (both ISA paths)
against the torch reference, and a GGUF model with K-quant tensors against the same weights run
through the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

import genfn
from conftest import (finish_gguf, fresh_model, gguf_writer, llama_cpp_permute, record_native_layers,
                      tiny_hf_model)
from genfn import kernels
from genfn.kernels import kquant
from genfn.models.loaders.gguf import read_gguf
from genfn.quant import K_FORMATS, KQuantWeight, RowStack, dequantize_k, quantize_k, reference_linear_k
from genfn.quant.kquants import BLOCK_BYTES, INTERLEAVED, quantize_activations_k, unpack_k, unpack_r8

GGML = {fmt.lower(): fmt for fmt in ("Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")}
NATIVE = kquant.kquant_available()
needs_native = pytest.mark.skipif(not NATIVE, reason=f"the K-quant kernels are {kquant.kquant_status()}")


def _gguf_values(data: torch.Tensor, fmt: str) -> torch.Tensor:
    raw = gguf_dequantize(data.numpy(), GGMLQuantizationType[GGML[fmt]])
    return torch.from_numpy(np.asarray(raw, dtype=np.float32))


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_dequantization_equals_the_gguf_package_bit_for_bit(fmt):
    torch.manual_seed(0)
    weight = quantize_k(torch.randn(19, 768) * 3, fmt)
    assert torch.equal(weight.dequantize(), _gguf_values(weight.data, fmt).reshape(19, 768))
    # Any bytes at all (scales of every magnitude, every code), not only what quantize_k writes.
    raw = torch.randint(0, 256, (11, 3 * BLOCK_BYTES[fmt]), dtype=torch.uint8)
    with np.errstate(invalid="ignore", over="ignore"):  # random float16 scales include inf and nan
        theirs = _gguf_values(raw, fmt)
    ours = dequantize_k(raw, fmt)
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours.nan_to_num(), theirs.nan_to_num())


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_round_to_nearest_blocks_stay_close_to_the_weights(fmt):
    torch.manual_seed(1)
    w = torch.randn(8, 512)
    error = (quantize_k(w, fmt).dequantize() - w).abs().max() / w.abs().max()
    assert error < {"q4_k": 0.15, "q5_k": 0.08, "q6_k": 0.04, "iq4_nl": 0.12, "iq4_xs": 0.12}[fmt]


def test_activations_quantize_as_llama_cpps_q8_k():
    x = torch.zeros(1, 512)
    x[0, 3], x[0, 7], x[0, 9] = 2.0, -2.0, 0.5  # ties on magnitude: the first one maps to -127
    x[0, 300] = -1.0
    codes, scale = quantize_activations_k(x)
    assert codes[0, 0, 3] == -127 and codes[0, 0, 7] == 127 and codes[0, 0, 9] == round(-127 * 0.25)
    assert scale[0, 0] == pytest.approx(-2.0 / 127) and codes[0, 1, 300 - 256] == -127
    assert torch.equal(quantize_activations_k(torch.zeros(2, 256))[0], torch.zeros(2, 1, 256))


def _in_order(codes: torch.Tensor, order: int) -> torch.Tensor:
    """Natural codes [M, K] laid out as kquant.h's order `order` (whole 128s only)."""
    if order == 0:
        return codes
    run, sources = {1: (32, (0, 64, 32, 96)), 2: (16, (0, 32, 64, 96, 16, 48, 80, 112))}[order]
    out = codes.clone()
    for start in range(0, codes.shape[1] - 127, 128):
        out[:, start:start + 128] = torch.cat([codes[:, start + s:start + s + run] for s in sources], 1)
    return out


@needs_native
@pytest.mark.parametrize("form", ["plain", "avx512"])
@pytest.mark.parametrize("block, order", [(256, 0), (256, 1), (32, 0), (32, 2)])
def test_both_forms_of_the_native_activation_quantization_are_the_reference_bit_for_bit(form, block, order):
    # The AVX-512 form (max of magnitudes, the first input of that magnitude, a rounding multiply)
    # must give the plain loop's bits: a code one off, a tie taken by the wrong input, a sum or a
    # run of the order misplaced would all show here.
    if form == "avx512" and torch.ops.genfn_kquant.kquant_isa() < 2:
        pytest.skip("this CPU has no AVX-512 form to run (the plain case runs)")
    torch.manual_seed(9)
    K = 1024 + (32 if block == 32 else 0)  # block 32: a tail short of 128 stays natural
    x = torch.randn(4, K) * 3
    x[0, 5], x[0, 20] = 20.0, -20.0  # a tie on the largest magnitude: the first maps to -127
    x[1, :block] = 0.0  # an all-zero block
    x[2] = torch.round(x[2] * 2) / 2  # products that land on halves
    codes, scale, sums = torch.ops.genfn_kquant.kquant_quantize_activations(x, block, order, form == "avx512")
    expected_codes, expected_scale = quantize_activations_k(x, block)
    natural = expected_codes.reshape(4, K).to(torch.int8)
    assert torch.equal(codes, _in_order(natural, order))
    assert torch.equal(scale, expected_scale)
    assert torch.equal(sums, natural.reshape(4, K // 16, 16).sum(-1).to(torch.int16))
    assert natural[0, 5] == -127 and natural[0, 20] == 127 and not natural[1, :block].any()  # what was planted


def test_kquant_weight_checks_its_bytes():
    with pytest.raises(ValueError, match="q4_k data must be uint8"):
        KQuantWeight(torch.zeros(4, 100, dtype=torch.uint8), "q4_k", 4, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        KQuantWeight(torch.zeros(4, 144, dtype=torch.uint8), "q4_k", 4, 200)
    with pytest.raises(ValueError, match="one of q4_k, q5_k, q6_k"):
        quantize_k(torch.zeros(4, 256), "q3_k")


def _ggml_q4_k_codes(u: np.ndarray) -> np.ndarray:
    """The 128 code bytes of one Q4_K super-block holding codes ``u`` (256 values, 0..15), as ggml's
    ``dequantize_row_q4_K`` reads them: 32 bytes per 64 inputs, low nibbles first."""
    u = u.reshape(4, 2, 32)
    return (u[:, 0] | (u[:, 1] << 4)).reshape(-1).astype(np.uint8)


def _ggml_q6_k_codes(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ql, qh) of one Q6_K super-block holding codes ``u`` (256 values, 0..63), as ggml's
    ``dequantize_row_q6_K`` reads them: per half of 128, ql[l] holds inputs l and l + 64 (low
    nibbles), ql[l + 32] inputs l + 32 and l + 96, qh[l] the four inputs' top two bits."""
    ql, qh = np.zeros(128, np.uint8), np.zeros(64, np.uint8)
    for half in range(2):
        q = u[half * 128:(half + 1) * 128]
        for lane in range(32):
            a, b, c, d = (int(q[lane + 32 * i]) for i in range(4))
            ql[half * 64 + lane] = (a & 15) | (c & 15) << 4
            ql[half * 64 + lane + 32] = (b & 15) | (d & 15) << 4
            qh[half * 32 + lane] = (a >> 4) | (b >> 4) << 2 | (c >> 4) << 4 | (d >> 4) << 6
    return ql, qh


def test_unpack_k_gives_each_inputs_code_in_ggmls_layout():
    rng = np.random.default_rng(0)
    u4, u6 = rng.integers(0, 16, 256), rng.integers(0, 64, 256)
    scale_bytes = rng.integers(0, 256, 12).astype(np.uint8)
    q4_k = np.concatenate([np.frombuffer(np.float16([0.5, 0.25]).tobytes(), np.uint8), scale_bytes, _ggml_q4_k_codes(u4)])
    fields = unpack_k(torch.from_numpy(q4_k), "q4_k")
    assert fields["codes"].tolist() == [u4.tolist()]
    assert fields["d"].tolist() == [[0.5]] and fields["dmin"].tolist() == [[0.25]]
    assert int(fields["scales"].max()) < 64 and int(fields["mins"].max()) < 64
    ql, qh = _ggml_q6_k_codes(u6)
    sub_scales = rng.integers(-128, 128, 16).astype(np.int8)
    q6_k = np.concatenate([ql, qh, sub_scales.view(np.uint8), np.frombuffer(np.float16([2.0]).tobytes(), np.uint8)])
    fields = unpack_k(torch.from_numpy(q6_k), "q6_k")
    assert fields["codes"].tolist() == [u6.tolist()]
    assert fields["scales"].tolist() == [sub_scales.tolist()] and fields["d"].tolist() == [[2.0]]
    # and the values are the gguf package's, from those fields
    expected = _gguf_values(torch.from_numpy(q6_k).reshape(1, -1), "q6_k")
    assert torch.equal(dequantize_k(torch.from_numpy(q6_k).reshape(1, -1), "q6_k"), expected)
    with pytest.raises(ValueError, match="'q4_k', 'q5_k', 'q6_k'"):
        unpack_k(torch.zeros(1, 18, dtype=torch.uint8), "iq4_nl")


@pytest.fixture(params=["avx512", "avx2"])
def isa(request):
    if not NATIVE:
        pytest.skip(f"the K-quant kernels are {kquant.kquant_status()}")
    best = torch.ops.genfn_kquant.kquant_isa()
    if request.param == "avx512" and best < 2:
        pytest.skip("this CPU has no AVX-512 path to run (the avx2 case of this test runs its AVX2 path)")
    kquant.force_isa(request.param)
    yield request.param
    kquant.force_isa(None)


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_kernel_matches_the_reference_for_1_to_33_rows(isa, fmt):
    torch.manual_seed(2)
    weight = quantize_k(torch.randn(37, 512), fmt)
    x = torch.randn(33, 512) * 4
    full = reference_linear_k(x, weight)
    for rows in range(1, 34):
        y = kernels.linear(x[:rows], weight)
        torch.testing.assert_close(y, full[:rows], rtol=1e-5, atol=1e-5 * full.abs().max().item())


@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("out_features,in_features,lead", [(1, 256, (3,)), (17, 768, (2, 5)), (130, 1280, (1,))])
def test_kernel_matches_the_reference_on_odd_shapes(isa, fmt, out_features, in_features, lead):
    torch.manual_seed(3)
    weight = quantize_k(torch.randn(out_features, in_features), fmt)
    x = torch.randn(*lead, in_features)
    x[..., :256] = 0  # a block of zeros has scale 0
    y = kernels.linear(x, weight, torch.ones(out_features))
    expected = reference_linear_k(x, weight) + 1
    assert y.shape == (*lead, out_features)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "iq4_xs", "iq4_nl", "q4_k_r8", "iq4_xs_r8"])
def test_every_weight_row_is_summed_once_whatever_the_thread_count(isa, fmt):
    # The row kernels share a weight's rows out balanced (row_queue.h): threads claim chunks of
    # their own run and steal from the back of the others'. A row skipped or claimed twice, a
    # chunk cut wrong at a run's end, would leave garbage or a different sum; every row's result
    # is one thread's sum, so it is the same bits at any thread count (here more threads than the
    # 2-core machine has, and more than some runs have chunks). The threads also share out the
    # quantization of x's rows in spans of 256 inputs (128 for iq4_nl), a single row too: a span
    # skipped or cut wrong would leave stale codes. q4_k_r8 (whole groups of 8 rows): a group is
    # written by the claim that holds its first row.
    torch.manual_seed(4)
    weight = quantize_k(torch.randn(304 if fmt.endswith("_r8") else 301, 512), fmt)
    x = torch.randn(9, 512)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = {rows: kernels.linear(x[:rows], weight) for rows in (1, 9)}
        for threads in (2, 3, 7):
            torch.set_num_threads(threads)
            for rows, expected in alone.items():
                assert torch.equal(kernels.linear(x[:rows], weight), expected), (threads, rows)
    finally:
        torch.set_num_threads(before)
    expected = reference_linear_k(x, weight)
    torch.testing.assert_close(alone[9], expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@needs_native
def test_kernel_takes_bfloat16_activations_and_rejects_mismatches():
    weight = quantize_k(torch.randn(8, 256), "q6_k")
    x = torch.randn(2, 256)
    y = kernels.linear(x.bfloat16(), weight)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), reference_linear_k(x.bfloat16().float(), weight), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="x has 512 features"):
        kernels.linear(torch.randn(1, 512), weight)
    with pytest.raises(RuntimeError, match="format must be 0"):
        torch.ops.genfn_kquant.kquant_linear(x, weight.data, 9, 8)
    with pytest.raises(RuntimeError, match="rows hold 100 bytes, not 210"):
        torch.ops.genfn_kquant.kquant_linear(x, weight.data[:, :100], 2, 8)
    with pytest.raises(ValueError, match="isa must be"):
        kquant.force_isa("sse")


@needs_native
def test_op_registration_passes_torch_opcheck():
    weight = quantize_k(torch.randn(16, 256), "q4_k")
    torch.library.opcheck(torch.ops.genfn_kquant.kquant_linear.default, (torch.randn(3, 256), weight.data, 0, 16),
                          test_utils=("test_schema", "test_faketensor"))


def test_fusing_keeps_k_blocks_and_stacks_mixed_formats():
    from genfn.quant.fuse import cat_rows

    q, k = quantize_k(torch.randn(8, 256), "q4_k"), quantize_k(torch.randn(4, 256), "q4_k")
    v = quantize_k(torch.randn(4, 256), "q6_k")
    fused = cat_rows([q, k])
    assert isinstance(fused, KQuantWeight) and torch.equal(fused.data, torch.cat([q.data, k.data]))
    mixed = cat_rows([q, k, v])
    assert isinstance(mixed, RowStack) and mixed.shape == (16, 256)
    assert [p.format for p in mixed.parts] == ["q4_k", "q6_k"]
    torch.testing.assert_close(mixed.dequantize(), torch.cat([q.dequantize(), k.dequantize(), v.dequantize()]))
    x = torch.randn(2, 256)
    torch.testing.assert_close(kernels.linear(x, mixed), torch.cat([reference_linear_k(x, p) for p in (fused, v)], -1),
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# A model written as GGUF with K-quant tensors

# A Q4_K_M-like mix: q/k/gate/up Q4_K, v and down Q6_K (so q/k/v fuse into a stack), o Q5_K, the
# output matrix Q6_K, the embedding Q4_K.
_TYPES = {"attn_q": "q4_k", "attn_k": "q4_k", "attn_v": "q6_k", "attn_output": "q5_k", "ffn_gate": "q4_k",
          "ffn_up": "q4_k", "ffn_down": "q6_k", "output": "q6_k", "token_embd": "q4_k"}
_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def write_kquant_gguf(path, hf_model, types: dict[str, str] = _TYPES) -> None:
    """``hf_model`` as a llama GGUF file, the matrices ``types`` names (GGUF stem -> format) quantized."""
    cfg = hf_model.config
    writer = gguf_writer(path, "llama", cfg)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.head_dim)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a tied model's file has no output.weight: its embedding is the head
        stem = name.removesuffix(".weight")
        layer = None
        if stem.startswith("model.layers."):
            _, _, layer, stem = stem.split(".", 3)
        part = _NAMES[stem]
        values = tensor.numpy().astype(np.float32)
        if part == "attn_q":
            values = llama_cpp_permute(values, cfg.num_attention_heads)
        elif part == "attn_k":
            values = llama_cpp_permute(values, cfg.num_key_value_heads)
        gguf_name = f"blk.{layer}.{part}.weight" if layer is not None else f"{part}.weight"
        if part in types:
            blocks = quantize_k(torch.from_numpy(values), types[part]).data.numpy()
            writer.add_tensor(gguf_name, blocks, raw_dtype=GGMLQuantizationType[GGML[types[part]]])
        else:
            writer.add_tensor(gguf_name, values)
    finish_gguf(writer)


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory):
    hf, _ = tiny_hf_model(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf"
    write_kquant_gguf(path, hf)
    return path


def _dequantized(params):
    def dense(value):
        return value.dequantize() if isinstance(value, (KQuantWeight, RowStack)) else value

    layers = [{k: dense(v) for k, v in layer.items()} for layer in params["layers"]]
    return {**params, "embed": dense(params["embed"]), "lm_head": dense(params["lm_head"]), "layers": layers}


def assert_the_files_blocks_are_kept(model, path, embed_format: str) -> None:
    """The embedding table stays in the file's ``embed_format`` (a lookup dequantizes only its rows)
    and the last layer's down projection holds the file's bytes (interleaved where its format is
    q6_k_r8: put back as stored, byte for byte)."""
    table = model.params["embed"]
    assert isinstance(table, KQuantWeight) and table.format == embed_format
    tokens = torch.tensor([[3, 299, 3], [0, 17, 42]])
    assert torch.equal(kernels.embedding(tokens, table, torch.float32), table.dequantize()[tokens])
    raw = read_gguf(str(path)).raw("blk.1.ffn_down.weight")
    down = model.params["layers"][1]["w_down"]
    if down.format in INTERLEAVED:
        down = unpack_r8(down)
    assert np.array_equal(down.data.numpy(), raw)


def greedy_with_logits(model, steps: int):
    """``steps`` greedy tokens (and their logits) after one fixed prompt, eagerly."""
    prompt = torch.tensor([[5, 17, 3, 88, 41, 9, 250, 7]])
    return genfn.generate(model, prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                          return_dict_in_generate=True, output_logits=True, disable_compile=True)


def native_and_reference(model, monkeypatch, steps: int):
    """``greedy_with_logits`` on the native kernels and on the same arithmetic in torch (dequantized
    weights, activations quantized as the kernel does), which must choose the same tokens."""
    native = greedy_with_logits(model, steps)
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "kquant_linear", reference_linear_k)
        reference = greedy_with_logits(model, steps)
    assert torch.equal(native.sequences, reference.sequences)
    return native, reference


def test_gguf_k_quant_model_keeps_the_files_blocks_and_decodes_as_the_reference(kquant_file, monkeypatch):
    model = genfn.load(kquant_file, quantize="gguf")
    layer = model.params["layers"][0]
    # A layer's Q4_K and Q5_K matrices are repacked 8 rows to a group for the decode kernels (q4_k_r8,
    # q5_k_r8), its Q6_K ones where q6_k_r8's kernel runs.
    q6 = "q6_k_r8" if kquant.group_kernel_runs("q6_k_r8") else "q6_k"
    assert isinstance(layer["wqkv"], RowStack) and [p.format for p in layer["wqkv"].parts] == ["q4_k_r8", q6]
    assert layer["wo"].format == "q5_k_r8" and layer["w_gate_up"].format == "q4_k_r8" and layer["w_down"].format == q6
    assert isinstance(model.params["lm_head"], KQuantWeight) and model.params["lm_head"].format == "q6_k"
    assert_the_files_blocks_are_kept(model, kquant_file, "q4_k")
    native, reference = native_and_reference(model, monkeypatch, steps=8)
    torch.testing.assert_close(torch.stack(native.logits), torch.stack(reference.logits), rtol=1e-4, atol=1e-4)
    # Against float linears on the dequantized weights (no activation rounding) the logits differ
    # by the 8-bit activations' rounding only.
    model.params = _dequantized(model.params)
    plain = greedy_with_logits(model, steps=8)
    native_logits, plain_logits = torch.stack(native.logits), torch.stack(plain.logits)
    assert (native_logits - plain_logits).abs().max() < 0.05 * plain_logits.abs().max()


@needs_native
@pytest.mark.slow
def test_compiled_step_runs_the_k_quant_kernel_and_embedding_lookup(kquant_file):
    model = genfn.load(kquant_file, quantize="gguf")
    prompt = torch.tensor([[5, 17, 3, 88], [9, 250, 7, 1]])
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    compiled = genfn.generate(model, prompt, cache_implementation="static", max_cache_len=32, **kw)
    eager = genfn.generate(model, prompt, disable_compile=True, **kw)
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), rtol=1e-4, atol=1e-4)


@needs_native
def test_a_k_quant_static_cache_decode_takes_the_fused_layer_and_keeps_its_tokens(kquant_file, monkeypatch):
    """Every decode step of the Q4_K_M-like file (q/k Q4_K beside a Q6_K v, o Q5_K, down Q6_K) runs
    the fused K-quant layer, with the op-by-op layer's greedy tokens; prompt lookup verifies its
    drafts in the fused layer, each as its own step, and keeps greedy's tokens."""
    from genfn.kernels import decode_layer

    if not kernels.decode_linear_available():
        pytest.skip(f"the decode kernels are {kernels.kernel_status()}")
    model = genfn.load(kquant_file, quantize="gguf")
    # 18 tokens, a prefill on either side (up to 16 would take the fused layer's row kernels, whose
    # bits differ from the op-by-op GEMM's at 16 rows by a few ulp).
    prompt = torch.tensor([[5, 17, 3, 88, 41, 9, 250, 7, 5, 17, 3, 88, 41, 9, 250, 7, 5, 17]])

    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, return_dict_in_generate=True,
              output_logits=True, cache_implementation="static", max_cache_len=48, disable_compile=True)
    calls = []
    record_native_layers(monkeypatch, calls)
    fused = genfn.generate(model, prompt, **kw)
    assert calls and all(took for seq, took in calls if seq == 1)
    looked_up = genfn.generate(model, prompt, prompt_lookup_num_tokens=6, **{**kw, "output_logits": False})
    assert any(seq > 1 and took for seq, took in calls)  # verifications ran in the fused layer
    assert torch.equal(looked_up.sequences, fused.sequences)
    monkeypatch.setattr(decode_layer, "layer_kind", lambda *a: None)
    plain = genfn.generate(fresh_model(model), prompt, **kw)
    assert torch.equal(fused.sequences, plain.sequences)
    # The layer's norm, RoPE and SiLU round a last bit otherwise than torch's ops, which can move an
    # 8-bit activation code by a step: the logits are close, not equal.
    torch.testing.assert_close(torch.stack(fused.logits), torch.stack(plain.logits), atol=2e-3, rtol=2e-3)
