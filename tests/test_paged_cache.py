"""The paged KV cache: block allocator (reference counts, prefix caching, LRU eviction), slot
writes, attention over packed variable-length batches against dense attention, and the index
tensors of a forward, end to end through the scheduler with a one-layer attention model."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.nn.functional as F

from genfn.batching import blocks as B
from genfn.batching import scheduling as S
from genfn.batching.hints import WorkloadHints, kv_bytes_per_block, resolve
from genfn.batching.inputs import BatchInputs, bucket, build_batch_inputs, build_row_history
from genfn.batching.requests import RequestStatus, make_request
from genfn.cache.paged import PackedPlan, init_paged_cache, paged_attention, plan_attention, planned_attention, write
from genfn.state.base import tree_flatten

# ----------------------------------------------------------------------------------------------
# Allocator
# ----------------------------------------------------------------------------------------------


def test_allocation_takes_whole_blocks_and_fails_without_changing_anything():
    alloc = B.init_allocator(5, 4)
    grown = B.ensure_capacity(alloc, "a", 9)  # 3 blocks
    assert B.block_table(grown, "a") == (0, 1, 2) and B.num_free_blocks(grown) == 2
    assert B.num_free_blocks(alloc) == 5 and B.block_table(alloc, "a") == ()  # the old value is untouched
    assert B.ensure_capacity(grown, "a", 12) is grown
    assert B.blocks_needed(grown, "a", 13) == 1
    assert B.ensure_capacity(grown, "b", 13) is None  # 4 blocks wanted, 2 left
    both = B.ensure_capacity(grown, "b", 8)
    assert B.block_table(both, "b") == (3, 4) and B.num_free_blocks(both) == 0
    freed = B.free_request(both, "a")
    assert B.num_free_blocks(freed) == 3 and B.allocated_requests(freed) == ("b",)
    assert B.free_request(freed, "unknown") is freed
    with pytest.raises(ValueError, match="num_blocks"):
        B.init_allocator(0, 4)
    with pytest.raises(TypeError, match="block_size"):
        B.init_allocator(4, 2.0)


def _commit(alloc, request_id, tokens):
    alloc = B.ensure_capacity(alloc, request_id, len(tokens))
    return B.commit_full_blocks(alloc, request_id, tokens)


def test_full_blocks_are_shared_by_digest_and_reference_counted():
    prompt = list(range(10, 20))  # two full blocks of 4 and 2 tokens more
    alloc = _commit(B.init_allocator(8, 4), "a", prompt)
    assert B.cached_block_count(alloc) == 2  # the partial third block is private
    assert B.match_prefix(alloc, prompt) == (0, 1)
    assert B.match_prefix(alloc, prompt[:7]) == (0,)
    assert B.match_prefix(alloc, [99] + prompt[1:]) == ()  # a different first block breaks the chain
    alloc, reused = B.acquire_prefix(alloc, "b", prompt + [5], max_tokens=len(prompt))
    assert reused == 8 and B.block_table(alloc, "b") == (0, 1)
    assert [B.ref_count(alloc, b) for b in (0, 1, 2)] == [2, 2, 1]
    with pytest.raises(ValueError, match="already holds blocks"):
        B.acquire_prefix(alloc, "b", prompt)
    # The last token is kept to compute: a prompt of exactly two blocks reuses only one.
    alloc, reused = B.acquire_prefix(alloc, "c", prompt[:8], max_tokens=7)
    assert reused == 4 and B.ref_count(alloc, 0) == 3
    alloc = B.free_request(alloc, "a")
    assert [B.ref_count(alloc, b) for b in (0, 1, 2)] == [2, 1, 0]
    assert 2 in alloc.free and B.evictable_blocks(alloc) == ()
    alloc = B.free_request(B.free_request(alloc, "b"), "c")
    # Unreferenced but cached: allocatable, and still matched.
    assert set(B.evictable_blocks(alloc)) == {0, 1} and B.num_free_blocks(alloc) == 8
    assert B.match_prefix(alloc, prompt) == (0, 1)


def test_a_salted_chain_shares_blocks_only_with_its_own_salt():
    """LongRoPE's long prompts (``requests.prefix_salt``) hold other keys for the same tokens."""
    from genfn.batching.requests import make_request, prefix_salt

    prompt = [3, 4, 1, 2, 7]
    alloc = _commit(B.init_allocator(8, 2), "short", prompt)
    assert B.match_prefix(alloc, prompt) == (0, 1)
    assert B.match_prefix(alloc, prompt, b"long prompt") == ()
    alloc, reused = B.acquire_prefix(alloc, "long", prompt, max_tokens=4, salt=b"long prompt")
    assert reused == 0
    alloc = B.commit_full_blocks(B.ensure_capacity(alloc, "long", 5), "long", prompt, salt=b"long prompt")
    assert B.match_prefix(alloc, prompt, b"long prompt") == B.block_table(alloc, "long")[:2] != (0, 1)
    assert B.match_prefix(alloc, prompt) == (0, 1)
    assert prefix_salt(make_request("r", prompt), 4) == b"long prompt"
    assert prefix_salt(make_request("r", prompt), 5) is None and prefix_salt(make_request("r", prompt), None) is None


