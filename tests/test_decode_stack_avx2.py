"""The decode stack built for CPUs without AVX-512 (native.DECODE_AVX2: decode_stack.cpp with lanes16.h's
two-register lanes, plain_rows.h's blocks and tiles_avx2.h's tiles): in a process that runs as such a
CPU (genfn.bench.avx2), the stack of plain float32, tiles16, K-quant and mixed layers, dense and paged,
gives the AVX-512 library's bits and cache, and a bfloat16 stack the AVX-512 library's widening path's;
the attention and token ops give this process's bits; generate's logits, prompt lookup's included, are
this process's bit for bit, for a block-quantized model and a float32 one, and so are the batch-invariant
mode's; coded bfloat16 layers, which it has no linears for, its table refuses by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import genfn
from genfn import kernels
from genfn.kernels import decode_layer, kquant, native
from test_decode_layer import EPS, HEAD_DIM, K_HEADS, K_KV_HEADS
from test_decode_stack import _stack_layers, _step_inputs
from test_paged_stack import _paged_copy
from conftest import tiny_hf_model
from genfn.models.model import from_hf_state_dict
from genfn.strategies.assisted import propose_prompt_lookup
from test_tiles_avx2 import build_case_model

needs_both = pytest.mark.skipif(
    not (kernels.decode_stack_isa() == "avx512" and native.cpu_has("avx512_vnni") and native.cpu_has("avx2")
         and kquant.kquant_available() and native.plan(native.DECODE_AVX2).action != "no compiler"),
    reason="compares the AVX2 build with the AVX-512 decode library (a CPU with both, a compiler)")

# Every kind of layer the AVX2 build runs: plain float32, each tile kind, K-quant rows (their 8-row
# repacking, IQ4_XS), and a stack that mixes them.
STACKS = {"plain": ("plain", "plain"), "tiles": ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0"),
          "kquant": ("q4_k_m", "q4_k_m_r8", "iq4_xs"), "mixed": ("q4_1", "plain", "q4_k_m", "q8_0")}
# One row, a batch of rows, drafts of two rows (10 rows: two groups of the linears), with a sliding window.
STEPS = ((1, 1, None), (3, 1, None), (2, 5, None), (2, 5, 6))


def stack_cases() -> dict:
    """Each stack's output and written cache for each step, dense and paged; a stack of two plain
    bfloat16 layers too (the AVX-512 library's widening path: the AVX2 build has no vdpbf16ps)."""
    out = {}
    bfloat16 = [{n: w.bfloat16() for n, w in layer.items()} for layer in _stack_layers(("plain", "plain"))]
    cases = [(name, _stack_layers(kinds), torch.float32) for name, kinds in STACKS.items()]
    for name, layers, dtype in cases + [("bfloat16", bfloat16, torch.bfloat16)]:
        table = decode_layer.stack_table(layers, dtype, K_HEADS, K_KV_HEADS, HEAD_DIM)
        assert table is not None, name
        for batch, seq, window in STEPS:
            x, cos, sin, keys, values, slots, visible = (t.to(dtype) if t.is_floating_point() else t
                                                         for t in _step_inputs(batch, seq, len(layers)))
            (paged_keys, paged_values), inputs, paged_visible, _ = _paged_copy(keys, values, slots, window)
            paged_keys, paged_values = paged_keys.to(dtype), paged_values.to(dtype)
            if window is None:
                dense = decode_layer.run_stack(x, table, len(layers), cos, sin, keys, values, slots, visible, EPS)
                out[name, batch, seq, "dense"] = (dense, keys, values)
            rows = batch * seq
            paged = decode_layer.run_paged_stack(x.reshape(rows, -1), table, len(layers), cos.reshape(rows, -1),
                                                 sin.reshape(rows, -1), paged_keys, paged_values, inputs, EPS, window)
            out[name, batch, seq, window] = (paged, paged_keys, paged_values)
    return out


def attention_cases() -> dict:
    """The stack's attention op over head_dims of one to four 16-lane slices, float32 and bfloat16: at one
    slice a score is a single product's lanes summed, which a compiler left to fuse products into
    the sum's first additions gave other bits than the AVX-512 library's."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for head_dim in (16, 32, 64):
        for dtype in (torch.float32, torch.bfloat16):
            q, keys, values = (torch.randn(*shape, head_dim, generator=gen).to(dtype)
                               for shape in ((2, 4), (2, 2, 48), (2, 2, 48)))
            visible = torch.arange(48)[None] < torch.tensor([[21], [40]])
            out[head_dim, dtype] = torch.ops.genfn_kernels.dense_decode_attention(q, keys, values, visible,
                                                                                  head_dim ** -0.5)
    return out


def prefill_attention_cases() -> dict:
    """The prefill attention op over causal prompts with a left-padded row and holes, one and two key
    tiles, head_dims of one to eight 16-lane slices, float32 and bfloat16."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for batch, heads, kv_heads, seq, span, head_dim in ((2, 9, 3, 100, 130, 64), (1, 8, 2, 77, 77, 128),
                                                             (2, 4, 2, 33, 50, 16)):
            q = torch.randn(batch, heads, seq, head_dim, generator=gen).to(dtype)
            keys, values = (torch.randn(batch, kv_heads, span, head_dim, generator=gen).to(dtype) for _ in range(2))
            mask = (torch.arange(span) <= torch.arange(span - seq, span)[:, None]).expand(batch, 1, seq, span).clone()
            mask[1:, :, :, :5] = False
            mask[..., 3] &= torch.rand(seq, generator=gen) < 0.5
            out[dtype, heads, seq, head_dim] = torch.ops.genfn_kernels.prefill_attention(q, keys, values, mask,
                                                                                         head_dim ** -0.5, None)
    return out


