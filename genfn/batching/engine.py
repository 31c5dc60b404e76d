"""The engine step of continuous batching: schedule -> inputs -> packed forward -> choose tokens.

``Engine`` holds what a step needs besides the scheduler's state: the model, the paged KV cache
(donated to every forward), the padded sizes the forward is compiled for, and the forwards
compiled so far (one per padded token count, and per padded count of drafted positions). ``engine_step(engine, state, budget)`` is the
whole step as a function of the ``SchedulerState``: it returns the next state and a
``StepOutcome`` (tokens chosen, requests finished / failed / preempted). The manager thread
runs this very step on its locked ``Scheduler``'s state (``Scheduler.advance``).

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

from genfn.batching import beam_groups
from genfn.batching import blocks as B
from genfn.batching import groups as G
from genfn.batching import guidance_groups as GG
from genfn.batching import scheduling as S
from genfn.batching import sequence_groups as SG
from genfn.batching import speculation as SP
from genfn.batching.inputs import BatchInputs, bucket, build_batch_inputs, build_row_history, num_draft_logits
from genfn.batching.requests import RequestState, RequestStatus
from genfn.batching.row_state import carried_step, keep_carried, merge_request_chains
from genfn.kernels import decode_linear_available
from genfn.kernels.invariant import deterministic
from genfn.cache.paged import PackedPlan
from genfn.compile_boundary import functional
from genfn.driver import own_code
from genfn.models.registry import PACKED_FORWARDS, packed_forward
from genfn.processors.chain import ProcessorChain
from genfn.processors.context import LogitsContext
from genfn.processors.grammar import FREE_ROW
from genfn.processors.numerics import nonfinite_rows
from genfn.strategies.token_choice import choose_tokens, top_pairs
from genfn.structured import bitmask_width

__all__ = ["Engine", "RequestSettings", "StepOutcome", "compile_options", "engine_step", "fail_nonfinite", "grammar_mask",
           "nonfinite_error", "packed_plan", "run_batch", "settings_of"]


@dataclasses.dataclass(frozen=True)
class RequestSettings:
    """A request's own decoding settings (host-side values; the chain holds per-row leaves).

    ``chain``: the request's processors as a one-row per-row chain (``None``: none apply);
    ``key``: its sampling key ``[2]`` (``None``: greedy); ``stop_strings``: a matcher or ``None``;
    ``top_logprobs``: how many most likely tokens to report per generated token; ``check_finite``:
    fail the request when its raw logits hold NaN/inf (off under ``remove_invalid_values``);
    ``grammar``: the request's structured-output matcher (synced to its generated tokens before
    every mask); ``speculation``: prompt lookup or a model drafter (``genfn.batching.speculation``), or None.
    """

    chain: ProcessorChain | None = None
    key: torch.Tensor | None = None
    stop_strings: Any = None
    top_logprobs: int = 0
    check_finite: bool = True
    # response_format: a one-row genfn.structured.rows.GrammarRows (host-side matcher), or None
    grammar: Any = None
    speculation: Any = None
    # what the request carries across steps (SynthID's state, CFG's unconditional branch):
    # a genfn.batching.row_state.RowCarry, or None
    carry: Any = None

    @property
    def do_sample(self) -> bool:
        return self.key is not None


_NO_SETTINGS = RequestSettings()


def settings_of(request: RequestState) -> RequestSettings:
    return request.settings.get("genfn", _NO_SETTINGS)


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What one engine step did: ``new_tokens`` and ``logprobs`` of each request that sampled
    (``top_logprobs``: of those that asked), the requests it finished (EOS, length, stop string;
    ``by_stop_string``: the ids of those whose text ends with a stop string), failed, preempted
    and cancelled; ``batch``: what it scheduled (its drafts included); ``reused_tokens``: prompt tokens its chunks took
    from the prefix cache instead of computing them. A request whose chunk carried speculative
    drafts gets a tuple of tokens (the kept drafts and the target's next token), a list of
    logprobs and a list of top-logprobs lists, one per token."""

    new_tokens: Mapping[Hashable, int | tuple[int, ...]]
    logprobs: Mapping[Hashable, float | list[float]]
    finished: tuple[RequestState, ...] = ()
    failed: tuple[RequestState, ...] = ()
    preempted: tuple[Hashable, ...] = ()
    num_tokens: int = 0
    top_logprobs: Mapping[Hashable, list[tuple[int, float]]] = dataclasses.field(default_factory=dict)
    by_stop_string: frozenset = frozenset()
    cancelled: tuple[RequestState, ...] = ()
    batch: S.ScheduledBatch | None = None
    reused_tokens: int = 0
    # Beam requests: the score of each returned hypothesis (generate's sequences_scores), by id.
    sequence_scores: Mapping[Hashable, float] = dataclasses.field(default_factory=dict)
    # Requests whose other sequences (num_return_sequences) entered the scheduler this step.
    joined: tuple[Hashable, ...] = ()