def test_same_tokens_under_a_different_parent_are_a_different_block():
    assert B.block_digest(None, [1, 2]) != B.block_digest(B.block_digest(None, [3, 4]), [1, 2])
    assert B.block_digest(None, [1, 2]) == B.block_digest(None, (1, 2))
    alloc = _commit(B.init_allocator(8, 2), "a", [3, 4, 1, 2])
    assert B.match_prefix(alloc, [1, 2]) == ()
    assert B.match_prefix(alloc, [3, 4, 1, 2]) == (0, 1)


def test_eviction_is_least_recently_released_first():
    alloc = B.init_allocator(6, 2)
    alloc = _commit(alloc, "old", [1, 1, 2, 2])
    alloc = _commit(alloc, "new", [7, 7, 8, 8])
    alloc = B.free_request(alloc, "old")
    alloc = B.free_request(alloc, "new")
    assert B.cached_block_count(alloc) == 4 and len(alloc.free) == 2
    alloc = B.ensure_capacity(alloc, "x", 6)  # the 2 free blocks, then 1 evicted: old's last block
    assert B.match_prefix(alloc, [1, 1, 2, 2]) == (0,)
    assert B.match_prefix(alloc, [7, 7, 8, 8]) == (2, 3)
    alloc = B.ensure_capacity(alloc, "x", 8)  # then old's first block
    assert B.match_prefix(alloc, [1, 1, 2, 2]) == ()
    assert B.match_prefix(alloc, [7, 7, 8, 8]) == (2, 3)
    assert B.cached_block_count(alloc) == 2
    # A reused block leaves the eviction queue: it is referenced again.
    alloc, reused = B.acquire_prefix(alloc, "y", [7, 7, 8, 8, 9])
    assert reused == 4 and B.evictable_blocks(alloc) == () and B.ensure_capacity(alloc, "z", 1) is None


def test_blocks_computed_twice_stay_private_and_free_without_caching():
    prompt = [5, 6, 7, 8, 9]
    alloc = _commit(B.init_allocator(6, 2), "a", prompt)
    alloc = _commit(alloc, "b", prompt)  # the same prefix, computed again at the same time
    assert B.cached_block_count(alloc) == 2 and B.match_prefix(alloc, prompt) == B.block_table(alloc, "a")[:2]
    alloc = B.free_request(B.free_request(alloc, "b"), "a")
    assert len(alloc.evictable) == 2 and len(alloc.free) == 4
    dropped = B.free_request(_commit(B.init_allocator(6, 2), "a", prompt), "a", keep_cached=False)
    assert B.cached_block_count(dropped) == 0 and sorted(dropped.free) == list(range(6))
    assert sorted(B.evict_all(alloc).free) == list(range(6))


# ----------------------------------------------------------------------------------------------
# KV tensors and attention
# ----------------------------------------------------------------------------------------------


def test_write_places_keys_at_their_slots_and_padding_in_the_sink():
    cache = init_paged_cache(2, 3, 2, 4, 5)
    assert cache.keys.shape == (2, 4, 2, 4, 5) and cache.num_blocks == 3 and cache.sink_block == 3
    leaves, _ = tree_flatten(cache)
    assert len(leaves) == 2  # block_size is static
    k = torch.randn(3, 2, 5)
    v = torch.randn(3, 2, 5)
    slots = torch.tensor([9, 2, -1])  # block 2 offset 1, block 0 offset 2, padding
    out = write(cache, 1, slots, k, v)
    assert out.keys.data_ptr() == cache.keys.data_ptr()  # in place: donated
    assert torch.equal(cache.keys[1, 2, :, 1], k[0]) and torch.equal(cache.values[1, 0, :, 2], v[1])
    assert torch.equal(cache.keys[1, 3, :, 0], k[2])  # the sink
    written = torch.zeros(2, 4, 2, 4, dtype=torch.bool)
    written[1, 2, :, 1] = written[1, 0, :, 2] = written[1, 3, :, 0] = True
    assert not cache.keys.abs().sum(-1)[~written].any()
    with pytest.raises(ValueError, match="num_blocks"):
        init_paged_cache(1, 0, 1, 4, 4)