def token_op_cases() -> dict:
    """The token ops (``token_ops.cpp``, ``lookup_ops.cpp``) on rows whose widths leave a partial last
    16 lanes: norms, RoPE and SwiGLU in float32 and bfloat16; the greedy pick and logsumexp over rows
    with a tie, a NaN and no finite value; a prompt-lookup proposal."""
    ops = torch.ops.genfn_kernels
    gen = torch.Generator().manual_seed(1)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, delta = (torch.randn(5, 70, generator=gen).to(dtype) for _ in range(2))
        weight = (1 + 0.1 * torch.randn(70, generator=gen)).to(dtype)
        qkv = torch.randn(3, 8 * 16, generator=gen).to(dtype)
        cos, sin = (torch.randn(3, 16, generator=gen).to(dtype) for _ in range(2))
        out["rms_norm", dtype] = ops.rms_norm(x, weight, EPS)
        out["add_rms_norm", dtype] = ops.add_rms_norm(x, delta, weight, EPS)
        out["rope_qkv", dtype] = ops.rope_qkv(qkv, cos, sin, 4, 2)
        out["silu_mul", dtype] = ops.silu_mul(torch.randn(3, 2 * 40, generator=gen).to(dtype))
    logits = torch.randn(4, 1003, generator=gen)
    logits[1, 7] = logits[1, 900] = 50.0
    logits[2, 33] = float("nan")
    logits[3] = float("-inf")
    out["max_logsumexp"] = ops.max_logsumexp(logits)
    out["argmax_rows"] = ops.argmax_rows(logits)
    tokens = torch.tensor([[5, 17, 3, 9, 5, 17, 3, 4, 5, 17], [1, 2, 3, 1, 2, 3, 1, 2, 0, 0]])
    out["prompt_lookup"] = propose_prompt_lookup(tokens, torch.tensor([10, 8]), 3)
    return out


def prefill_linear_case() -> dict:
    """A bfloat16 product of a prefill's rows through ``genfn.kernels.linear``, and the float32 GEMM of
    the widened values rounded once."""
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(40, 1024, generator=gen).bfloat16(), torch.randn(72, 1024, generator=gen).bfloat16()
    # 300 rows of 4096: widened in panels of 256 rows and one of 44, with a bias.
    wide_x, wide = torch.randn(2, 20, 4096, generator=gen).bfloat16(), torch.randn(300, 4096, generator=gen).bfloat16()
    bias = torch.randn(300, generator=gen).bfloat16()
    return {"linear": kernels.linear(x, weight),
            "float32": torch.nn.functional.linear(x.float(), weight.float()).bfloat16(),
            "panels": kernels.linear(wide_x, wide, bias),
            "panels_float64": torch.nn.functional.linear(wide_x.double(), wide.double(), bias.double())}


