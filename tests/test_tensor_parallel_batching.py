"""Continuous batching and ``max_time`` under tensor parallelism (genfn.batching.tensor_parallel):
two gloo ranks on this machine; rank 0's manager schedules and chooses, rank 1's follows its
engine's commands, and the tokens are one process's.

The ranks are spawned once for the module (tests/tensor_parallel_ranks.py, as in
test_tensor_parallel.py); every wait has a timeout.
"""

from __future__ import annotations

import pytest

from test_tensor_parallel import _result, run_ranks

CHECKS = [("batching", "batching_check", {}), ("early_exit", "early_exit_error_check", {}),
          ("max_time", "max_time_check", {})]


@pytest.fixture(scope="module")
def results():
    return run_ranks(CHECKS)


def test_continuous_batching_tokens_equal_one_process(results):
    leader, follower = _result(results, "batching")
    whole, sharded = leader["whole"], leader["sharded"]
    assert not whole["errors"] and not sharded["errors"], (whole["errors"], sharded["errors"])
    assert None not in whole["tokens"], "a request did not finish on one process"
    for i, (one, split) in enumerate(zip(whole["tokens"], sharded["tokens"])):
        assert split == one, f"request {i}: TP=2 {split} != TP=1 {one}"
    # what the batch exercised, on rank 0 (which schedules): preemption and several steps
    assert sharded["preempted"] > 0 and sharded["steps"] > len(sharded["ids"]), sharded
    assert sharded["role"] == "leader" and not sharded["running"]


def test_generate_batch_returns_rank_0s_outputs(results):
    leader, follower = _result(results, "batching")
    assert len(leader["batch_whole"]) == 4 and leader["batch_sharded"] == leader["batch_whole"]
    assert follower["batch_sharded"] == []  # {} off rank 0: the outputs live on rank 0


def test_the_other_ranks_follow_without_requests(results):
    _, follower = _result(results, "batching")
    sharded = follower["sharded"]
    assert sharded["role"] == "follower"
    assert set(sharded["ids"]) == {None}  # add_request returns None off rank 0, as in transformers
    assert sharded["tokens"] == [None] * len(sharded["ids"]) and sharded["steps"] == 0
    assert not sharded["running"]  # its stop() returned once rank 0's loop had ended


def test_drafting_on_sharded_layers_is_refused_under_tensor_parallelism(results):
    leader, follower = results["early_exit"]
    assert leader.startswith("ValueError") and "assistant_early_exit" in leader and "tensor parallelism" in leader, leader
    assert follower == "no error"  # add_request off rank 0 queues nothing


def test_max_time_is_decided_by_rank_0(results):
    ranks = _result(results, "max_time")
    start = ranks[0]["prompt_len"]
    for rank, result in enumerate(ranks):
        assert result["plenty"] == result["free"], rank  # every step ran, as without max_time
        assert all(len(row) == start + 1 for row in result["none"]), (rank, result["none"])
    assert ranks[0] == ranks[1]


def test_commands_carry_integer_tensors_in_one_buffer():
    import torch

    from genfn.batching.tensor_parallel import pack, unpack

    tensors = [torch.arange(6).reshape(2, 3), torch.tensor([True, False, True]), torch.tensor([-1, 7])]
    buffer, layout = pack(tensors, torch.device("cpu"))
    assert buffer.dtype == torch.int64 and buffer.numel() == 11
    for sent, got in zip(tensors, unpack(buffer, layout)):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    with pytest.raises(TypeError, match="integer or bool"):
        pack([torch.ones(2)], torch.device("cpu"))
