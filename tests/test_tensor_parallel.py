"""Tensor parallelism (genfn.models.tensor_parallel): two gloo ranks on this machine give the
tokens one process gives, for every Llama-family architecture, decoding mode and weight format.

The ranks are spawned once for the module; each runs every check on its shard and on the whole
model and sends both results back (tests/tensor_parallel_ranks.py).
"""

from __future__ import annotations

import queue
import socket

import pytest
import torch
import torch.multiprocessing as mp

from genfn.models.tensor_parallel import TensorShard, shard_spec, shard_state_dict, vocab_range
from genfn.quant.blocks import quantize

WORLD = 2
ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
CHECKS = [(arch, "arch_check", dict(arch=arch, **({"sliding_window": 5} if arch != "LlamaForCausalLM" else {})))
          for arch in ARCHS]
CHECKS += [("q8_0", "arch_check", dict(arch="LlamaForCausalLM", quantize="q8_0")),
           ("q4_1", "arch_check", dict(arch="LlamaForCausalLM", quantize="q4_1", intermediate_size=128)),
           ("uneven", "arch_check", dict(arch="LlamaForCausalLM", num_attention_heads=6, num_key_value_heads=3,
                                         hidden_size=96, vocab_size=101)),
           ("kv_error", "kv_error_check", {})]
TIMEOUT = 600  # seconds for the whole module's ranks (a few dozen on an idle machine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(checks: list, world: int = WORLD, timeout: float = TIMEOUT) -> dict:
    """``{check name: [result of rank 0, rank 1, ...]}`` from ``world`` spawned ranks."""
    from tensor_parallel_ranks import run_rank

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=run_rank, args=(rank, world, port, checks, results), daemon=True)
             for rank in range(world)]
    for p in procs:
        p.start()
    out: dict = {}
    finished = 0
    try:
        while finished < world:
            try:
                rank, name, result = results.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(f"tensor-parallel ranks sent nothing for {timeout} s")
            if name is None:
                finished += 1
            else:
                out.setdefault(name, [None] * world)[rank] = result
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(CHECKS)


def _result(results, name) -> list:
    per_rank = results[name]
    for rank, result in enumerate(per_rank):
        assert not isinstance(result, str), f"rank {rank} raised in {name}: {result}"
    return per_rank


@pytest.mark.parametrize("name", [*ARCHS, "q8_0", "q4_1", "uneven"])
def test_tokens_equal_one_process(results, name):
    for rank, result in enumerate(_result(results, name)):
        for mode in ("greedy", "sampled", "beam", "prompt_lookup"):
            whole, sharded = result[mode]
            assert sharded == whole, f"{name} {mode} on rank {rank}: TP=2 {sharded} != TP=1 {whole}"
        assert result["logit_gap"] < 1e-4, f"{name}: logits differ by {result['logit_gap']}"


def test_ranks_hold_their_heads(results):
    assert [r["kv_heads"] for r in _result(results, "LlamaForCausalLM")] == [1, 1]
    assert [r["kv_heads"] for r in _result(results, "uneven")] == [1, 2]  # 3 KV heads: whole groups, as even as possible


def test_fewer_kv_heads_than_ranks_is_a_clear_error(results):
    for message in results["kv_error"]:
        assert message.startswith("ValueError") and "num_key_value_heads=1" in message and "--tp" in message


# Sharding itself, in this process (no group needed)


def _spec(**overrides):
    from conftest import tiny_hf_model

    from genfn.models.llama import spec_from_config

    _, config = tiny_hf_model(**overrides)
    return spec_from_config(config)


def test_shard_specs_cover_the_model():
    spec = _spec(num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=96, vocab_size=101)
    shards = [shard_spec(spec, TensorShard(r, 2, "g")) for r in range(2)]
    assert sum(s.num_kv_heads for s in shards) == 3 and sum(s.num_heads for s in shards) == 6
    assert sum(s.intermediate_size for s in shards) == 96 and all(s.vocab_size == 101 for s in shards)
    assert [vocab_range(101, TensorShard(r, 2, "g")) for r in range(2)] == [(0, 51), (51, 101)]


def test_quantized_matrices_split_between_blocks():
    from conftest import tiny_hf_model

    hf_model, config = tiny_hf_model(intermediate_size=128)
    down = hf_model.state_dict()["model.layers.0.mlp.down_proj.weight"]
    blocks = quantize(down, "q4_1")
    spec = _spec(intermediate_size=128)
    halves = [shard_state_dict(spec, {"model.layers.0.mlp.down_proj.weight": blocks}, TensorShard(r, 2, "g"))
              ["model.layers.0.mlp.down_proj.weight"] for r in range(2)]
    # each rank holds whole blocks: its columns' codes, scales and minimums unchanged
    assert torch.equal(torch.cat([h.codes for h in halves], dim=1), blocks.codes)
    assert torch.equal(torch.cat([h.scales for h in halves], dim=1), blocks.scales)
    assert torch.equal(torch.cat([h.mins for h in halves], dim=1), blocks.mins)


def test_a_cut_through_a_block_is_refused():
    from genfn.models.tensor_parallel import _narrow

    blocks = quantize(torch.randn(4, 64), "q8_0")
    with pytest.raises(ValueError, match="splits only between its blocks"):
        _narrow(blocks, 1, 0, 48, name="w")


@pytest.fixture(scope="module")
def slow_results():
    return run_ranks([("smollm2", "smollm2_check", {}),
                      ("compiled", "arch_check", dict(arch="LlamaForCausalLM", compiled=True))], timeout=1800)


@pytest.mark.slow
def test_smollm2_tokens_equal_one_process(slow_results):
    # SmolLM2's Q4_1 blocks: TP=2's logits differ from TP=1's by up to ~1.2 here (measured on this
    # CPU at the wave-3 commits alike; likely the quantized kernels' per-row activation scales,
    # which a row-parallel rank takes over half a row; a wrong shard gives garbage, far beyond the
    # bound). Greedy tokens must agree except where TP=1's two best tokens are closer than
    # that difference (a tie the two layouts may break differently).
    for rank, result in enumerate(_result(slow_results, "smollm2")):
        (whole,), (sharded,) = result["greedy"]
        start = result["prompt_len"]
        first = next((i for i, (a, b) in enumerate(zip(whole[start:], sharded[start:])) if a != b), None)
        same_context = result["logit_gaps"][:None if first is None else first + 1]  # later steps read other tokens
        gap = max(same_context)
        assert gap < 2.0, f"rank {rank}: TP=2's logits differ from TP=1's by {gap} (per step: {same_context})"
        if first is not None:
            assert result["margins"][first] < 2 * gap, (
                f"rank {rank}: TP=2 {sharded} != TP=1 {whole} at generated token {first}, where TP=1's best token "
                f"led by {result['margins'][first]:.4g} (the layouts' logits differ by at most {gap:.3g})")
        assert len(sharded) == len(whole)
    assert [r["kv_heads"] for r in slow_results["smollm2"]] == [1, 2]  # 3 KV heads over 2 ranks


@pytest.mark.slow
def test_compiled_step_on_every_rank(slow_results):
    for rank, result in enumerate(_result(slow_results, "compiled")):
        for mode in ("greedy", "sampled"):
            whole, sharded = result[mode]
            assert sharded == whole, f"compiled {mode} on rank {rank}: TP=2 {sharded} != TP=1 {whole}"
