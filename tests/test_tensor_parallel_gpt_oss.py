"""Tensor parallelism for GPT-OSS (genfn.models.gpt_oss): whole key/value groups of heads per rank
with their q/k/v rows, biases and attention sinks, the biased router whole on every rank, every
expert's intermediate size split (transformers' interleaved gate/up columns cut in pairs), and o's
and the experts' down biases added once, after the all-reduce. Two gloo ranks give one process's
tokens: greedy, sampled with the same key, beam search, prompt lookup, continuous batching, a
GGUF file's MXFP4 experts read slice by slice, the model quantized to Q8_0 (experts too) and (slow)
the compiled decode step.

The ranks are spawned once per module (tests/tensor_parallel_ranks.py); every wait has a timeout.
"""

from __future__ import annotations

import pytest
import torch

from genfn.models.tensor_parallel import TensorShard, shard_spec, slice_plan
from test_tensor_parallel import _result, run_ranks

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tensor_parallel_ranks import GPT_OSS
    from test_gpt_oss import tiny_gpt_oss, write_gpt_oss_gguf

    path = write_gpt_oss_gguf(tmp_path_factory.mktemp("tp_gpt_oss") / "mxfp4.gguf", tiny_gpt_oss(**GPT_OSS),
                              mxfp4=True)
    return run_ranks([("gpt_oss", "gpt_oss_check", dict(gguf_path=str(path))),
                      ("uneven", "gpt_oss_uneven_check", {})])


def test_every_mode_gives_one_process_tokens(results):
    for rank, result in enumerate(_result(results, "gpt_oss")):
        for mode in ("greedy", "sampled", "beam", "prompt_lookup", "gguf", "q8_0"):
            whole, sharded = result[mode]
            assert sharded == whole, f"{mode} on rank {rank}: TP=2 {sharded} != TP=1 {whole}"
        # An o or down bias added on both ranks moves the logits by the bias (~0.3 here), not by rounding.
        assert min(result["bias_sums"]) > 1.0, result["bias_sums"]
        assert result["logit_gap"] < 1e-4 and result["step_gap"] < 1e-4, (result["logit_gap"], result["step_gap"])
        assert result["kv_heads"] == 1 and result["gguf_expert_rows"] == 64  # 32 gate + 32 up rows of each expert
        assert result["q8_0_experts"] == "QuantizedExperts"


def test_an_uneven_head_split_gives_one_process_tokens(results):
    per_rank = _result(results, "uneven")
    assert [result["kv_heads"] for result in per_rank] == [1, 2]  # rank 1: two groups, four heads and sinks
    for rank, result in enumerate(per_rank):
        for mode in ("greedy", "sampled", "beam", "prompt_lookup"):
            whole, sharded = result[mode]
            assert sharded == whole, f"{mode} on rank {rank}: TP=2 {sharded} != TP=1 {whole}"
        assert result["logit_gap"] < 1e-4 and result["step_gap"] < 1e-4, (result["logit_gap"], result["step_gap"])


def test_continuous_batching_gives_one_process_tokens(results):
    leader, follower = _result(results, "gpt_oss")
    whole, sharded = leader["batch"]
    assert not whole["errors"] and not sharded["errors"], (whole["errors"], sharded["errors"])
    assert None not in whole["tokens"], "a request did not finish on one process"
    assert sharded["tokens"] == whole["tokens"]
    assert sharded["role"] == "leader" and follower["batch"][1]["role"] == "follower"


@pytest.mark.slow
def test_compiled_decode_gives_one_process_tokens():
    """The shard's compiled step (functional all-reduces, the gathered experts' path) against the
    whole model's eager one: ~8 minutes of compiling on two loaded cores."""
    results = run_ranks([("compiled", "gpt_oss_compiled_check", {})], timeout=1800)
    for rank, result in enumerate(_result(results, "compiled")):
        for mode in ("greedy", "sampled"):
            whole, sharded = result[mode]
            assert sharded == whole, f"compiled {mode} on rank {rank}: TP=2 {sharded} != TP=1 {whole}"
        assert result["logit_gap"] < 1e-4, result["logit_gap"]


# Sharding itself, in this process (no group needed)


def _spec(**overrides):
    from genfn.models.gpt_oss import spec_from_config
    from tensor_parallel_ranks import GPT_OSS
    from test_gpt_oss import SETTINGS

    config = transformers.GptOssConfig(**{**SETTINGS, **GPT_OSS, **overrides}).to_dict()
    return spec_from_config({**config, "architectures": ["GptOssForCausalLM"]})