def invariant_cases() -> dict:
    """The batch-invariant mode's greedy logits for a tiles model and a float32 model, a prompt long
    enough to be a prefill."""
    hf, config = tiny_hf_model(seed=4, intermediate_size=128, num_hidden_layers=3)
    ids = torch.tensor([[5, 17, 3, 5, 17, 3] * 4, [1, 2, 3, 4] * 6])
    out = {}
    for name, model in (("tiles", build_case_model()), ("float32", from_hf_state_dict(config, hf.state_dict()))):
        with genfn.deterministic():
            done = genfn.generate(model, ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
                                  disable_compile=True, return_dict_in_generate=True, output_logits=True)
        out[name] = (done.sequences, torch.stack(done.logits))
    return out


def generate_cases() -> dict:
    """A tiles model's and a float32 model's greedy tokens and logits, and their tokens with prompt lookup
    (verification steps of several rows)."""
    hf, config = tiny_hf_model(seed=4, intermediate_size=128, num_hidden_layers=3)
    return {"tiles": _generate_case(build_case_model()),
            "float32": _generate_case(from_hf_state_dict(config, hf.state_dict()))}


def _generate_case(model) -> dict:
    # 12 prompt tokens: the prefill too is one step of the stack; 48 (a left-padded row among them): a
    # prefill of the native prefill layer and attention
    ids = torch.tensor([[5, 17, 3, 5, 17, 3], [1, 2, 3, 1, 2, 3]])
    long_ids = torch.cat([torch.arange(5, 29).repeat(2)[None], torch.cat([torch.zeros(6, dtype=torch.long),
                                                                          torch.arange(40, 82)])[None]])
    settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0, disable_compile=True)
    greedy = genfn.generate(model, ids, **settings, return_dict_in_generate=True, output_logits=True)
    lookup = genfn.generate(model, ids, **settings, prompt_lookup_num_tokens=3)
    long = genfn.generate(model, long_ids, attention_mask=(long_ids != 0).long(), **settings,
                          return_dict_in_generate=True, output_logits=True)
    return {"greedy": (greedy.sequences, torch.stack(greedy.logits)), "lookup": lookup,
            "long": (long.sequences, torch.stack(long.logits))}


_AS_AVX2_CPU = """
import torch
from genfn.bench.avx2 import run_as_avx2_cpu
run_as_avx2_cpu()
from genfn import kernels
from genfn.kernels import decode_layer
from test_decode_layer import HEAD_DIM, K_HEADS, K_HIDDEN, K_KV_HEADS
from test_decode_stack import _plain_layer
from test_decode_stack_avx2 import (attention_cases, generate_cases, invariant_cases, prefill_attention_cases,
                                    prefill_linear_case, stack_cases, token_op_cases)
layer = _plain_layer(0)
try:  # a coded bfloat16 layer (kind 4): refused before its tensors are read
    torch.ops.genfn_kernels.decode_stack_table([layer["attn_norm"].bfloat16()], [4], torch.bfloat16, K_HIDDEN, K_HEADS,
                                               K_KV_HEADS, HEAD_DIM)
    refusal = None
except RuntimeError as error:
    refusal = str(error)
torch.save({"isa": kernels.decode_stack_isa(), "decode_library": kernels.decode_linear_available(),
            "refusal": refusal, "attention": attention_cases(), "token_ops": token_op_cases(),
            "prefill_linear": prefill_linear_case(), "prefill_attention": prefill_attention_cases(),
            "invariant": invariant_cases(), "stacks": stack_cases(), "generate": generate_cases()}, PATH)
"""


@pytest.fixture(scope="module")
def as_avx2_cpu(tmp_path_factory):
    """What a process that runs as a CPU without AVX-512 computed (torch's own kernels as here, so that
    only genfn's libraries differ)."""
    result = tmp_path_factory.mktemp("avx2") / "out.pt"
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent), str(here)]))
    script = _AS_AVX2_CPU.replace("PATH", repr(str(result)))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(result, weights_only=False)


def _assert_same_bits(here: dict, there: dict, nan_where_nan: bool = False) -> None:
    """Each case's tensor (or tuple of them) here equals there's, value for value; with
    ``nan_where_nan``, a NaN may stand where the other has one (a row with one)."""
    assert there.keys() == here.keys()
    for case, out in here.items():
        mine, theirs = (o if isinstance(o, tuple) else (o,) for o in (out, there[case]))
        assert len(mine) == len(theirs), case
        for a, b in zip(mine, theirs):
            same = torch.equal(a, b) or (nan_where_nan and torch.equal(a.isnan(), b.isnan())
                                         and torch.equal(a[~a.isnan()], b[~b.isnan()]))
            assert same, case