def require_packed_forward(model):
    """The packed forward of ``model``'s family (``genfn.models.registry.packed_forward``); a
    ValueError naming the model and what runs it otherwise."""
    family = packed_forward(model)
    if family is not None:
        return family
    if getattr(model, "is_encoder_decoder", False):
        why = "an encoder-decoder model has no packed decoder forward over the paged cache"
    else:
        why = "its family declares no packed forward over the paged cache (genfn.models.registry.PACKED_FORWARDS)"
    families = ", ".join(sorted(PACKED_FORWARDS))
    raise ValueError(f"continuous batching cannot run {model!r}: {why}. Run it with genfn.generate (a static "
                     f"batch), or load a decoder-only model: a native family with a packed forward or any "
                     f"module through genfn.from_module ({families})")


def compile_options(family, continuous_batching_config, device) -> dict | None:
    """``torch.compile``'s keyword arguments for the packed forward of ``family`` under a
    ``ContinuousBatchingConfig`` (``None``: eager): its ``varlen_compile_config``, else
    ``fullgraph`` when ``default_compile_level > 0`` or on CUDA."""
    cb = continuous_batching_config
    if not getattr(family, "COMPILES", True):
        return None
    if cb.varlen_compile_config is not None:
        return {k: v for k, v in cb.varlen_compile_config.to_dict().items() if v is not None}
    if cb.default_compile_level > 0 or torch.device(device).type == "cuda":
        return {"fullgraph": True}
    return None


