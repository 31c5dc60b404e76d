"""The engine step of continuous batching: schedule -> inputs -> packed forward -> choose tokens.

``Engine`` holds what a step needs besides the scheduler's state: the model, the paged KV cache
(donated to every forward), the padded sizes the forward is compiled for, and the forwards
compiled so far (one per padded token count). ``engine_step(engine, state, budget)`` is the
whole step as a function of the ``SchedulerState``: it returns the next state and a
``StepOutcome`` (tokens chosen, requests finished / failed / preempted). The manager thread
runs the same pieces (``run_batch``) through the locked ``Scheduler``.

Each request carries its own ``RequestSettings`` (in ``RequestState.settings["genfn"]``): its
logits-processor chain with per-row values (every ``GenerationConfig`` processor setting of that
request), its sampling key, its stop strings. Per step, the chains of the rows that sample are
merged into one batch chain (``ProcessorChain.merge_rows``), which runs on the rows' histories
(``build_row_history``: each request's prompt and everything it generated), so history-dependent
processors see the whole request, as in ``generate``. The Gumbel noise of a row is keyed by the
request's key and counted by the tokens the request generated so far, so its sampled tokens do
not depend on the other requests, their order, chunking or preemption.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import Any

import torch

from genfn import random as grandom
from genfn.batching import scheduling as S
from genfn.batching.inputs import BatchInputs, bucket, build_batch_inputs, build_row_history
from genfn.batching.logprobs import (chosen_logprobs, max_logsumexp, native_pick, raw_logprobs, top_logprobs,
                                     top_pairs)
from genfn.batching.requests import RequestState
from genfn.cache.paged import PackedPlan
from genfn.kernels.packed_gemm import pack_linear_weights
from genfn.processors.chain import ProcessorChain
from genfn.processors.context import LogitsContext
from genfn.processors.grammar import FREE_ROW, apply_token_bitmask
from genfn.structured import bitmask_width

__all__ = ["Engine", "RequestSettings", "StepOutcome", "choose_tokens", "engine_step", "grammar_mask", "packed_plan",
           "run_batch", "settings_of"]


@dataclasses.dataclass(frozen=True)
class RequestSettings:
    """A request's own decoding settings (host-side values; the chain holds per-row leaves).

    ``chain``: the request's processors as a one-row per-row chain (``None``: none apply);
    ``key``: its sampling key ``[2]`` (``None``: greedy); ``stop_strings``: a matcher or ``None``;
    ``top_logprobs``: how many most likely tokens to report per generated token; ``grammar``:
    the request's structured-output matcher (synced to its generated tokens before every mask).
    """

    chain: ProcessorChain | None = None
    key: torch.Tensor | None = None
    stop_strings: Any = None
    top_logprobs: int = 0
    # response_format: a one-row genfn.structured.rows.GrammarRows (host-side matcher), or None
    grammar: Any = None

    @property
    def do_sample(self) -> bool:
        return self.key is not None


_NO_SETTINGS = RequestSettings()


def settings_of(request: RequestState) -> RequestSettings:
    return request.settings.get("genfn", _NO_SETTINGS)


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What one engine step did: ``new_tokens`` and ``logprobs`` of each request that sampled
    (``top_logprobs``: of those that asked), the requests it finished (EOS, length, stop string),
    failed and preempted."""

    new_tokens: Mapping[Hashable, int]
    logprobs: Mapping[Hashable, float]
    finished: tuple[RequestState, ...] = ()
    failed: tuple[RequestState, ...] = ()
    preempted: tuple[Hashable, ...] = ()
    num_tokens: int = 0
    top_logprobs: Mapping[Hashable, list[tuple[int, float]]] = dataclasses.field(default_factory=dict)