@needs_both
def test_the_process_runs_the_avx2_build_of_the_stack_alone(as_avx2_cpu):
    assert as_avx2_cpu["isa"] == "avx2"
    assert as_avx2_cpu["decode_library"] is False


@needs_both
def test_the_avx2_stack_gives_the_avx512_stacks_bits_and_cache(as_avx2_cpu):
    kernels.force_bf16_linear_path("widen")
    try:
        here = stack_cases()
    finally:
        kernels.force_bf16_linear_path(None)
    _assert_same_bits(here, as_avx2_cpu["stacks"])


@needs_both
def test_the_avx2_attention_gives_the_avx512_bits_at_every_head_dim(as_avx2_cpu):
    _assert_same_bits(attention_cases(), as_avx2_cpu["attention"])


@needs_both
def test_the_avx2_prefill_attention_gives_the_avx512_bits(as_avx2_cpu):
    _assert_same_bits(prefill_attention_cases(), as_avx2_cpu["prefill_attention"])


@needs_both
def test_the_avx2_token_ops_give_the_avx512_bits(as_avx2_cpu):
    _assert_same_bits(token_op_cases(), as_avx2_cpu["token_ops"], nan_where_nan=True)


@needs_both
def test_a_bfloat16_prefill_product_on_avx2_is_a_float32_gemm_rounded_once(as_avx2_cpu):
    """oneDNN has no fast bfloat16 GEMM without AVX-512: the product runs in float32 there."""
    case = as_avx2_cpu["prefill_linear"]
    assert case["linear"].dtype == torch.bfloat16 and torch.equal(case["linear"], case["float32"])
    # A matrix past one panel of widened rows: every output the float64 product's within its rounding
    # to bfloat16 (and float32's sums, far finer).
    panels, expected = case["panels"], case["panels_float64"]
    assert panels.dtype == torch.bfloat16 and panels.shape == (2, 20, 300)
    torch.testing.assert_close(panels.double(), expected, rtol=2**-8, atol=1e-3)


@pytest.mark.parametrize("isa,bf16_instructions,widened", [("avx2", False, True), ("avx512", False, True),
                                                          ("avx512", True, False), (None, False, True)])
def test_a_bfloat16_gemm_is_widened_wherever_the_cpu_lacks_bfloat16_instructions(monkeypatch, isa, bf16_instructions,
                                                                                 widened):
    """oneDNN's bfloat16 GEMM emulates the products on an AVX-512 CPU without AVX512_BF16 too (Skylake-SP
    to Ice Lake): the widened float32 GEMM takes over there as on AVX2; with the instructions it stays."""
    monkeypatch.setattr(kernels, "decode_stack_isa", lambda: isa)
    monkeypatch.setattr(native, "cpu_has", lambda feature: bf16_instructions if feature == "avx512_bf16" else True)
    x, weight = torch.randn(40, 64).bfloat16(), torch.randn(24, 64).bfloat16()
    assert kernels._bf16_through_float32(x, weight) is widened
    assert not kernels._bf16_through_float32(x.float(), weight.float())


@needs_both
@pytest.mark.parametrize("model", ["tiles", "float32"])
def test_the_batch_invariant_mode_on_avx2_gives_the_avx512_logits(as_avx2_cpu, model):
    here, there = invariant_cases()[model], as_avx2_cpu["invariant"][model]
    assert torch.equal(there[0], here[0])
    assert torch.equal(there[1], here[1])


@needs_both
@pytest.mark.parametrize("model", ["tiles", "float32"])
def test_generate_on_the_avx2_stack_gives_this_processs_logits_and_lookups_tokens(as_avx2_cpu, model):
    here, there = generate_cases()[model], as_avx2_cpu["generate"][model]
    assert torch.equal(there["greedy"][0], here["greedy"][0])
    assert torch.equal(there["greedy"][1], here["greedy"][1])
    # verification steps of several rows: the greedy tokens, as everywhere
    assert torch.equal(there["lookup"], here["lookup"]) and torch.equal(here["lookup"], here["greedy"][0])
    assert torch.equal(there["long"][0], here["long"][0]) and torch.equal(there["long"][1], here["long"][1])


@needs_both
def test_coded_layers_are_not_the_avx2_builds_and_its_table_says_so(as_avx2_cpu):
    assert "AVX512_BF16" in as_avx2_cpu["refusal"] and "decode_stack_table" in as_avx2_cpu["refusal"]