def test_heads_sinks_and_expert_pairs_are_split():
    spec = _spec()
    local = shard_spec(spec, TensorShard(1, 2, "g"))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 32)
    plan = slice_plan(spec, TensorShard(1, 2, "g"))
    layer = "model.layers.0."
    assert plan(layer + "self_attn.sinks") == ((0, 2, 4),)  # rank 1's query heads
    assert plan(layer + "self_attn.sinks.weight") == ((0, 2, 4),)  # a GGUF file's name
    assert plan(layer + "self_attn.q_proj.bias") == ((0, 32, 64),)
    assert plan(layer + "self_attn.o_proj.bias") is None  # whole: added once, after the sum
    assert plan(layer + "mlp.router.weight") is None and plan(layer + "mlp.router.bias") is None
    # transformers' [E, H, 2I], gate j and up j in columns 2j, 2j + 1: one run of columns keeps the pairs
    assert plan(layer + "mlp.experts.gate_up_proj") == ((2, 64, 128),)
    assert plan(layer + "mlp.experts.gate_up_proj_bias") == ((1, 64, 128),)
    assert plan(layer + "mlp.experts.down_proj") == ((1, 32, 64),)  # [E, I, H]
    assert plan(layer + "mlp.experts.down_proj_bias") is None
    # a GGUF file's own stacks: gate and up [E, I, H] with biases [E, I], down [E, H, I]
    assert plan(layer + "mlp.experts.gate_proj.weight") == plan(layer + "mlp.experts.up_proj.bias") == ((1, 32, 64),)
    assert plan(layer + "mlp.experts.down_proj.weight") == ((2, 32, 64),)
    assert plan(layer + "mlp.experts.down_proj.bias") is None


def test_sliced_params_are_the_whole_models_slices():
    from genfn.models.model import from_hf_state_dict
    from tensor_parallel_ranks import GPT_OSS
    from test_gpt_oss import tiny_gpt_oss

    hf = tiny_gpt_oss(**GPT_OSS)
    config = {**hf.config.to_dict(), "architectures": ["GptOssForCausalLM"]}
    whole = from_hf_state_dict(config, hf.state_dict()).params["layers"][1]
    for rank in range(2):
        layer = from_hf_state_dict(config, hf.state_dict(), tensor_shard=TensorShard(rank, 2, "g")).params["layers"][1]
        rows = slice(32 * rank, 32 * rank + 32)
        for name in ("experts_gate_up", "experts_gate_up_bias"):  # genfn's layout: gate rows, then up rows
            gate, up = whole[name].split(64, dim=1)
            assert torch.equal(layer[name], torch.cat([gate[:, rows], up[:, rows]], dim=1)), name
        assert torch.equal(layer["experts_down"], whole["experts_down"][:, :, rows])
        assert torch.equal(layer["sinks"], whole["sinks"][2 * rank:2 * rank + 2])
        for name in ("router", "router_bias", "bo", "experts_down_bias"):
            assert torch.equal(layer[name], whole[name]), name


def test_a_gguf_files_mxfp4_experts_are_read_slice_by_slice(tmp_path):
    """Each rank dequantizes only its share of the MXFP4 blocks: the whole file's values, sliced."""
    import genfn
    from tensor_parallel_ranks import GPT_OSS
    from test_gpt_oss import tiny_gpt_oss, write_gpt_oss_gguf

    path = write_gpt_oss_gguf(tmp_path / "mxfp4.gguf", tiny_gpt_oss(**GPT_OSS), mxfp4=True)
    whole = genfn.load(path).params["layers"][0]
    for rank in range(2):
        layer = genfn.load(path, tensor_shard=TensorShard(rank, 2, "g")).params["layers"][0]
        rows = slice(32 * rank, 32 * rank + 32)
        for name in ("experts_gate_up", "experts_gate_up_bias"):
            gate, up = whole[name].split(64, dim=1)
            assert torch.equal(layer[name], torch.cat([gate[:, rows], up[:, rows]], dim=1)), name
        assert torch.equal(layer["experts_down"], whole["experts_down"][:, :, rows])
        assert torch.equal(layer["sinks"], whole["sinks"][2 * rank:2 * rank + 2])
        assert torch.equal(layer["experts_down_bias"], whole["experts_down_bias"])


def test_fewer_kv_heads_than_ranks_is_refused():
    with pytest.raises(ValueError, match=r"num_key_value_heads=1.*--tp <= 1"):
        shard_spec(_spec(num_key_value_heads=1), TensorShard(0, 2, "g"))