def choose_tokens(logits: torch.Tensor, chain: ProcessorChain | None, ctx: LogitsContext | None,
                  keys: torch.Tensor | None, do_sample: torch.Tensor | None,
                  grammar_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure: each row's next token ``[R]`` and its log-probability under the model's raw
    distribution (``log_softmax(logits)``, before the processors; see ``batching.logprobs``).

    ``keys [R, 2]`` and ``do_sample [R]`` (both or neither): rows that sample take
    ``argmax(scores + gumbel(key, generated count))``, the others ``argmax(scores)``, exactly as
    ``generate``'s step does for one request. ``grammar_mask [R, ceil(V / 32)]`` (structured
    outputs; all ones for a free row) rules out tokens before the processors, as in ``generate``.
    """
    plain = chain is None and grammar_mask is None
    scores = logits if grammar_mask is None else apply_token_bitmask(logits, grammar_mask)
    scores = scores if chain is None else chain(scores, ctx)
    logsumexp = None
    if plain or native_pick(scores):  # the native pass gives the argmax of the scores at no extra cost
        chosen, logsumexp = max_logsumexp(scores)
    else:
        chosen = torch.argmax(scores, dim=-1)
    if keys is not None:
        counter = ctx.row_cur_len() - ctx.row_prompt_len()
        sampled = torch.argmax(scores + grandom.gumbel(keys, counter, scores.shape[-1]), dim=-1)
        chosen = torch.where(do_sample, sampled, chosen)
    return chosen, chosen_logprobs(logits, chosen, logsumexp if plain else None)


class Engine:
    """The model, the paged cache and the padded sizes of continuous batching's forward.

    ``max_batch_tokens`` (T), ``max_requests`` (R), ``table_width`` (W blocks per request) and
    ``max_len`` (the longest request, for the processors' history buffer) are static; the token
    axis is padded to a power of two up to T, so a handful of compiled shapes serve every batch.
    ``compile``: ``None`` runs eagerly, a dict is ``torch.compile``'s keyword arguments.
    """

    def __init__(self, model, cache, *, max_batch_tokens: int, max_requests: int, table_width: int,
                 compile: dict | None = None):
        from genfn.models.packed import apply_packed

        self.model = model
        self.cache = cache
        self.max_batch_tokens = max_batch_tokens
        self.max_requests = max_requests
        self.table_width = table_width
        self.max_len = table_width * cache.block_size
        self.device = model.device
        self.compile_options = compile
        self._apply_packed = apply_packed
        # The eager forward multiplies many rows by each weight: oneDNN's GEMM on weights packed
        # once (genfn.kernels.packed_gemm); the compiled graph takes the plain tensors.
        self.params = model.params if compile is not None else pack_linear_weights(
            model.params, ("lm_head",), ("wqkv", "wo", "w_gate_up", "w_down"))
        self._forwards: dict[int, Any] = {}
        self._merged: tuple[tuple, ProcessorChain | None, torch.Tensor | None, torch.Tensor | None] | None = None

    @property
    def compiled(self) -> bool:
        return self.compile_options is not None

    def padded_tokens(self, num_tokens: int) -> int:
        """The token count a batch of ``num_tokens`` runs at: compiled, a power of two (at most T),
        so a handful of graphs serve every batch; eager, the count itself (padding is pure cost)."""
        if not self.compiled:
            return num_tokens
        return min(bucket(num_tokens, minimum=8), self.max_batch_tokens)

    def plan(self, batch: S.ScheduledBatch) -> PackedPlan | None:
        """The eager forward's ``PackedPlan`` of ``batch`` (``None`` when compiled: the compiled graph
        takes static shapes only, and gathers the whole padded tables)."""
        if self.compiled:
            return None
        return packed_plan(batch, self.cache.block_size, self.padded_tokens(batch.num_tokens))

    def forward(self, inputs: BatchInputs, plan: PackedPlan | None = None) -> torch.Tensor:
        """Logits ``[R, V]`` of the batch; the cache is updated (donated and replaced)."""
        if plan is not None:
            logits, self.cache = self._apply_packed(self.model.spec, self.params, inputs, self.cache, plan)
            return logits
        num_tokens = inputs.input_ids.shape[0]
        fn = self._forwards.get(num_tokens)
        if fn is None:
            spec, apply_packed = self.model.spec, self._apply_packed

            def packed(params, inputs, cache):
                return apply_packed(spec, params, inputs, cache)

            fn = packed if self.compile_options is None else torch.compile(packed, dynamic=False,
                                                                          **self.compile_options)
            self._forwards[num_tokens] = fn
        logits, self.cache = fn(self.model.params, inputs, self.cache)
        return logits

    def warmup(self) -> None:
        """Run (and so compile) the forward at every padded token count, on padding only; eagerly,
        at the smallest and largest count (first-call allocations and kernel builds)."""
        alloc_sink = self.cache.num_blocks
        sizes = sorted({self.padded_tokens(n) for n in range(1, self.max_batch_tokens + 1)})
        if not self.compiled:
            sizes = sorted({1, self.max_batch_tokens})
        for num_tokens in sizes:
            R, W = self.max_requests, self.table_width
            zeros = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
            inputs = BatchInputs(
                input_ids=zeros, positions=zeros, request_index=zeros,
                slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
                block_tables=torch.full((R, W), alloc_sink, dtype=torch.int64, device=self.device),
                query_start=torch.zeros(R + 1, dtype=torch.int64, device=self.device),
                kv_lens=torch.zeros(R, dtype=torch.int64, device=self.device),
                logits_index=torch.zeros(R, dtype=torch.int64, device=self.device),
                samples=torch.zeros(R, dtype=torch.bool, device=self.device))
            self.forward(inputs, None if self.compiled else PackedPlan(num_tokens))

    def batch_chain(self, requests: Mapping[Hashable, RequestState], batch: S.ScheduledBatch):
        """The merged chain, keys ``[R, 2]`` and sampling mask ``[R]`` of the batch's rows (cached
        while the batch's rows stay the same requests)."""
        # Arrival numbers are unique per scheduler: a new request reusing an ended one's id is
        # a different row.
        ids = tuple((r, requests[r].arrival) for r in batch.request_ids)
        if self._merged is not None and self._merged[0] == ids:
            return self._merged[1:]
        settings = [settings_of(requests[r]) for r in batch.request_ids]
        chain = None
        if any(s.chain is not None for s in settings):
            empty = ProcessorChain(())
            rows = [s.chain if s.chain is not None else empty for s in settings]
            rows += [empty] * (self.max_requests - len(rows))
            chain = ProcessorChain.merge_rows(rows, device=self.device)
        keys = do_sample = None
        if any(s.do_sample for s in settings):
            zero = torch.zeros(2, dtype=torch.int64)
            key_rows = [s.key.cpu() if s.do_sample else zero for s in settings]
            key_rows += [zero] * (self.max_requests - len(key_rows))
            keys = torch.stack(key_rows).to(self.device)
            flags = [s.do_sample for s in settings] + [False] * (self.max_requests - len(settings))
            do_sample = torch.tensor(flags, dtype=torch.bool, device=self.device)
        self._merged = (ids, chain, keys, do_sample)
        return chain, keys, do_sample


