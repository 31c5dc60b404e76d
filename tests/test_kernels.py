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


def _reference(x, w):
    return F.linear(x.double(), w.double())


@needs_kernel
@pytest.mark.parametrize("rows", range(1, 9))
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
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_features,in_features", [(131, 576), (33, 40), (576, 1536)])
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
    assert calls == [(2, 1, 32)]
    many = torch.randn(3, 3, 32)  # 9 rows: past the float32 limit of 8
    assert torch.equal(kernels.linear(many, w, b), F.linear(many, w, b))
    bf16_rows = torch.randn(5, 32).bfloat16()  # past the bfloat16 limit of 4
    assert torch.equal(kernels.linear(bf16_rows, w.bfloat16()), F.linear(bf16_rows, w.bfloat16()))
    half = torch.randn(1, 32).half()  # no half kernel
    assert torch.equal(kernels.linear(half, w.half()), F.linear(half, w.half()))
    assert len(calls) == 1


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
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), GENFN_KERNEL_CACHE=str(tmp_path / "cache"))
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
