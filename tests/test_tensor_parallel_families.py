"""Tensor parallelism for the families beyond Llama's plain layer (genfn.models.tensor_parallel):
SmolLM3 (layers without RoPE), OLMo 2 (post-norms, q/k norms over the whole projection),
Phi-3 / Phi-4-mini (fused q/k/v and gate/up, partial rotary, LongRoPE, a sliding window) and
Gemma 2 / Gemma 3 (scaled embedding, pre- and post-norms, soft-capping, sliding and global layers).

Two gloo ranks are spawned once for the module (tests/tensor_parallel_ranks.py); each runs every
family's tiny random model (tests/test_families.py's configs) whole and as its shard, through
``generate`` and through continuous batching. What cannot split is checked in this process.
"""

from __future__ import annotations

import pytest

from test_families import FAMILIES
from test_tensor_parallel import _result, run_ranks

NAMES = ("smollm3", "olmo2", "phi3_window", "phi4_mini", "phi3_longrope", "gemma2", "gemma3")
QUANTIZED = ("phi4_mini", "gemma2")  # Q8_0 blocks: Phi-3's fused matrices cut between their rows of blocks
CHECKS = [(name, "family_check", dict(arch=FAMILIES[name][0], **FAMILIES[name][1])) for name in NAMES]
CHECKS += [(name + "_q8_0", "family_check", dict(arch=FAMILIES[name][0], quantize="q8_0", batch=False,
                                                 **FAMILIES[name][1])) for name in QUANTIZED]


@pytest.fixture(scope="module")
def results():
    return run_ranks(CHECKS)


@pytest.mark.parametrize("name", NAMES)
def test_family_tokens_equal_one_process(results, name):
    for rank, result in enumerate(_result(results, name)):
        whole, sharded = result["greedy"]
        assert sharded == whole, f"{name} greedy on rank {rank}: TP=2 {sharded} != TP=1 {whole}"
        # float weights: the row-parallel sums (and OLMo 2's q/k mean squares) add in another order
        assert result["logit_gap"] < 1e-4 and result["step_gap"] < 1e-4, (result["logit_gap"], result["step_gap"])
        assert result["kv_heads"] == 1  # 2 KV heads over 2 ranks
    leader, follower = (r["batch"] for r in results[name])
    whole, sharded = leader
    assert not whole["errors"] and not sharded["errors"], (whole["errors"], sharded["errors"])
    assert None not in whole["tokens"] and sharded["role"] == "leader"
    for i, (one, split) in enumerate(zip(whole["tokens"], sharded["tokens"])):
        assert split == one, f"{name} request {i} in continuous batching: TP=2 {split} != TP=1 {one}"
    assert sharded["preempted"] > 0, sharded  # the batch was tight enough to preempt and recompute
    assert follower[1]["role"] == "follower" and not follower[1]["running"]


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_family_logits_are_one_process_bits(results, name):
    """Block-quantized linears: the o/down sums chained in one process's order (row_parallel), every
    other op per head or per row: each logit is one process's, bit for bit."""
    for rank, result in enumerate(_result(results, name + "_q8_0")):
        whole, sharded = result["greedy"]
        assert sharded == whole, f"{name} Q8_0 greedy on rank {rank}: TP=2 {sharded} != TP=1 {whole}"
        assert result["logit_gap"] == 0 and result["step_gap"] == 0, (result["logit_gap"], result["step_gap"])


def _spec(name, **overrides):
    from conftest import tiny_hf_model

    from genfn.models import registry

    arch, settings = FAMILIES[name]
    _, config = tiny_hf_model(arch, **{**settings, **overrides})
    return registry.native_family(config).spec_from_config(config)


@pytest.mark.parametrize("name", ["gemma3", "phi4_mini"])
def test_fewer_kv_heads_than_ranks_is_still_refused(name):
    from genfn.models.tensor_parallel import TensorShard, shard_spec

    with pytest.raises(ValueError, match=r"num_key_value_heads=1\).*--tp <= 1"):
        shard_spec(_spec(name, num_key_value_heads=1), TensorShard(0, 2, "g"))


def test_olmo2_norm_weights_and_phi3_fused_rows_are_cut_with_the_heads():
    """Rank 1's pieces of each tensor: OLMo 2's q/k norm weights are its heads' rows; Phi-3's fused
    matrices give it its heads' rows of q, k and v and its slice of gate and of up."""
    from genfn.models.tensor_parallel import TensorShard, slice_plan

    olmo = slice_plan(_spec("olmo2"), TensorShard(1, 2, "g"))  # 4 heads, 2 KV heads of 16: one group each
    assert olmo("model.layers.0.self_attn.q_norm.weight") == ((0, 32, 64),)
    assert olmo("model.layers.0.self_attn.k_norm.weight") == ((0, 16, 32),)
    assert olmo("model.layers.0.post_attention_layernorm.weight") is None  # after the all-reduce: whole
    phi = slice_plan(_spec("phi4_mini"), TensorShard(1, 2, "g"))  # q rows 64, k and v 32 each; MLP 96 in 32s
    assert phi("model.layers.1.self_attn.qkv_proj.weight") == ((0, 32, 64), (0, 80, 96), (0, 112, 128))
    assert phi("model.layers.1.mlp.gate_up_proj.weight") == ((0, 32, 96), (0, 128, 192))
    assert phi("model.layers.1.mlp.down_proj.weight") == ((1, 32, 96),)
    qwen3 = slice_plan(_spec("qwen3"), TensorShard(1, 2, "g"))
    assert qwen3("model.layers.0.self_attn.q_norm.weight") is None  # per head: one weight every head shares