def run_batch(engine: Engine, requests: Mapping[Hashable, RequestState], allocator, batch: S.ScheduledBatch
              ) -> tuple[dict[Hashable, int], dict[Hashable, float], dict[Hashable, list[tuple[int, float]]]]:
    """Forward ``batch`` (scheduled into ``allocator``) and choose each sampling row's token.

    ``requests``: the scheduler's requests after ``schedule``. Returns ``(new_tokens, logprobs,
    top_logprobs)`` keyed by request id, for the chunks that sample (``top_logprobs``: only the
    requests that asked for some, their ``(token_id, logprob)`` pairs, most likely first).
    """
    inputs = build_batch_inputs(allocator, batch, num_tokens=engine.padded_tokens(batch.num_tokens),
                                num_rows=engine.max_requests, table_width=engine.table_width, device=engine.device)
    logits = engine.forward(inputs, engine.plan(batch))
    chain, keys, do_sample = engine.batch_chain(requests, batch)
    if chain is None and keys is None:
        # Greedy rows carry no per-row leaves padded to R: only the batch's rows need a token
        # (the softmax and argmax over a [R, 49152] padding cost a few ms a step).
        logits = logits[:len(batch.chunks)]
    ctx = None
    if chain is not None or keys is not None:
        history = build_row_history(requests, batch, max_len=engine.max_len, num_rows=engine.max_requests,
                                    device=engine.device)
        ctx = LogitsContext(tokens=history.tokens, cur_len=history.cur_len, prompt_len=history.prompt_len)
    chosen, logprobs = choose_tokens(logits, chain, ctx, keys, do_sample,
                                     grammar_mask(requests, batch, logits.shape, engine.device))
    wanted = [settings_of(requests[c.request_id]).top_logprobs if c.samples else 0 for c in batch.chunks]
    top_k = max(wanted, default=0)
    top_ids = top_values = None
    if top_k:
        top_ids, top_values = top_logprobs(raw_logprobs(logits), top_k)
    chosen, logprobs = chosen.tolist(), logprobs.tolist()  # the one host sync of a step
    if top_k:  # already computed by now: no further wait
        top_ids, top_values = top_ids.tolist(), top_values.tolist()
    new_tokens, new_logprobs, new_top = {}, {}, {}
    for row, chunk in enumerate(batch.chunks):
        if chunk.samples:
            new_tokens[chunk.request_id] = chosen[row]
            new_logprobs[chunk.request_id] = logprobs[row]
            if wanted[row]:
                new_top[chunk.request_id] = top_pairs(top_ids[row], top_values[row], wanted[row])
    return new_tokens, new_logprobs, new_top