def dense_attention(q, k, v, positions, window=None):
    """Causal attention of ``q [S, H, D]`` at ``positions`` over a request's ``k, v [P, Hkv, D]``."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).transpose(0, 1)
    v = v.repeat_interleave(groups, dim=1).transpose(0, 1)
    key_pos = torch.arange(k.shape[1])
    mask = key_pos.view(1, -1) <= positions.view(-1, 1)
    if window is not None:
        mask &= key_pos.view(1, -1) > positions.view(-1, 1) - window
    out = F.scaled_dot_product_attention(q.transpose(0, 1).double(), k.double(), v.double(), attn_mask=mask)
    return out.transpose(0, 1)


@pytest.mark.parametrize("dtype,window", [(torch.float32, None), (torch.float64, 5), (torch.bfloat16, None)])
def test_packed_varlen_attention_equals_dense_attention(dtype, window):
    """Prefill chunks and decode tokens of requests whose keys sit in shuffled blocks, plus
    padding tokens and rows, in one call; each request's outputs equal its own dense attention."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, size, num_blocks = 4, 2, 8, 4, 40
    cache = init_paged_cache(2, num_blocks, kv_heads, size, dim, dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    # (past length already in the cache, new tokens this step)
    requests = [(0, 7), (13, 1), (5, 6), (0, 1), (22, 3), (8, 1)]
    width = 8
    tables, all_k, all_v = [], [], []
    for past, new in requests:
        count = -(-(past + new) // size)
        tables.append([order.pop() for _ in range(count)])
        all_k.append(torch.randn(past + new, kv_heads, dim, generator=gen).to(dtype))
        all_v.append(torch.randn(past + new, kv_heads, dim, generator=gen).to(dtype))

    def slot(r, p):
        return tables[r][p // size] * size + p % size

    # The past of each request, written by earlier steps.
    past_slots = [slot(r, p) for r, (past, _) in enumerate(requests) for p in range(past)]
    past_k = torch.cat([all_k[r][:past] for r, (past, _) in enumerate(requests)])
    past_v = torch.cat([all_v[r][:past] for r, (past, _) in enumerate(requests)])
    write(cache, 1, torch.tensor(past_slots), past_k, past_v)
    # This step: the packed batch, with 3 padding tokens and 2 padding rows.
    rows, positions, slots, new_k, new_v = [], [], [], [], []
    for r, (past, new) in enumerate(requests):
        for p in range(past, past + new):
            rows.append(r)
            positions.append(p)
            slots.append(slot(r, p))
        new_k.append(all_k[r][past:])
        new_v.append(all_v[r][past:])
    pad = 3
    rows += [0] * pad
    positions += [0] * pad
    slots += [-1] * pad
    new_k = torch.cat(new_k + [torch.randn(pad, kv_heads, dim, generator=gen).to(dtype)])
    new_v = torch.cat(new_v + [torch.randn(pad, kv_heads, dim, generator=gen).to(dtype)])
    table_tensor = torch.full((len(requests) + 2, width), cache.sink_block)
    for r, table in enumerate(tables):
        table_tensor[r, :len(table)] = torch.tensor(table)
    q = torch.randn(len(rows), heads, dim, generator=gen).to(dtype)
    write(cache, 1, torch.tensor(slots), new_k, new_v)
    out = paged_attention(q, cache, 1, table_tensor, torch.tensor(rows), torch.tensor(positions),
                          sliding_window=window, query_chunk=None)
    chunked = paged_attention(q, cache, 1, table_tensor, torch.tensor(rows), torch.tensor(positions),
                              sliding_window=window, query_chunk=4)
    torch.testing.assert_close(chunked, out, atol=0, rtol=0)
    assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()
    tol = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2}[dtype]
    start = 0
    for r, (past, new) in enumerate(requests):
        expected = dense_attention(q[start:start + new], all_k[r], all_v[r], torch.arange(past, past + new), window)
        torch.testing.assert_close(out[start:start + new].double(), expected, atol=tol, rtol=tol)
        start += new
    # The eager plan (decode rows together, prefill chunks alone, only their occupied blocks)
    # computes the same attention; the padding tokens it leaves out get zeros.
    decode, prefill, first = [], [], 0
    for r, (past, new) in enumerate(requests):
        blocks = -(-(past + new) // size)
        if new == 1:
            decode.append((first, r, blocks))
        else:
            prefill.append((first, new, r, blocks))
        first += new
    plan = PackedPlan(len(rows), tuple(decode), tuple(prefill))
    planned = planned_attention(q, cache, 1, plan_attention(plan, table_tensor, torch.tensor(positions), size, window))
    torch.testing.assert_close(planned[:first], out[:first], atol=tol, rtol=tol)
    assert not planned[first:].any()
    # Layer 0 was never written: attending it gives zeros, the other layer is not read.
    zeros = paged_attention(q, cache, 0, table_tensor, torch.tensor(rows), torch.tensor(positions))
    assert not zeros.abs().sum()
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q[:, :3], cache, 1, table_tensor, torch.tensor(rows), torch.tensor(positions))
    with pytest.raises(ValueError, match="query_chunk"):
        paged_attention(q, cache, 1, table_tensor, torch.tensor(rows), torch.tensor(positions), query_chunk=0)


# ----------------------------------------------------------------------------------------------
# Index tensors
# ----------------------------------------------------------------------------------------------


def test_batch_inputs_index_the_blocks_the_scheduler_allocated():
    state = S.init_scheduler(16, 4)
    state = S.add_request(state, make_request("a", range(1, 11), max_new_tokens=3))
    state = S.add_request(state, make_request("b", [7, 8], max_new_tokens=3))
    state, batch = S.schedule(state, 8)
    inputs = build_batch_inputs(state.allocator, batch, num_tokens=bucket(batch.num_tokens, 8),
                                num_rows=4, table_width=5)
    assert isinstance(inputs, BatchInputs)
    assert [c.request_id for c in batch.chunks] == ["a"]  # 8 of "a"'s 10 prompt tokens
    assert inputs.input_ids.tolist() == list(range(1, 9))
    assert inputs.positions.tolist() == list(range(8))
    assert inputs.slot_mapping.tolist() == list(range(8))  # blocks 0 and 1
    assert inputs.block_tables.tolist()[0] == [0, 1, 16, 16, 16] and inputs.block_tables.tolist()[1] == [16] * 5
    assert inputs.query_start.tolist() == [0, 8, 8, 8, 8]
    assert inputs.samples.tolist() == [False, False, False, False]
    assert not batch.is_decode_only
    state, _ = S.apply_step(state, batch, {})
    state, batch = S.schedule(state, 8)
    inputs = build_batch_inputs(state.allocator, batch, num_tokens=8, num_rows=2)
    assert [(c.request_id, c.start, len(c.token_ids)) for c in batch.chunks] == [("a", 8, 2), ("b", 0, 2)]
    table_b = B.block_table(state.allocator, "b")
    assert inputs.input_ids.tolist() == [9, 10, 7, 8, 0, 0, 0, 0]
    assert inputs.positions.tolist() == [8, 9, 0, 1, 0, 0, 0, 0]
    assert inputs.request_index.tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert inputs.slot_mapping.tolist() == [8, 9, table_b[0] * 4, table_b[0] * 4 + 1, -1, -1, -1, -1]
    assert inputs.kv_lens.tolist() == [10, 2] and inputs.logits_index.tolist() == [1, 3]
    assert inputs.samples.tolist() == [True, True]
    state, _ = S.apply_step(state, batch, {"a": 5, "b": 6})
    state, batch = S.schedule(state, 8)
    assert batch.is_decode_only and batch.request_ids == ("a", "b")
    with pytest.raises(ValueError, match="num_rows"):
        build_batch_inputs(state.allocator, batch, num_rows=1)
    with pytest.raises(ValueError, match="num_tokens"):
        build_batch_inputs(state.allocator, batch, num_tokens=1)
    assert [bucket(n, 4) for n in (1, 4, 5, 17)] == [4, 4, 8, 32]


def test_hints_for_a_model_context_let_one_request_use_all_of_it_without_more_blocks():
    """A manager made without hints (the server's, generate_batch's defaults) takes
    ``WorkloadHints.for_context(model.max_position_embeddings)``: one request may span SmolLM2's
    8192 tokens, where the plain defaults stop it at 1024, and the block count stays the same."""
    default, long = resolve(WorkloadHints()), resolve(WorkloadHints.for_context(8192))
    assert WorkloadHints().longest_request == 1024
    assert WorkloadHints.for_context(8192).longest_request == 8192
    assert long.max_blocks_per_request == 8192 // long.block_size
    assert long.num_blocks == default.num_blocks and long.block_size == default.block_size
    assert WorkloadHints.for_context(None) == WorkloadHints() == WorkloadHints.for_context(512)


def test_a_manager_without_hints_sizes_requests_to_the_model_context():
    from conftest import tiny_pair
    from genfn.batching.manager import ContinuousBatchingManager

    _, model = tiny_pair()
    manager = ContinuousBatchingManager(model)
    assert manager.workload_hints == WorkloadHints.for_context(model.max_position_embeddings)


def test_workload_hints_give_sizes_that_hold_the_workload():
    sizes = resolve(WorkloadHints(expected_prompt_len=100, expected_new_tokens=60, concurrent_requests=8))
    assert sizes.block_size == 16
    assert sizes.num_blocks >= 8 * 10  # 8 requests of 160 tokens in blocks of 16
    assert sizes.max_requests_per_batch == 8 and sizes.max_batch_tokens == 108
    assert sizes.max_blocks_per_request == 20  # the worst case: 200 + 120 tokens
    per_block = kv_bytes_per_block(30, 3, 64, 16, torch.bfloat16)
    assert per_block == 2 * 30 * 3 * 16 * 64 * 2
    capped = resolve(WorkloadHints(), memory_budget_bytes=per_block * 11, num_layers=30, num_kv_heads=3,
                     head_dim=64, dtype=torch.bfloat16)
    assert capped.num_blocks == 10  # one block of the budget is the cache's sink
    assert resolve(WorkloadHints(expected_prompt_len=4000, expected_new_tokens=1000)).block_size == 32
    assert resolve(block_size=8, num_blocks=7).num_blocks == 7
    with pytest.raises(ValueError, match="num_layers"):
        resolve(memory_budget_bytes=10**6)
    with pytest.raises(ValueError, match="holds no block"):
        resolve(memory_budget_bytes=10, num_layers=1, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="expected_prompt_len"):
        WorkloadHints(expected_prompt_len=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        WorkloadHints(expected_new_tokens=10, max_new_tokens=5)


def test_a_budget_picked_for_whole_prompts_holds_the_longest_prompt_the_hints_name():
    hints = WorkloadHints(expected_prompt_len=9, expected_new_tokens=6, concurrent_requests=5, max_prompt_len=19)
    assert resolve(hints).max_batch_tokens == 14  # room for the typical prompt only: chunks split a longer one
    assert resolve(hints, whole_prompts=True).max_batch_tokens == 19
    assert resolve(hints, whole_prompts=True, max_batch_tokens=16).max_batch_tokens == 16  # a budget given wins
    assert resolve(WorkloadHints(), whole_prompts=True).max_batch_tokens == resolve(WorkloadHints()).max_batch_tokens


@pytest.mark.parametrize("strategy", [{}, {"prompt_lookup_num_tokens": 4}], ids=["greedy", "prompt_lookup"])
def test_generate_batch_with_chunked_prefill_off_runs_a_prompt_longer_than_the_typical_budget(strategy):
    # The budget generate_batch picks (requests + the typical prompt) was shorter than its longest
    # prompt: with chunked prefill off that request failed though the user set no budget at all.
    # With speculation, the room kept for drafts shrank a step's budget below a prompt that fits a
    # forward, which failed it too, where it must wait for the room.
    import genfn
    from conftest import tiny_pair
    from genfn.batching.api import generate_batch

    _, model = tiny_pair()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=gen).tolist() for n in (5, 12, 7, 19, 3)]
    settings = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, **strategy)
    out = generate_batch(model, prompts, chunked_prefill=False, **settings)
    alone = [genfn.generate(model, torch.tensor([p]), disable_compile=True, **settings)[0, len(p):].tolist()
             for p in prompts]
    assert [r.error for r in out.values()] == [None] * 5
    assert [list(r.generated_tokens) for r in out.values()] == alone


