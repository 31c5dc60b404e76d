"""The shared-memory all-reduce of tensor-parallel ranks on one machine (genfn/local_all_reduce.py):
gloo's sums bit for bit, the fallback past its slots, and a peer that leaves named, not waited for.
The whole models' tokens under it are the tests/test_tensor_parallel*.py checks, which run over it."""

from __future__ import annotations

import multiprocessing as mp
import queue

import pytest
from test_tensor_parallel import _free_port, run_ranks

TIMEOUT = 180  # seconds for a test's ranks


def test_sums_equal_gloos_bit_for_bit_and_large_tensors_fall_back():
    (rank0, rank1), = run_ranks([("reduce", "local_all_reduce_check", {})], timeout=TIMEOUT).values()
    for result in (rank0, rank1):
        assert not isinstance(result, str), result
        assert result["opened"]
        assert all(equal for _, _, fits, equal in result["equal"] if fits)
        assert [fits for _, size, fits, _ in result["equal"]].count(False) == 2  # one past the slot, per dtype
    assert rank0 == rank1


def test_three_ranks_hold_the_same_bits_summed_in_rank_order():
    results, = run_ranks([("three", "three_rank_sum_check", {})], world=3, timeout=TIMEOUT).values()
    assert all(not isinstance(r, str) for r in results), results
    assert results[0][0] == results[1][0] == results[2][0]
    assert all(in_order for _, in_order, _ in results)
    assert all(gap < 1e-5 for _, _, gap in results)  # gloo adds in its own order: rounding only


def _dead_peer_rank(rank: int, port: int, results) -> None:
    import torch

    from tensor_parallel_ranks import dead_peer_check
    from genfn.distributed import init_tensor_parallel

    torch.set_num_threads(1)
    shard = init_tensor_parallel(2, rank=rank, init_method=f"tcp://127.0.0.1:{port}", timeout=120, set_threads=False,
                                 on_failure=lambda message: None)
    results.put(dead_peer_check(shard))


def test_a_peer_that_leaves_is_named_within_seconds():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_dead_peer_rank, args=(rank, port, results), daemon=True) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        message = results.get(timeout=TIMEOUT)
    except queue.Empty:
        pytest.fail(f"rank 0 reported nothing in {TIMEOUT} s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert "rank 1" in message and "gone" in message, message
    assert float(message.split(" s:")[0]) < 10


def test_a_group_without_shared_memory_registers_nothing():
    from genfn import local_all_reduce

    assert local_all_reduce.for_group("no such group") is None