def grammar_mask(requests: Mapping[Hashable, RequestState], batch: S.ScheduledBatch, logits_shape, device
                 ) -> torch.Tensor | None:
    """The ``[rows, ceil(V / 32)]`` int32 mask of the batch's sampling rows whose request has a
    ``response_format`` (others all ones), or None when none has. Each matcher is first synced to its
    request's generated tokens, so preemption and recomputation never desynchronize it."""
    constrained = [(row, chunk) for row, chunk in enumerate(batch.chunks)
                   if chunk.samples and settings_of(requests[chunk.request_id]).grammar is not None]
    if not constrained:
        return None
    mask = torch.full((logits_shape[0], bitmask_width(logits_shape[1])), FREE_ROW, dtype=torch.int32)
    for row, chunk in constrained:
        request = requests[chunk.request_id]
        rows = settings_of(request).grammar
        rows.sync(0, request.generated_ids)
        if not rows.finished[0]:
            rows.fill_row(0, mask[row])
    return mask.to(device)


def packed_plan(batch: S.ScheduledBatch, block_size: int, num_tokens: int | None = None) -> PackedPlan:
    """Where each chunk of ``batch`` sits on the token axis (as ``build_batch_inputs`` lays it out),
    how many blocks its row's keys span, and which rows sample."""
    decode, prefill, sample_rows, first = [], [], [], 0
    for row, chunk in enumerate(batch.chunks):
        count = len(chunk.token_ids)
        blocks = -(-chunk.end // block_size)
        if count == 1:
            decode.append((first, row, blocks))
        else:
            prefill.append((first, count, row, blocks))
        if chunk.samples:
            sample_rows.append(row)
        first += count
    return PackedPlan(first if num_tokens is None else num_tokens, tuple(decode), tuple(prefill), tuple(sample_rows))


def stopped_by_string(request: RequestState, device=None) -> bool:
    """Whether the request's text now ends with one of its stop strings."""
    matcher = settings_of(request).stop_strings
    if matcher is None or not request.generated_ids:
        return False
    tokens = torch.tensor([request.token_ids], dtype=torch.int64, device=device)
    cur_len = torch.tensor([tokens.shape[1]], dtype=torch.int64, device=device)
    return bool(matcher(tokens, cur_len)[0])


def engine_step(engine: Engine, state: S.SchedulerState, token_budget: int | None = None
                ) -> tuple[S.SchedulerState, StepOutcome]:
    """One step as a function of the scheduler's state (the cache is the engine's, donated)."""
    state, cancelled = S.clear_cancelled(state)
    state, batch = S.schedule(state, token_budget or engine.max_batch_tokens)
    if not batch.chunks:
        return state, StepOutcome({}, {}, failed=batch.failed, preempted=batch.preempted)
    new_tokens, logprobs, top = run_batch(engine, state.requests, state.allocator, batch)
    state, finished = S.apply_step(state, batch, new_tokens)
    finished = list(finished)
    for request_id in new_tokens:
        request = state.requests.get(request_id)
        if request is not None and stopped_by_string(request):
            state, ended = S.finish(state, request_id)
            finished.append(ended)
    return state, StepOutcome(new_tokens, logprobs, finished=tuple(finished), failed=batch.failed,
                              preempted=batch.preempted, num_tokens=batch.num_tokens, top_logprobs=top)
