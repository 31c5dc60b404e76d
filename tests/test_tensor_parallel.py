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
ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
CHECKS = [(arch, "arch_check", dict(arch=arch, **({"sliding_window": 5} if arch != "LlamaForCausalLM" else {})))
          for arch in ARCHS]
CHECKS += [("q8_0", "arch_check", dict(arch="LlamaForCausalLM", quantize="q8_0")),
           ("q4_1", "arch_check", dict(arch="LlamaForCausalLM", quantize="q4_1", intermediate_size=128)),
           ("q5_1", "arch_check", dict(arch="LlamaForCausalLM", quantize="q5_1", intermediate_size=128)),
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


@pytest.mark.parametrize("name", [*ARCHS, "q8_0", "q4_1", "q5_1", "uneven"])
def test_tokens_equal_one_process(results, name):
    for rank, result in enumerate(_result(results, name)):
        for mode in ("greedy", "sampled", "beam", "prompt_lookup"):
            whole, sharded = result[mode]
            assert sharded == whole, f"{name} {mode} on rank {rank}: TP=2 {sharded} != TP=1 {whole}"
        assert result["logit_gap"] < 1e-4, f"{name}: logits differ by {result['logit_gap']}"
        if name in ("q8_0", "q4_1", "q5_1"):  # the row-parallel sums chained in one process's order: its bits
            assert result["logit_gap"] == 0 and result["step_gap"] == 0, (result["logit_gap"], result["step_gap"])
        else:
            assert result["step_gap"] < 1e-4, f"{name}: decode steps' logits differ by {result['step_gap']}"


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


@pytest.mark.parametrize("rows", [3, 12])  # one pass of the kernel, and groups of 8 rows
def test_chained_partial_sums_are_the_whole_rows_bits(rows):
    """A row-parallel rank's kernel continuing from the previous ranks' sums gives the whole row's
    result bit for bit (tensor_parallel.row_parallel); adding the parts afterwards does not."""
    from genfn.kernels import quantized_linear
    from genfn.models.tensor_parallel import _narrow
    from genfn.quant.weight import QuantizedWeight

    torch.manual_seed(0)
    blocks = quantize(torch.randn(40, 192), "q4_1")
    x = torch.randn(rows, 192)
    whole = quantized_linear(x, QuantizedWeight.from_rows(blocks))
    cuts = [(0, 64), (64, 96), (96, 192)]
    total = None
    for start, stop in cuts:
        part = QuantizedWeight.from_rows(_narrow(blocks, 1, start, stop, name="w"))
        total = quantized_linear(x[:, start:stop].contiguous(), part, total)
    assert torch.equal(total, whole)
    with pytest.raises(ValueError, match="init must be float32 of the output's shape"):
        quantized_linear(x, QuantizedWeight.from_rows(blocks), torch.zeros(rows, 41))


def test_a_cut_through_a_block_is_refused():
    from genfn.models.tensor_parallel import _narrow

    blocks = quantize(torch.randn(4, 64), "q8_0")
    with pytest.raises(ValueError, match="splits only between its blocks"):
        _narrow(blocks, 1, 0, 48, name="w")


@pytest.fixture(scope="module")
def slow_results():
    return run_ranks([("smollm2", "smollm2_check", {})], timeout=1800)


@pytest.fixture(scope="module")
def compiled_results():
    return run_ranks([("compiled", "arch_check", dict(arch="LlamaForCausalLM", compiled=True))], timeout=1800)


@pytest.mark.slow
def test_smollm2_tokens_equal_one_process(slow_results):
    # SmolLM2's shipped Q4_1 blocks, each rank reading only its slices of the file. Summed in
    # another order than one process's, the row-parallel outputs' rounding differences moved
    # activations across their 8-bit codes and grew to ~1.2 in a logit; chained in its order
    # (tensor_parallel.row_parallel) every logit is one process's.
    for rank, result in enumerate(_result(slow_results, "smollm2")):
        (whole,), (sharded,) = result["greedy"]
        assert sharded == whole, f"rank {rank}: TP=2 {sharded} != TP=1 {whole}"
        gap = max(result["logit_gaps"])
        assert gap < 1e-3, f"rank {rank}: TP=2's logits differ from TP=1's by {gap} (per step: {result['logit_gaps']})"
        assert len(result["logit_gaps"]) == 20
    assert [r["kv_heads"] for r in slow_results["smollm2"]] == [1, 2]  # 3 KV heads over 2 ranks


@pytest.mark.slow
def test_compiled_step_on_every_rank(compiled_results):
    for rank, result in enumerate(_result(compiled_results, "compiled")):
        for mode in ("greedy", "sampled"):
            whole, sharded = result[mode]
            assert sharded == whole, f"compiled {mode} on rank {rank}: TP=2 {sharded} != TP=1 {whole}"
