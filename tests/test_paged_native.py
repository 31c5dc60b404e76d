"""The native paged ops (genfn/kernels/decode_attention.cpp): decode attention read straight from
the blocks and the slot write, against the reference paged attention and the index_put write."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

from genfn import kernels
from genfn.cache.paged import PackedPlan, init_paged_cache, paged_attention, plan_attention, planned_attention, write

CAN_BUILD = (sys.platform == "linux" and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
             and shutil.which(os.environ.get("CXX") or "c++") is not None
             and os.environ.get("GENFN_KERNELS", "1") != "0")
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="the native paged ops need AVX-512 and a C++ compiler")


def test_the_native_ops_load_wherever_the_kernels_build():
    assert kernels.decode_linear_available() == CAN_BUILD, kernels.kernel_status()
    if CAN_BUILD:
        assert hasattr(torch.ops.genfn_kernels, "paged_query_attention")
        assert hasattr(torch.ops.genfn_kernels, "paged_write")


def _filled_cache(dtype, gen, num_blocks=24, kv_heads=3, size=4, dim=64):
    cache = init_paged_cache(2, num_blocks, kv_heads, size, dim, dtype=dtype)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=gen))
    cache.values.copy_(torch.randn(cache.values.shape, generator=gen))
    return cache


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_native_decode_attention_equals_the_reference(dtype, window, softcap):
    """Rows of different lengths (one key, a partial block, whole blocks) over shuffled blocks,
    tables padded with the sink: the native op equals ``paged_attention`` (float32 arithmetic),
    Gemma 2's soft-capped scores (a cap of 1.5 against scores of about one: it bites) included."""
    gen = torch.Generator().manual_seed(1)
    cache = _filled_cache(dtype, gen)
    lengths = torch.tensor([1, 3, 4, 9, 17, 20])
    width = 6
    tables = torch.full((len(lengths), width), cache.sink_block)
    for r, length in enumerate(lengths.tolist()):
        used = -(-length // cache.block_size)
        tables[r, :used] = torch.randperm(cache.num_blocks, generator=gen)[:used]
    q = torch.randn(len(lengths), 9, 64, generator=gen).to(dtype)
    out = torch.ops.genfn_kernels.paged_query_attention(q, cache.keys[1], cache.values[1], tables, lengths,
                                                        64 ** -0.5, window or 0, softcap or 0.0)
    expected = paged_attention(q, cache, 1, tables, torch.arange(len(lengths)), lengths - 1, sliding_window=window,
                               softcap=softcap)
    assert out.dtype == dtype and out.shape == q.shape
    if softcap is not None:  # the cap changes the result: a kernel that ignored it would fail here
        uncapped = paged_attention(q, cache, 1, tables, torch.arange(len(lengths)), lengths - 1, sliding_window=window)
        assert (uncapped.float() - expected.float()).abs().max() > 0.05
    # Both sum in float32; bfloat16 outputs differ by at most the last rounding.
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def _block_table(cache, *rows) -> torch.Tensor:
    """``[len(rows), 6]`` block tables: each row's blocks, then the sink block."""
    table = torch.full((len(rows), 6), cache.sink_block)
    for i, blocks in enumerate(rows):
        table[i, :len(blocks)] = torch.tensor(blocks)
    return table


@needs_kernel
def test_planned_attention_with_the_native_op_equals_the_gathering_plan():
    """Decode rows through the native op, a prefill chunk and padding through SDPA: the same
    attention as the plan that gathers every decode row's blocks."""
    gen = torch.Generator().manual_seed(2)
    cache = _filled_cache(torch.float32, gen)
    size = cache.block_size
    # Row 0: a 5-token prefill chunk at positions 3..7; rows 1, 2: decode tokens at 10 and 0; 2 padding tokens.
    table = _block_table(cache, [7, 2], [11, 0, 5], [19])
    positions = torch.tensor([3, 4, 5, 6, 7, 10, 0, 0, 0])
    plan = PackedPlan(9, decode=((5, 1, 3), (6, 2, 1)), prefill=((0, 5, 0, 2),))
    q = torch.randn(9, 9, 64, generator=gen)
    native = planned_attention(q, cache, 1, plan_attention(plan, table, positions, size, native=True))
    gathered = planned_attention(q, cache, 1, plan_attention(plan, table, positions, size, native=False))
    torch.testing.assert_close(native, gathered, atol=1e-5, rtol=1e-5)
    assert not native[7:].any()  # padding
    # Every token in the plan (no padding): the op's rows are the batch's tokens in order.
    covered = PackedPlan(7, decode=((5, 1, 3), (6, 2, 1)), prefill=((0, 5, 0, 2),))
    whole = planned_attention(q[:7], cache, 1, plan_attention(covered, table, positions[:7], size, native=True))
    torch.testing.assert_close(whole, gathered[:7], atol=1e-5, rtol=1e-5)
    decode_only = PackedPlan(2, decode=((0, 1, 3), (1, 2, 1)))
    pos = torch.tensor([10, 0])
    alone = planned_attention(q[5:7], cache, 1, plan_attention(decode_only, table, pos, size, native=True))
    torch.testing.assert_close(alone, gathered[5:7], atol=1e-5, rtol=1e-5)


@needs_kernel
def test_every_chunk_of_a_long_prompt_takes_the_prefill_kernel_as_the_whole_prompt_does():
    """With ``whole_prompt_tokens``, a 5-token chunk of a 20-token prompt gathers its blocks for the
    prefill kernel, whose values for those queries are the whole prompt's bit for bit; a chunk of a
    short prompt and a decode row stay with the native walk; a row without tokens (a sequence
    sharing its leader's prompt) gathers nothing."""
    gen = torch.Generator().manual_seed(4)
    cache = _filled_cache(torch.float32, gen)
    size = cache.block_size
    table = _block_table(cache, [7, 2], [11, 0, 5], [19], [7, 2])
    # Row 0: positions 3..7 of a 20-token prompt; row 1: a decode token at 10; row 2: a 1-token
    # chunk of a 3-token prompt at 0; row 3: no tokens.
    positions = torch.tensor([3, 4, 5, 6, 7, 10, 0])
    plan = PackedPlan(7, decode=((5, 1, 3),), prefill=((0, 5, 0, 2), (6, 1, 2, 1), (7, 0, 3, 2)),
                      prompt_lens=(20, 0, 3, 20))
    assert plan.rows_of_prompts_from(17) == {0}
    planned = plan_attention(plan, table, positions, size, native=True, native_chunk_tokens=16,
                             whole_prompt_tokens=17)
    assert [(first, count) for first, count, _, _ in planned.prefill] == [(0, 5)]
    assert planned.native_decode[0].tolist() == [5, 6]
    q = torch.randn(7, 9, 64, generator=gen)
    out = planned_attention(q, cache, 1, planned)
    # The whole prompt's first 8 queries in one kernel call; the chunk's are its last 5.
    whole_q = torch.randn(8, 9, 64, generator=gen)
    whole_q[3:] = q[:5]
    whole = PackedPlan(8, prefill=((0, 8, 0, 2),), prompt_lens=(20,))
    whole_out = planned_attention(whole_q, cache, 1, plan_attention(whole, table[:1], torch.arange(8), size,
                                                                     native=True, native_chunk_tokens=16,
                                                                     whole_prompt_tokens=17))
    assert torch.equal(out[:5], whole_out[3:])
    walked = planned_attention(q, cache, 1, plan_attention(plan, table, positions, size, native=True,
                                                           native_chunk_tokens=16))
    torch.testing.assert_close(out, walked, atol=1e-5, rtol=1e-5)  # the same attention, other sums


@needs_kernel
@pytest.mark.parametrize("native", [True, False])
def test_soft_capped_planned_attention_equals_the_reference(native):
    """Gemma 2's capped scores through a plan: the native op (decode rows, short chunks) or the
    gathered rows and a prefill chunk of 70 tokens (past the op's 64) in float32, against
    ``paged_attention`` with the same cap, under a window."""
    gen = torch.Generator().manual_seed(4)
    cache = _filled_cache(torch.float32, gen, num_blocks=40)
    size, softcap, window = cache.block_size, 1.5, 9
    table = torch.full((3, 20), cache.sink_block)
    table[0, :18] = torch.randperm(cache.num_blocks, generator=gen)[:18]  # row 0: 70 tokens at 0..69
    table[1, :3] = torch.tensor([11, 0, 5])
    table[2, :1] = torch.tensor([19])
    positions = torch.cat([torch.arange(70), torch.tensor([10, 0])])
    request_index = torch.tensor([0] * 70 + [1, 2])
    plan = PackedPlan(72, decode=((70, 1, 3), (71, 2, 1)), prefill=((0, 70, 0, 18),))
    q = torch.randn(72, 9, 64, generator=gen)
    planned = plan_attention(plan, table, positions, size, sliding_window=window, native=native)
    assert (planned.native_decode is not None) == native and len(planned.prefill) == 1
    out = planned_attention(q, cache, 1, planned, softcap=softcap)
    expected = paged_attention(q, cache, 1, table, request_index, positions, sliding_window=window, softcap=softcap)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_write_equals_the_index_put_write(dtype):
    gen = torch.Generator().manual_seed(3)
    native = init_paged_cache(2, 5, 3, 4, 16, dtype=dtype)
    reference = init_paged_cache(2, 5, 3, 4, 16, dtype=dtype)
    slots = torch.tensor([9, 2, -1, 19, 0])
    k = torch.randn(5, 3, 16, generator=gen).to(dtype)
    v = torch.randn(5, 3, 16, generator=gen).to(dtype)
    out = write(native, 1, slots, k, v)  # eager: the native op
    assert out.keys.data_ptr() == native.keys.data_ptr()
    placed = torch.where(slots < 0, native.sink_block * 4, slots)  # padding: the sink's first slot
    blocks, offsets = placed.div(4, rounding_mode="floor"), placed % 4
    index = (torch.tensor(1), blocks.view(-1, 1), torch.arange(3).view(1, 3), offsets.view(-1, 1))
    reference.keys.index_put_(index, k)
    reference.values.index_put_(index, v)
    assert torch.equal(native.keys, reference.keys) and torch.equal(native.values, reference.values)
    assert native.keys[0].abs().sum() == 0  # the other layer is untouched


@needs_kernel
def test_the_native_ops_refuse_out_of_range_blocks_and_slots():
    cache = init_paged_cache(1, 3, 1, 4, 16)
    q = torch.randn(1, 1, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.genfn_kernels.paged_query_attention(q, cache.keys[0], cache.values[0], torch.tensor([[7]]),
                                                      torch.tensor([2]), 0.25, 0)
    with pytest.raises(RuntimeError, match="length"):
        torch.ops.genfn_kernels.paged_query_attention(q, cache.keys[0], cache.values[0], torch.tensor([[0]]),
                                                      torch.tensor([5]), 0.25, 0)
    with pytest.raises(RuntimeError, match="slot"):
        torch.ops.genfn_kernels.paged_write(cache.keys, cache.values, 0, torch.tensor([16]), torch.randn(1, 1, 16),
                                            torch.randn(1, 1, 16))


def test_the_plan_of_a_batch_names_each_prompt_chunks_prompt_length():
    """``packed_plan`` keeps a prompt's last token, computed alone, with the prompt chunks (so that it
    attends as its prompt does) and records the prompt's length; a decode token, drafts and a token
    past a recomputed prompt are not prompt chunks."""
    from genfn.batching.engine import packed_plan
    from genfn.batching.scheduling import ScheduledBatch, ScheduledChunk

    batch = ScheduledBatch((ScheduledChunk("long", 16, (5,), True, prompt_len=17),
                            ScheduledChunk("decoding", 30, (7,), True, prompt_len=10),
                            ScheduledChunk("drafts", 12, (7, 8, 9), True, num_drafts=2, prompt_len=10),
                            ScheduledChunk("recomputed", 0, tuple(range(3, 23)), True, prompt_len=12)))
    plan = packed_plan(batch, 4)
    assert plan.decode == ((1, 1, 8),)
    assert [(first, count, row) for first, count, row, _ in plan.prefill] == [(0, 1, 0), (2, 3, 2), (5, 20, 3)]
    assert plan.prompt_lens == (17, 0, 0, 0)
    assert plan.rows_of_prompts_from(17) == {0}
