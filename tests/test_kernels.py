"""The native decode-step linear: numerics against F.linear, fallbacks, and its op registration."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from genfn import kernels

CAN_BUILD = (sys.platform == "linux" and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
             and shutil.which(os.environ.get("CXX") or "c++") is not None
             and os.environ.get("GENFN_KERNELS", "1") != "0")


def test_kernel_loads_wherever_it_can_be_built():
    # Where the CPU has AVX-512 and a compiler is present the kernel must build and load;
    # elsewhere linear() must say why it fell back.
    assert kernels.decode_linear_available() == CAN_BUILD, kernels.kernel_status()
    if CAN_BUILD:
        assert kernels.kernel_status().startswith("loaded from ")
    else:
        assert not kernels.kernel_status().startswith("loaded")


needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="the decode kernel needs AVX-512 and a C++ compiler")


@pytest.fixture(autouse=True)
def _library_loaded():
    """Several tests call the ops by name (torch.ops.genfn_kernels...), which exist once the library
    is loaded: a test run on its own must not depend on an earlier test having loaded it."""
    if CAN_BUILD:
        assert kernels.decode_linear_available(), kernels.kernel_status()


def _reference(x, w):
    return F.linear(x.double(), w.double())


@needs_kernel
@pytest.mark.parametrize("rows", [*range(1, 12), 16, 33, 64])  # tiles of rows, then panels past 8
@pytest.mark.parametrize("out_features,in_features", [(7, 37), (131, 576), (576, 1536), (4, 16), (9, 5)])
def test_float32_matches_float64_reference(rows, out_features, in_features):
    torch.manual_seed(rows * 1000 + out_features)
    x, w = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    y = torch.ops.genfn_kernels.decode_linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    torch.testing.assert_close(y.double(), _reference(x, w), rtol=1e-5, atol=1e-5 * in_features ** 0.5)
    # Same answer as the library GEMM up to float32 summation order.
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5 * in_features ** 0.5)


@needs_kernel
@pytest.mark.parametrize("rows", [*range(1, 12), 16, 32])
@pytest.mark.parametrize("out_features,in_features", [(131, 576), (33, 40), (576, 1536), (7, 37), (5, 16)])
def test_bfloat16_accumulates_in_float32_and_rounds_once(rows, out_features, in_features):
    torch.manual_seed(rows)
    x = torch.randn(rows, in_features).bfloat16()
    w = (torch.randn(out_features, in_features) * 0.05).bfloat16()
    y = torch.ops.genfn_kernels.decode_linear(x, w)
    assert y.dtype == torch.bfloat16
    exact = _reference(x, w)
    # One rounding to bfloat16 (relative 2**-8) of a float32 sum: far tighter than rounding per step.
    assert torch.all((y.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6 * in_features)


@needs_kernel
def test_linear_routes_few_rows_to_the_kernel_and_the_rest_to_f_linear(monkeypatch):
    calls = []
    op = torch.ops.genfn_kernels.decode_linear
    monkeypatch.setattr(kernels, "_decode_linear_op", lambda x, w: calls.append(x.shape) or op(x, w))
    w, b = torch.randn(24, 32), torch.randn(24)
    few = torch.randn(2, 1, 32)  # [batch, seq, features]: 2 rows
    torch.testing.assert_close(kernels.linear(few, w, b), F.linear(few, w, b))
    verification = torch.randn(1, 11, 32)  # a prompt-lookup round: 11 positions, panels of the weight
    torch.testing.assert_close(kernels.linear(verification, w, b), F.linear(verification, w, b))
    assert calls == [(2, 1, 32), (1, 11, 32)]
    limit = kernels.MAX_LINEAR_ROWS[torch.float32]
    many = torch.randn(limit + 1, 32)  # past the float32 limit: the library GEMM
    assert torch.equal(kernels.linear(many, w, b), F.linear(many, w, b))
    bf16_rows = torch.randn(kernels.MAX_LINEAR_ROWS[torch.bfloat16] + 1, 32).bfloat16()
    assert torch.equal(kernels.linear(bf16_rows, w.bfloat16()), F.linear(bf16_rows, w.bfloat16()))
    half = torch.randn(1, 32).half()  # no half kernel
    assert torch.equal(kernels.linear(half, w.half()), F.linear(half, w.half()))
    assert len(calls) == 2


@needs_kernel
def test_anything_to_be_differentiated_takes_f_linear():
    w = torch.randn(8, 16, requires_grad=True)
    x = torch.randn(1, 16)
    y = kernels.linear(x, w)
    y.sum().backward()
    torch.testing.assert_close(w.grad, x.expand(8, 16))


@needs_kernel
def test_op_registration_passes_torch_opcheck():
    # Schema, fake (meta) implementation and dispatch agree: what torch.compile relies on.
    x, w = torch.randn(3, 40), torch.randn(17, 40)
    torch.library.opcheck(torch.ops.genfn_kernels.decode_linear, (x, w),
                          test_utils=("test_schema", "test_faketensor"))


@needs_kernel
def test_non_contiguous_weight_and_mismatched_features():
    w = torch.randn(40, 24).t()  # [24, 40] view with strides (1, 24)
    x = torch.randn(1, 40)
    torch.testing.assert_close(torch.ops.genfn_kernels.decode_linear(x, w), F.linear(x, w))
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.genfn_kernels.decode_linear(torch.randn(1, 39), torch.randn(8, 40))


def test_without_a_compiler_linear_falls_back_with_a_reason(tmp_path):
    script = textwrap.dedent("""
        import warnings, torch, torch.nn.functional as F
        from genfn import kernels
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            available = kernels.decode_linear_available()
        x, w = torch.randn(1, 16), torch.randn(4, 16)
        assert torch.equal(kernels.linear(x, w), F.linear(x, w))
        print(available, "|", kernels.kernel_status())
    """)
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), GENFN_KERNEL_CACHE=str(tmp_path / "cache"),
               GENFN_KERNEL_PREBUILT=str(tmp_path / "installed"))  # none installed either
    env.pop("GENFN_KERNELS", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    available, status = done.stdout.strip().split(" | ", 1)
    assert available == "False"
    assert "compiler" in status or "AVX-512" in status


def test_genfn_kernels_0_disables_the_kernel():
    script = "from genfn import kernels; print(kernels.decode_linear_available(), kernels.kernel_status())"
    env = dict(os.environ, GENFN_KERNELS="0")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False disabled by GENFN_KERNELS=0"


# ---------------------------------------------------------------------------------------------
# A bfloat16 model: the kernel keeps what F.linear computes (float32 sums, one rounding)


@pytest.fixture(scope="module")
def bf16_model():
    from conftest import tiny_hf_model
    from genfn.models.model import from_hf_state_dict

    hf, config = tiny_hf_model(seed=3, intermediate_size=128, num_hidden_layers=3)
    return from_hf_state_dict(config, hf.state_dict(), dtype=torch.bfloat16)


BF16_PROMPTS = torch.tensor([[5, 17, 3, 88, 41, 9], [0, 0, 12, 7, 60, 33], [0, 0, 0, 1, 44, 90]])
BF16_GENERATE = dict(attention_mask=(BF16_PROMPTS != 0).long(), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                     pad_token_id=0, return_dict_in_generate=True, output_logits=True)


def _without_kernel(monkeypatch):
    monkeypatch.setattr(kernels, "_takes", lambda x, w: False)


@needs_kernel
def test_bfloat16_model_keeps_its_greedy_tokens_and_logits(bf16_model, monkeypatch):
    import genfn

    calls = []
    op = kernels._decode_linear_op
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "_decode_linear_op", lambda x, w: calls.append(w.dtype) or op(x, w))
        ours = genfn.generate(bf16_model, BF16_PROMPTS, **BF16_GENERATE)
    assert calls and set(calls) == {torch.bfloat16}
    with monkeypatch.context() as patch:
        _without_kernel(patch)
        plain = genfn.generate(bf16_model, BF16_PROMPTS, **BF16_GENERATE)
    assert torch.equal(ours.sequences, plain.sequences)
    a, b = torch.stack(ours.logits), torch.stack(plain.logits)
    assert (a - b).abs().max() <= 0.02 * b.abs().max()


@needs_kernel
@pytest.mark.slow
def test_compiled_bfloat16_step_runs_the_kernel(bf16_model, monkeypatch):
    import genfn

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled = genfn.generate(bf16_model, BF16_PROMPTS, cache_implementation="static", max_cache_len=32,
                                  **BF16_GENERATE)
    ops = {event.name for event in prof.events()}
    assert "genfn_kernels::decode_linear" in ops
    from genfn.kernels import decode_layer

    if decode_layer._BF16_DOT:  # the decode step's layers run natively, as one stack (genfn.kernels.decode_layer)
        assert "genfn_kernels::decode_stack" in ops
    with monkeypatch.context() as patch:
        _without_kernel(patch)
        plain = genfn.generate(bf16_model, BF16_PROMPTS, **BF16_GENERATE)
    # Inductor fuses the step's other bfloat16 ops (norms, rotary, softmax) with fewer roundings
    # than eager, so a row may part from eager at a near tie; up to there tokens and logits agree.
    width = BF16_PROMPTS.shape[1]
    a, b = torch.stack(compiled.logits), torch.stack(plain.logits)  # [steps, rows, vocab]
    for row in range(BF16_PROMPTS.shape[0]):
        ours, theirs = compiled.sequences[row, width:], plain.sequences[row, width:]
        differ = (ours != theirs).nonzero()
        upto = int(differ[0]) if len(differ) else len(ours)
        assert upto >= 4, f"row {row} parts from eager at new token {upto}"
        assert (a[:upto + 1, row] - b[:upto + 1, row]).abs().max() <= 0.02 * b[:upto + 1, row].abs().max()
        if upto < len(ours):  # a near tie in eager's own logits
            step = b[upto, row]
            assert step[theirs[upto]] - step[ours[upto]] <= 0.02 * step.abs().max()