class Engine:
    """The model, the paged cache and the padded sizes of continuous batching's forward.

    ``max_batch_tokens`` (T), ``max_requests`` (R), ``table_width`` (W blocks per request) and
    ``max_len`` (the longest request, for the processors' history buffer) are static; the token
    axis is padded to a power of two up to T, so a handful of compiled shapes serve every batch.
    ``compile``: ``None`` runs eagerly, a dict is ``torch.compile``'s keyword arguments.
    """

    def __init__(self, model, cache, *, max_batch_tokens: int, max_requests: int, table_width: int,
                 compile: dict | None = None, batch_invariant: bool = False):
        family = require_packed_forward(model)
        # Fixed per engine: its forwards run on the manager's thread, which the caller's
        # genfn.deterministic() context does not reach, and a compiled forward bakes the mode in.
        self.batch_invariant = batch_invariant
        self.model = model
        self.cache = cache
        self.max_batch_tokens = max_batch_tokens
        self.max_requests = max_requests
        self.table_width = table_width
        self.max_len = table_width * cache.block_size
        self.device = model.device
        self.compile_options = compile
        self._apply_packed = family.apply_packed
        # The mode's linears read the plain weights (genfn.kernels.invariant): packing them would be
        # work and memory for nothing.
        packed = compile is None and not batch_invariant
        # The params generate's steps read (the native stack's table, made once per model), eager and compiled.
        params = functional(model).params
        self.params = family.pack_params(params) if packed else params
        self._forwards: dict[tuple[int, int], Any] = {}
        self._merged: tuple[tuple, ProcessorChain | None, torch.Tensor | None, torch.Tensor | None] | None = None
        self.last_logits: torch.Tensor | None = None  # the latest forward's [R, V], for beam groups

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
        return packed_plan(batch, self.cache.block_size, self.padded_tokens(batch.num_tokens), self.max_requests)

    def padded_draft_logits(self, batch: S.ScheduledBatch) -> int:
        """The extra logits positions (``BatchInputs.logits_index[R:]``) a batch with drafts runs
        at: 0 without drafts (a plain step is unchanged), compiled a power of two."""
        count = num_draft_logits(batch)
        if not self.compiled or count == 0:
            return count
        return min(bucket(count, minimum=8), self.max_batch_tokens)

    def forward(self, inputs: BatchInputs, plan: PackedPlan | None = None) -> torch.Tensor:
        """Logits ``[R + E, V]`` of the batch (``E``: the drafted positions, see ``BatchInputs``);
        the cache is updated (donated and replaced)."""
        with deterministic(self.batch_invariant):
            return self._forward(inputs, plan)

    def _forward(self, inputs: BatchInputs, plan: PackedPlan | None) -> torch.Tensor:
        if plan is not None:
            logits, self.cache = self._apply_packed(self.model.spec, self.params, inputs, self.cache, plan)
            return logits
        shapes = (inputs.input_ids.shape[0], inputs.logits_index.shape[0])  # a compiled graph's static sizes
        fn = self._forwards.get(shapes)
        if fn is None:
            spec, apply_packed = self.model.spec, self._apply_packed
            if self.compile_options is not None:
                decode_linear_available()  # build/load the native kernels now, not while dynamo traces

            def packed(params, inputs, cache):
                return apply_packed(spec, params, inputs, cache)

            fn = packed if self.compile_options is None else torch.compile(own_code(packed), dynamic=False,
                                                                          **self.compile_options)
            self._forwards[shapes] = fn
        logits, self.cache = fn(self.params, inputs, self.cache)
        return logits

    def clear_blocks(self, blocks) -> None:
        """Forget what the cache holds for ``blocks`` (in place, between steps: a failed request's
        keys and values, which may be NaN; ``clear_blocks`` of the family's cache)."""
        if blocks:
            self.cache = self.cache.clear_blocks(blocks)

    def copy_blocks(self, copies) -> None:
        """Copy whole blocks, ``(source, target)`` pairs (``blocks.fork``'s copies), in place between
        steps (``copy_blocks`` of the family's cache)."""
        if copies:
            self.cache = self.cache.copy_blocks(copies)

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
        # Whether a chunk samples is part of the key: a stateful processor runs on sampling rows only.
        ids = tuple((c.request_id, requests[c.request_id].arrival, c.samples) for c in batch.chunks)
        if self._merged is not None and self._merged[0] == ids:
            return self._merged[1:]
        settings = [settings_of(requests[r]) for r in batch.request_ids]
        chain = None
        if any(s.chain is not None for s in settings):
            chain = merge_request_chains([s.chain for s in settings], [c.samples for c in batch.chunks],
                                         self.max_requests, self.device)
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
              ) -> tuple[dict[Hashable, int], dict[Hashable, float], dict[Hashable, list[tuple[int, float]]],
                         frozenset]:
    """Forward ``batch`` (scheduled into ``allocator``) and choose each sampling row's token.

    ``requests``: the scheduler's requests after ``schedule``. Returns ``(new_tokens, logprobs,
    top_logprobs, nonfinite)`` keyed by request id, for the chunks that sample (``top_logprobs``:
    only the requests that asked for some, their ``(token_id, logprob)`` pairs, most likely first;
    ``nonfinite``: the requests whose raw logits held NaN/inf, which the caller fails, alone).
    """
    computed = SG.computed_chunks(batch)  # rows sharing another's logits (n sequences) take no tokens
    inputs = build_batch_inputs(allocator, computed, num_tokens=engine.padded_tokens(batch.num_tokens),
                                num_rows=engine.max_requests, table_width=engine.table_width, device=engine.device,
                                num_extra_logits=engine.padded_draft_logits(batch))
    drafted = engine.forward(inputs, engine.plan(computed))  # the rows' own, then drafted rows' earlier positions
    logits = SG.shared_logits(batch, drafted, engine.max_requests)
    engine.last_logits = logits
    chain, keys, do_sample = engine.batch_chain(requests, batch)
    # CFG's combination (it heads the processors, as in generate) and a stateful chain's state
    raw_logits = logits
    logits, processor_state = carried_step(requests, batch, settings_of, chain, logits, device=engine.device)
    if chain is None and keys is None:
        # Greedy rows carry no per-row leaves padded to R: only the batch's rows need a token
        # (the softmax and argmax over a [R, 49152] padding cost a few ms a step).
        logits = logits[:len(batch.chunks)]
    ctx = None
    if chain is not None or keys is not None:
        history = build_row_history(requests, batch, max_len=engine.max_len, num_rows=engine.max_requests,
                                    device=engine.device)
        ctx = LogitsContext(tokens=history.tokens, cur_len=history.cur_len, prompt_len=history.prompt_len)
    wanted = [settings_of(requests[c.request_id]).top_logprobs if c.samples else 0 for c in batch.chunks]
    choice = choose_tokens(logits, chain, ctx, keys=keys, sample_mask=do_sample, logprobs=True,
                           processor_state=processor_state,
                           top_k=max(wanted, default=0),
                           grammar_mask=grammar_mask(requests, batch, logits.shape, engine.device))
    chosen, logprobs, top_ids, top_values = choice.tokens, choice.logprobs, choice.top_ids, choice.top_logprobs
    bad_rows = nonfinite_rows(raw_logits[:len(logits)])
    chosen, logprobs, bad_rows = chosen.tolist(), logprobs.tolist(), bad_rows.tolist()  # the step's host sync
    if top_ids is not None:  # already computed by now: no further wait
        top_ids, top_values = top_ids.tolist(), top_values.tolist()
    new_tokens, new_logprobs, new_top, nonfinite = {}, {}, {}, set()
    for row, chunk in enumerate(batch.chunks):
        if chunk.num_drafts:
            continue  # its tokens are verify_drafts' below
        if chunk.samples and bad_rows[row] and settings_of(requests[chunk.request_id]).check_finite:
            nonfinite.add(chunk.request_id)
        elif chunk.samples:
            new_tokens[chunk.request_id] = chosen[row]
            new_logprobs[chunk.request_id] = logprobs[row]
            if wanted[row]:
                new_top[chunk.request_id] = top_pairs(top_ids[row], top_values[row], wanted[row])
    GG.follow(requests, batch, new_tokens, new_logprobs, settings_of)  # CFG's unconditional rows take their token
    keep_carried(requests, batch, settings_of, chain, choice.processor_state, new_tokens)
    verified = SP.verify_drafts(requests, batch, drafted, num_rows=engine.max_requests, max_len=engine.max_len)
    for request_id, (tokens, token_logprobs, tops, bad) in verified.items():
        if bad:
            nonfinite.add(request_id)
            continue
        new_tokens[request_id], new_logprobs[request_id] = tuple(tokens), token_logprobs
        if tops:
            new_top[request_id] = tops
    return new_tokens, new_logprobs, new_top, frozenset(nonfinite)