# ----------------------------------------------------------------------------------------------
# End to end: scheduler -> index tensors -> paged cache -> attention, against dense greedy decoding
# ----------------------------------------------------------------------------------------------


class OneLayerModel:
    """A one-attention-layer language model (float64), so that greedy tokens computed through the
    paged cache can be compared with the same model run densely on each request alone."""

    def __init__(self, vocab=37, heads=4, kv_heads=2, dim=8, max_pos=256, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim

        def param(*shape):
            return torch.randn(*shape, generator=gen, dtype=torch.float64)

        self.q, self.k, self.v = param(vocab, heads * dim), param(vocab, kv_heads * dim), param(vocab, kv_heads * dim)
        self.pk, self.pq = param(max_pos, kv_heads * dim), param(max_pos, heads * dim)
        self.out = param(heads * dim, vocab)

    def qkv(self, tokens, positions):
        q = (self.q[tokens] + self.pq[positions]).view(-1, self.heads, self.dim)
        k = (self.k[tokens] + self.pk[positions]).view(-1, self.kv_heads, self.dim)
        v = self.v[tokens].view(-1, self.kv_heads, self.dim)
        return q, k, v

    def greedy_alone(self, prompt, max_new_tokens, eos):
        tokens = list(prompt)
        for _ in range(max_new_tokens):
            t = torch.tensor(tokens)
            q, k, v = self.qkv(t, torch.arange(len(tokens)))
            h = dense_attention(q[-1:], k, v, torch.tensor([len(tokens) - 1]))
            tokens.append(int((h.reshape(1, -1) @ self.out).argmax()))
            if tokens[-1] == eos:
                break
        return tuple(tokens[len(prompt):])

    def paged_step(self, cache, inputs: BatchInputs):
        q, k, v = self.qkv(inputs.input_ids, inputs.positions)
        cache = write(cache, 0, inputs.slot_mapping, k, v)
        h = paged_attention(q, cache, 0, inputs.block_tables, inputs.request_index, inputs.positions)
        logits = h[inputs.logits_index].reshape(inputs.logits_index.shape[0], -1) @ self.out
        return cache, logits.argmax(-1)


@pytest.mark.parametrize("kind,num_blocks", [("fifo", 64), ("fifo", 12), ("prefill_first", 12)])
def test_paged_greedy_decoding_equals_dense_decoding_per_request(kind, num_blocks):
    """Chunked prefill, prefix sharing (a common system prompt) and, with 12 blocks, preemption:
    every request's greedy tokens equal the same model run densely on that request alone."""
    rng = random.Random(7)
    model = OneLayerModel()
    size, width, eos = 4, 12, 3
    system = [rng.randrange(4, 37) for _ in range(10)]
    prompts = {}
    for i in range(24):
        prompt = [rng.randrange(4, 37) for _ in range(rng.randint(1, 20))]
        prompts[i] = (system + prompt[:rng.randint(1, 6)]) if i % 2 else prompt
    limits = {i: rng.randint(1, 14) for i in prompts}
    cache = init_paged_cache(1, num_blocks, model.kv_heads, size, model.dim, dtype=torch.float64)
    state = S.init_scheduler(num_blocks, size, S.SchedulerPolicy(kind=kind, max_requests_per_batch=6,
                                                                 max_blocks_per_request=width))
    for i, prompt in prompts.items():
        state = S.add_request(state, make_request(i, prompt, max_new_tokens=limits[i], eos_token_id=eos))
    ended, preempted, reused, shapes = {}, 0, 0, set()
    for _ in range(2000):
        if not S.has_pending(state):
            break
        state, batch = S.schedule(state, 16)
        preempted += len(batch.preempted)
        assert not batch.failed
        reused += sum(1 for c in batch.chunks if c.start and state.requests[c.request_id].num_reused == c.start)
        if not batch.chunks:
            continue
        inputs = build_batch_inputs(state.allocator, batch, num_tokens=16, num_rows=6, table_width=width)
        shapes.add(tuple(t.shape for t in tree_flatten(inputs)[0]))
        cache, tokens = model.paged_step(cache, inputs)
        new = {c.request_id: int(tokens[r]) for r, c in enumerate(batch.chunks) if c.samples}
        state, finished = S.apply_step(state, batch, new)
        ended.update({r.request_id: r for r in finished})
    assert not S.has_pending(state), "the requests did not finish"
    assert len(shapes) == 1  # one static shape served every batch
    assert reused > 0
    if num_blocks == 12:
        assert preempted > 0
    for i, prompt in prompts.items():
        assert ended[i].status == RequestStatus.FINISHED
        assert ended[i].generated_ids == model.greedy_alone(prompt, limits[i], eos), f"request {i}"
    assert B.num_free_blocks(state.allocator) == num_blocks and not any(state.allocator.refs)


def test_truncate_releases_trailing_blocks_and_never_overwrites_a_shared_one():
    prompt = list(range(1, 12))  # blocks of 4: two full, one of 3
    alloc = _commit(B.init_allocator(8, 4), "a", prompt)
    cut, kept = B.truncate(alloc, "a", 5)
    assert kept == 5 and B.block_table(cut, "a") == (0, 1) and 2 in cut.free
    # Block 1 is cut in the middle: private, so it stays but leaves the prefix cache.
    assert B.match_prefix(cut, prompt) == (0,) and B.cached_block_count(cut) == 1
    same, kept = B.truncate(cut, "a", 8)  # nothing past the table to drop
    assert same is cut and kept == 8
    # Shared with "b": the cut block is released instead, and only whole blocks are kept.
    shared, _ = B.acquire_prefix(alloc, "b", prompt, max_tokens=10)
    cut, kept = B.truncate(shared, "a", 5)
    assert kept == 4 and B.block_table(cut, "a") == (0,)
    assert B.ref_count(cut, 1) == 1 and B.match_prefix(cut, prompt) == (0, 1)
    cut, kept = B.truncate(cut, "a", 0)
    assert kept == 0 and B.block_table(cut, "a") == ()
    cut = B.free_request(B.free_request(cut, "a"), "b")
    assert B.num_free_blocks(cut) == 8 and not any(cut.refs)
    with pytest.raises(ValueError, match="num_tokens"):
        B.truncate(alloc, "a", -1)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_random_allocator_operations_keep_the_accounting_and_share_only_equal_prefixes(data):
    """Random sequences of allocate / write / commit / admit-with-prefix / truncate / free over a
    two-letter alphabet (so prefixes collide often): the invariants hold after every operation,
    and a reused block always holds exactly the tokens the new request expects there."""
    size = data.draw(st.sampled_from([1, 2, 3]))
    num_blocks = data.draw(st.integers(2, 10))
    alloc = B.init_allocator(num_blocks, size)
    content = {}  # block -> the tokens written into it, as the forward would
    tokens_of = {}  # request -> its tokens whose keys/values are written
    next_id = 0
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["admit", "grow", "free", "truncate", "evict"]))
        live = sorted(tokens_of)
        if op == "admit":
            tokens = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=12))
            trial, reused = B.acquire_prefix(alloc, next_id, tokens, max_tokens=len(tokens) - 1)
            for index, block in enumerate(B.block_table(trial, next_id)):
                assert content[block] == tokens[index * size:(index + 1) * size]
            trial = B.ensure_capacity(trial, next_id, len(tokens))
            if trial is None:
                continue  # dropped: the old state is untouched
            alloc = trial
            table = B.block_table(alloc, next_id)
            for position in range(reused, len(tokens)):
                block = table[position // size]
                content.setdefault(block, [])
                content[block] = content[block][:position % size] + [tokens[position]]
            tokens_of[next_id] = tokens
            alloc = B.commit_full_blocks(alloc, next_id, tokens)
            next_id += 1
        elif op == "grow" and live:
            request_id = data.draw(st.sampled_from(live))
            extra = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=5))
            tokens = tokens_of[request_id] + extra
            grown = B.ensure_capacity(alloc, request_id, len(tokens))
            if grown is None:
                continue
            alloc = grown
            table = B.block_table(alloc, request_id)
            for position in range(len(tokens_of[request_id]), len(tokens)):
                block = table[position // size]
                assert B.ref_count(alloc, block) == 1, "a request writes only into blocks it owns alone"
                content[block] = content.get(block, [])[:position % size] + [tokens[position]]
            tokens_of[request_id] = tokens
            alloc = B.commit_full_blocks(alloc, request_id, tokens)
        elif op == "free" and live:
            request_id = data.draw(st.sampled_from(live))
            alloc = B.free_request(alloc, request_id, keep_cached=data.draw(st.booleans()))
            del tokens_of[request_id]
        elif op == "truncate" and live:
            request_id = data.draw(st.sampled_from(live))
            alloc, kept = B.truncate(alloc, request_id, data.draw(st.integers(0, len(tokens_of[request_id]))))
            tokens_of[request_id] = tokens_of[request_id][:kept]
        elif op == "evict":
            alloc = B.evict_all(alloc)
        B.check_invariants(alloc)
        for request_id, tokens in tokens_of.items():
            assert len(B.block_table(alloc, request_id)) >= -(-len(tokens) // size)
    for request_id in list(tokens_of):
        alloc = B.free_request(alloc, request_id)
    B.check_invariants(alloc)
    assert B.num_free_blocks(alloc) == num_blocks and not alloc.tables


def test_the_paged_forward_traces_as_one_graph_and_serves_every_batch_of_its_shape():
    """write + attention over BatchInputs under dynamo with fullgraph=True (the cheap "eager"
    backend: this checks graph capture, not codegen), then batches of different contents at the
    same padded sizes run without a recompile."""
    model = OneLayerModel()
    size, width = 4, 8
    cache = init_paged_cache(1, 32, model.kv_heads, size, model.dim, dtype=torch.float64)

    def forward(cache, inputs):
        return model.paged_step(cache, inputs)

    compiled = torch.compile(forward, backend="eager", fullgraph=True, dynamic=False)
    state = S.init_scheduler(32, size, S.SchedulerPolicy(max_requests_per_batch=4, max_blocks_per_request=width))
    for i, length in enumerate([3, 9, 14, 1, 6]):
        state = S.add_request(state, make_request(i, range(5, 5 + length), max_new_tokens=4))
    torch._dynamo.reset()
    outputs = 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(100):
            if not S.has_pending(state):
                break
            state, batch = S.schedule(state, 8)
            inputs = build_batch_inputs(state.allocator, batch, num_tokens=8, num_rows=4, table_width=width)
            eager_cache = init_paged_cache(1, 32, model.kv_heads, size, model.dim, dtype=torch.float64)
            eager_cache.keys.copy_(cache.keys)
            eager_cache.values.copy_(cache.values)
            cache, tokens = compiled(cache, inputs)
            _, expected = model.paged_step(eager_cache, inputs)
            assert torch.equal(tokens, expected)
            new = {c.request_id: int(tokens[r]) for r, c in enumerate(batch.chunks) if c.samples}
            state, finished = S.apply_step(state, batch, new)
            outputs += len(finished)
            assert outputs <= 5
    assert outputs == 5


def test_row_history_keeps_the_prompt_length_through_a_recompute():
    state = S.init_scheduler(4, 4, S.SchedulerPolicy(safety_margin=0.0, prefix_caching=False))
    state = S.add_request(state, make_request("a", [1, 2, 3], max_new_tokens=20))
    state = S.add_request(state, make_request("b", [4, 5, 6, 7, 8], max_new_tokens=20))
    history = None
    for step in range(40):
        state, batch = S.schedule(state, 16)
        if "b" in batch.preempted:
            break
        history = build_row_history(state.requests, batch, max_len=16, num_rows=3)
        rows = {c.request_id: r for r, c in enumerate(batch.chunks)}
        for request_id, row in rows.items():
            request = state.requests[request_id]
            n = int(history.cur_len[row])
            assert history.tokens[row, :n].tolist() == list(request.token_ids[:n])
            assert int(history.prompt_len[row]) == len(request.prompt_ids)
        assert int(history.cur_len[2]) == 0
        state, _ = S.apply_step(state, batch, {c.request_id: 9 + step for c in batch.chunks if c.samples})
    else:
        raise AssertionError("no preemption happened")
    state, _ = S.apply_step(state, batch, {c.request_id: 0 for c in batch.chunks if c.samples})
    generated = len(state.requests["b"].generated_ids)
    for _ in range(10):  # until "b" is recomputed and samples again
        state, batch = S.schedule(state, 16)
        chunk = next((c for c in batch.chunks if c.request_id == "b" and c.samples), None)
        if chunk is not None:
            break
        state, _ = S.apply_step(state, batch, {c.request_id: 1 for c in batch.chunks if c.samples})
    row = batch.request_ids.index("b")
    history = build_row_history(state.requests, batch, max_len=16, num_rows=3)
    assert int(history.prompt_len[row]) == 5 and int(history.cur_len[row]) == 5 + generated
    with pytest.raises(ValueError, match="max_len"):
        build_row_history(state.requests, batch, max_len=2)
