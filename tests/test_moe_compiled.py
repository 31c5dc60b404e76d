"""A compiled step of more rows than the MoE decode kernels take (continuous batching, batch 32)
runs each chosen expert once on the rows that chose it (``genfn_moe::grouped``), not every expert
on every row: its FLOPs are ``k`` experts per row whatever ``E`` is, unchosen experts are never
read (they hold NaN here), and its tokens are the eager ones."""

from __future__ import annotations

import pytest
import torch

import genfn
from conftest import tiny_pair
from genfn.kernels import MAX_DECODE_ROWS
from genfn.models.moe import moe_mlp
from genfn.quant import QuantizedExperts, quantize

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

HIDDEN, INTER, TOP_K = 64, 32, 2
ROWS = MAX_DECODE_ROWS[torch.float32] + 4  # more than the decode kernels take


class Spec:
    experts_per_token, norm_topk_prob = TOP_K, True


def _layer(num_experts: int, chosen: tuple[int, int] = (1, 3)) -> dict:
    """A layer whose router picks ``chosen`` for every row of positive inputs; every other expert
    is NaN, so a step that computed it (even weighted zero) would return NaN."""
    torch.manual_seed(num_experts)
    router = -torch.ones(num_experts, HIDDEN)
    router[chosen[0]], router[chosen[1]] = 2.0, 1.0
    gate_up = torch.randn(num_experts, 2 * INTER, HIDDEN) / 8
    down = torch.randn(num_experts, HIDDEN, INTER) / 8
    unchosen = [e for e in range(num_experts) if e not in chosen]
    gate_up[unchosen], down[unchosen] = float("nan"), float("nan")
    return {"router": router, "experts_gate_up": gate_up, "experts_down": down}


def _matmul_flops(fn, *args) -> int:
    """The profiler's FLOP count of the matrix products ``fn`` ran (elementwise ops left out)."""
    with torch.profiler.profile(with_flops=True) as profile:
        fn(*args)
    return sum(event.flops for event in profile.key_averages() if event.key in ("aten::mm", "aten::addmm"))


@pytest.mark.parametrize("num_experts", [4, 16])
def test_a_compiled_step_runs_only_the_chosen_experts(num_experts):
    layer = _layer(num_experts)
    h = torch.randn(1, ROWS, HIDDEN).abs()
    compiled = torch.compile(lambda x: moe_mlp(Spec, layer, x), backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        eager = moe_mlp(Spec, layer, h)
        out = compiled(h)
        flops = _matmul_flops(compiled, h)
    assert torch.isfinite(out).all()  # the NaN experts were never multiplied
    assert torch.equal(out, eager)
    router = 2 * ROWS * HIDDEN * num_experts
    experts = 2 * ROWS * TOP_K * (HIDDEN * 2 * INTER + INTER * HIDDEN)  # k experts per row, for any E
    assert flops == router + experts


def test_a_compiled_step_of_quantized_experts_equals_eager():
    layer = _layer(8)
    for name in ("experts_gate_up", "experts_down"):
        values = torch.nan_to_num(layer[name], nan=0.0)
        layer[name] = QuantizedExperts.from_blocks(quantize(values.reshape(-1, values.shape[-1]), "q8_0"), 8)
    h = torch.randn(1, ROWS, HIDDEN).abs()
    compiled = torch.compile(lambda x: moe_mlp(Spec, layer, x), backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        eager = moe_mlp(Spec, layer, h)
        with torch.profiler.profile() as profile:
            out = compiled(h)
    assert torch.equal(out, eager)
    assert any(event.key == "genfn_moe::grouped" for event in profile.key_averages())


def test_compiled_decode_of_a_batch_past_the_kernels_equals_eager():
    """Qwen3-MoE at batch 12: the compiled static-cache step (inductor) takes the grouped op."""
    _, gm = tiny_pair("Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 97, (ROWS, 6), generator=g)
    settings = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                    cache_implementation="static", max_cache_len=16)
    eager = genfn.generate(gm, ids, disable_compile=True, **settings)
    compiled = genfn.generate(gm, ids, **settings)
    assert torch.equal(compiled, eager)
    assert len(gm.compiled_steps) == 1
    with torch.profiler.profile() as profile:
        genfn.generate(gm, ids, **settings)
    calls = sum(e.count for e in profile.key_averages() if e.key == "genfn_moe::grouped")
    assert calls >= gm.spec.num_layers  # the compiled steps ran the grouped experts, not the dense loop