def fail_nonfinite(engine: Engine, state: S.SchedulerState, request_id: Hashable
                   ) -> tuple[S.SchedulerState, RequestState | None]:
    """End a request whose logits were NaN/inf, FAILED. Its keys/values may be non-finite too: its
    blocks leave the prefix cache, and those no other request holds are zeroed, because a later
    request handed one of them reads its stale slots masked out, and ``0 * NaN`` is NaN."""
    # A group member (CFG's unconditional request) ends with its group, and so do its blocks.
    members = G.members_with(state.groups, G.member_index(state.groups), request_id) if state.groups else (request_id,)
    orphaned = B.held_only_by(state.allocator, members)
    state, ended = S.finish(state, request_id, RequestStatus.FAILED, nonfinite_error(request_id), keep_cached=False)
    engine.clear_blocks(orphaned)
    return state, ended


def nonfinite_error(request_id: Hashable) -> str:
    """The error a request fails with when the model gave it NaN or infinite logits."""
    return (f"NonFiniteLogitsError: the model produced NaN or infinite logits for request {request_id!r}; pass "
            f"remove_invalid_values=True to replace them and keep generating, or check the model's weights and dtype")


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


def packed_plan(batch: S.ScheduledBatch, block_size: int, num_tokens: int | None = None,
                num_rows: int | None = None) -> PackedPlan:
    """Where each chunk of ``batch`` sits on the token axis (as ``build_batch_inputs`` lays it out),
    how many blocks its row's keys span, and which rows sample; with drafts, the extra logits
    entries ``num_rows ..`` (``num_rows``: the inputs' ``R``) sample too."""
    decode, prefill, sample_rows, prompt_lens, first = [], [], [], [], 0
    for row, chunk in enumerate(batch.chunks):
        count = len(chunk.token_ids)
        blocks = -(-chunk.end // block_size)
        in_prompt = chunk.num_drafts == 0 and chunk.end <= chunk.prompt_len
        prompt_lens.append(chunk.prompt_len if in_prompt else 0)
        if count == 1 and not in_prompt:
            decode.append((first, row, blocks))
        else:
            prefill.append((first, count, row, blocks))
        if chunk.samples:
            sample_rows.append(row)
        first += count
    extra = num_draft_logits(batch)
    if extra:
        rows = len(batch.chunks) if num_rows is None else num_rows
        sample_rows.extend(range(rows, rows + extra))
    return PackedPlan(first if num_tokens is None else num_tokens, tuple(decode), tuple(prefill), tuple(sample_rows),
                      batch.request_ids, tuple(prompt_lens))


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
    """One step as a function of the scheduler's state (the cache is the engine's, donated):
    schedule, forward, choose tokens, apply them, end the requests a stop string stopped.
    The batching manager's loop runs exactly this step."""
    state, cancelled = S.clear_cancelled(state)
    token_budget = token_budget or engine.max_batch_tokens
    # Room kept for drafts shrinks this step's budget, not what a forward holds: a whole prompt
    # that fits a forward waits for the room rather than fail.
    state, batch = S.schedule(state, SP.schedule_budget(state, token_budget), max_batch_tokens=token_budget)
    state, batch = SP.add_drafts(state, batch, token_budget=token_budget, max_len=engine.max_len,
                                model=engine.model)
    state, batch, joined = SG.add_sequences(state, batch, engine.max_requests)
    if not batch.chunks:
        return state, StepOutcome({}, {}, failed=batch.failed, preempted=batch.preempted, cancelled=cancelled,
                                  batch=batch)
    # (a row sharing another's logits computes nothing: the reuse counts at the sequence's first chunk)
    reused = sum(chunk.start for chunk in batch.chunks
                 if chunk.token_ids and chunk.start and chunk.start == state.requests[chunk.request_id].num_reused)
    new_tokens, logprobs, top, nonfinite = run_batch(engine, state.requests, state.allocator, batch)
    engine.copy_blocks(joined.copies)  # the forward wrote the leaders' last prompt blocks
    failed = list(batch.failed)
    for request_id in nonfinite:
        state, ended = fail_nonfinite(engine, state, request_id)
        failed.append(ended)
    # Beam groups take their beam step on their rows' logits (genfn.batching.beam_groups); rows that
    # drafted drop their rejected drafts (genfn.batching.speculation) before the tokens are applied.
    state, beams = beam_groups.advance(engine, state, batch, engine.last_logits)
    failed.extend(beams.failed)
    new_tokens = {r: t for r, t in new_tokens.items() if r not in beams.rows}
    state, kept = SP.rewind(state, beams.rest(batch), new_tokens)
    state, finished = S.apply_step(state, kept, new_tokens)
    finished += beams.finished
    ended = {request.request_id for request in finished}
    # Each request that got a token is matched against its stop strings once: a finished one to
    # report why it stopped, a running one to end it.
    by_string = {request.request_id for request in finished if stopped_by_string(request, engine.device)}
    finished = list(finished)
    for request_id in new_tokens:
        request = state.requests.get(request_id)
        if request_id not in ended and request is not None and stopped_by_string(request, engine.device):
            state, stopped = S.finish(state, request_id)
            finished.append(stopped)
            by_string.add(request_id)
    state = GG.drop_partners(state, finished)
    return state, StepOutcome(new_tokens, logprobs, finished=tuple(finished), failed=tuple(failed),
                              preempted=batch.preempted, num_tokens=batch.num_tokens, top_logprobs=top,
                              by_stop_string=frozenset(by_string), cancelled=cancelled, batch=batch,
                              reused_tokens=reused, sequence_scores=beams.scores, joined=joined.leaders)
