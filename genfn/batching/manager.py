"""``ContinuousBatchingManager``: transformers' API as a thin thread around the pure engine.

The functional core is the scheduler (``scheduling``) and the engine step (``engine``); this
module is the imperative shell. Other threads only put things in queues (requests, cancellations)
or flip flags (stop, pause); the loop thread alone drives the scheduler and the cache:

    drain new requests -> apply cancellations -> [pause] -> schedule -> forward -> choose tokens
    -> update the scheduler -> deliver outputs

Every request ends exactly once with one terminal output (FINISHED, CANCELLED or FAILED with an
error): ``_end`` is the only place a terminal output is made, and it forgets the request. An
exception in the loop fails every request in flight with that error, closes the result store so
every waiter wakes, and leaves the manager startable again (with a fresh cache and scheduler).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Hashable, Iterator

import torch

from genfn.batching.beam_groups import check_beams_fit
from genfn.batching.beam_groups import leader_request as beam_leader
from genfn.batching.engine import Engine, compile_options, engine_step, require_packed_forward
from genfn.batching.hints import WorkloadHints, resolve
from genfn.batching.metrics import EngineMetrics, MetricsRecorder
from genfn.batching.ranks import RankRoles
from genfn.batching.requests import RequestStatus, sequence_ids
from genfn.batching.results import GenerationOutput, OutputRouter, RequestRecord
from genfn.batching.scheduler import make_scheduler
from genfn.batching.sequence_groups import leader_request
from genfn.batching.settings import request_settings, sequence_requests
from genfn.kernels import release_thread_pool
from genfn.kernels.invariant import mode_for_manager

__all__ = ["ContinuousBatchingManager", "sequence_ids"]

logger = logging.getLogger(__name__)

_STOP_WAIT_S = 0.1  # how long the idle loop sleeps before looking at its flags again

# ``prefill_tokens_while_decoding`` that opens the whole token budget to prompt tokens.
UNCAPPED = "uncapped"


class ContinuousBatchingManager(RankRoles):  # a tensor-parallel model's ranks: genfn.batching.tensor_parallel
    """Requests in, results out, a background thread doing the batching in between.

    ``generation_config``: the defaults every request starts from (a request's own keyword
    arguments win). ``continuous_batching_config``: sizes, scheduler, prefix sharing, compile;
    ``workload_hints``: what the sizes left unset are picked for (``None``: the defaults, with any
    one request allowed the model's whole context, ``WorkloadHints.for_context``). ``chunked_prefill``: split a
    prompt longer than the token budget across forwards (``None``: the config's ``chunked_prefill``).
    ``prefill_tokens_while_decoding``: the prompt tokens a forward carries while requests decode
    (``None``: a quarter of the token budget, at least 32, for serving, where the tail of the
    inter-token latency counts; ``"uncapped"``: the whole budget, vLLM's behaviour, what
    ``generate_batch`` runs by default); see ``SchedulerPolicy``. On 16 mixed requests x 32 tokens
    (float32, budget 512) the quarter cut the inter-token latency p90 from 1.2-1.3 s to 0.47 s at
    0.95x the uncapped throughput; on the full 64 mixed requests x 128 tokens it cut p90 from 867
    to 541 ms but cost 20 % of the throughput (106 vs 132 tok/s) and raised the time to first
    token p50 from 15 to 24 s and the inter-token p50 from 257 to 375 ms (half the budget: 119
    tok/s, p90 684 ms); benchmarks/batching.py's genfn-cb-capped against genfn-cb.
    ``metrics()`` is a snapshot of the engine's counters, safe to take from any thread.
    """

    def __init__(self, model, generation_config=None, continuous_batching_config=None,
                 workload_hints: WorkloadHints | None = None, *, chunked_prefill: bool | None = None,
                 prefill_tokens_while_decoding: int | None = None):
        from genfn.config.batching import ContinuousBatchingConfig

        if continuous_batching_config is None:
            continuous_batching_config = ContinuousBatchingConfig()
        if not isinstance(continuous_batching_config, ContinuousBatchingConfig):
            raise TypeError(f"`continuous_batching_config` must be a ContinuousBatchingConfig, got "
                            f"{type(continuous_batching_config).__name__}")
        self._family = require_packed_forward(model)  # refuse a model batching cannot run, up front
        self.model = model
        self.generation_config = generation_config
        self.continuous_batching_config = continuous_batching_config
        # Hints the caller gives describe its requests (generate_batch's and the batch CLI's, its very
        # prompts); the default ones only a bound on any request, which sizes no forward.
        self._hints_given = workload_hints is not None
        self.workload_hints = workload_hints or WorkloadHints.for_context(getattr(model, "max_position_embeddings", None))
        if chunked_prefill is not None and not isinstance(chunked_prefill, bool):
            raise TypeError(f"`chunked_prefill` must be a bool or None, got {type(chunked_prefill).__name__}")
        self.chunked_prefill = continuous_batching_config.chunked_prefill if chunked_prefill is None else chunked_prefill
        self.batch_invariant = mode_for_manager(continuous_batching_config.batch_invariant)
        if prefill_tokens_while_decoding not in (None, UNCAPPED) and (isinstance(prefill_tokens_while_decoding, bool) or not isinstance(
                prefill_tokens_while_decoding, int) or prefill_tokens_while_decoding < 1):
            raise ValueError(f"`prefill_tokens_while_decoding` must be an int >= 1, {UNCAPPED!r} or None, got "
                             f"{prefill_tokens_while_decoding!r}")
        self.prefill_tokens_while_decoding = prefill_tokens_while_decoding
        self._inputs: queue.Queue = queue.Queue()
        self._cancels: queue.Queue = queue.Queue()
        self._cancels_early: list = []  # cancellations of requests still on their way to the scheduler
        self._metrics = MetricsRecorder()
        self._wake = threading.Event()
        self._router = OutputRouter()
        self._records: dict[Hashable, RequestRecord] = {}
        self._live: set = set()  # requests added and not yet ended
        self._held: dict = {}  # a request's further sequences' ids, until they join the scheduler (guarded by _lock)
        self._beam_sequences: dict = {}  # a beam request's further sequence ids (guarded by _lock)
        self._lock = threading.Lock()  # guards _live and _records
        # Closes the input queue when the loop exits, so no request is queued after its last drain.
        self._gate = threading.Lock()
        self._closing = False
        self._sizes_cache = None
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop_mode: str | None = None  # None, "flush" or "hard"
        self._pause = threading.Condition()
        self._pause_holders = 0
        self._paused = False
        self._pause_owner = threading.local()
        self.fatal_error: BaseException | None = None
        self.engine: Engine | None = None
        self.scheduler = None
        self.warmed_up = False
        self._destroyed = False
        # Counts of what the loop did (steps, tokens, preemptions, prompt tokens reused from the prefix
        # cache or computed).
        self.stats: collections.Counter = collections.Counter()

    # -- sizes and construction ----------------------------------------------------------------

    def _sizes(self):
        if self._sizes_cache is not None:
            return self._sizes_cache
        cb = self.continuous_batching_config
        spec = self.model.spec
        sizes = resolve(self.workload_hints, block_size=cb.page_size, num_blocks=cb.num_blocks,
                        max_batch_tokens=cb.max_batch_tokens, max_requests_per_batch=cb.max_requests_per_batch,
                        num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                        dtype=self.model.dtype, whole_prompts=self._hints_given and not self.chunked_prefill)
        if cb.max_blocks_per_request:
            sizes = dataclasses.replace(sizes, max_blocks_per_request=min(cb.max_blocks_per_request,
                                                                          sizes.num_blocks))
        self._sizes_cache = sizes
        return sizes

    def _build(self) -> None:
        cb = self.continuous_batching_config
        sizes = self._sizes()
        width = sizes.max_blocks_per_request
        cache = self._family.init_packed_cache(self.model.spec, sizes.num_blocks, sizes.block_size,
                                               dtype=self.model.dtype, device=self.model.device)
        self.engine = self._engine_class(self.model, cache, max_batch_tokens=sizes.max_batch_tokens,
                                         max_requests=sizes.max_requests_per_batch, table_width=width,
                                         compile=compile_options(self._family, cb, self.model.device),
                                         batch_invariant=self.batch_invariant)
        self.scheduler = make_scheduler(cb.scheduler_type, sizes.num_blocks, sizes.block_size,
                                        safety_margin=cb.safety_margin,
                                        max_requests_per_batch=sizes.max_requests_per_batch,
                                        chunked_prefill=self.chunked_prefill, prefix_caching=cb.allow_block_sharing,
                                        max_blocks_per_request=width,
                                        prefill_tokens_while_decoding=self._prefill_cap(sizes.max_batch_tokens),
                                        prefix_cache_boundary=getattr(self.model.spec, "original_context", 0) or None)

    def _prefill_cap(self, token_budget: int) -> int:
        # A quarter: with a forward's time about linear in its tokens (the GEMMs dominate), 64
        # decode rows plus 128 prompt tokens take ~3 decode steps' time instead of ~9 at 512.
        if self.prefill_tokens_while_decoding == UNCAPPED:
            return token_budget
        if self.prefill_tokens_while_decoding is not None:
            return self.prefill_tokens_while_decoding
        return max(32, token_budget // 4)

    def switch_to_cb_friendly_attn(self, model=None, auto_switch_to_flash: bool = True) -> None:
        """transformers switches the model to a paged attention kernel here; genfn's packed forward
        always runs paged attention, so there is nothing to switch."""

    def warmup(self) -> None:
        """Build the cache and run (compiling, when on) every padded forward shape ahead."""
        if self.engine is None:
            self._build()
        if self.is_running():
            raise RuntimeError("warmup() must run before start(): the loop owns the cache while it runs")
        self.engine.warmup()
        self.warmed_up = True

    # -- control flow ----------------------------------------------------------------------------

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._destroyed:
            raise RuntimeError("this manager was destroyed; create a new one")
        if self.is_running():
            logger.warning("the continuous batching loop is already running")
            return
        self._stop_mode = None
        self.fatal_error = None
        self._closing = False
        self._router.open()
        if self.engine is None:
            self._build()
        # Loading, packing and warm-up ran torch work on this thread: its OpenMP pool would slow
        # every parallel region of the loop's (genfn/kernels/thread_pool.cpp).
        release_thread_pool()
        self._thread = threading.Thread(target=self._run, name="genfn-continuous-batching", daemon=True,
                                        kwargs={"inference_mode": torch.is_inference_mode_enabled()})
        self._thread.start()

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False) -> None:
        """Stop the loop: after the requests in flight finish, or (``hard_stop``) at once, failing them.

        ``keep_for_next_session``: keep the cache and compiled shapes, and cache this manager on
        the model for the next ``init_continuous_batching``.
        """
        if getattr(self._pause_owner, "depth", 0):
            raise RuntimeError("cannot stop the manager from inside pause(): the loop is paused and could not exit")
        if self._thread is None:
            logger.warning("the continuous batching manager was not started")
            return
        self._stop_mode = "hard" if hard_stop else (self._stop_mode or "flush")
        self._wake.set()
        with self._pause:
            self._pause.notify_all()
        if block:
            self.join(time.perf_counter(), timeout)
        if keep_for_next_session:
            self.model._cached_continuous_batching_manager = self
        elif not self.is_running():
            self.engine = self.scheduler = None
            self.warmed_up = False

    def join(self, stop_trigger_time: float | None = None, timeout: float | None = None) -> None:
        thread = self._thread
        if thread is None:
            return
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("the continuous batching loop did not exit within %s s", timeout)
        else:
            self._thread = None

    def destroy(self) -> None:
        """Stop (hard) and release the cache; the manager cannot start again. Safe to call twice."""
        if self.is_running():
            self.stop(block=True, hard_stop=True)
        self._fail_queued("the continuous batching manager was destroyed")
        self.engine = self.scheduler = None
        self._destroyed = True
        if getattr(self.model, "_cached_continuous_batching_manager", None) is self:
            del self.model._cached_continuous_batching_manager

    @contextlib.contextmanager
    def pause(self):
        """Hold the loop between steps (cache and requests kept); several threads may hold it, the
        loop resumes when the last one leaves."""
        if not self.is_running():
            raise RuntimeError("cannot pause: the continuous batching loop is not running")
        with self._pause:
            self._pause_holders += 1
            self._wake.set()
            while not self._paused and self.is_running():
                self._pause.wait(_STOP_WAIT_S)
        self._pause_owner.depth = getattr(self._pause_owner, "depth", 0) + 1
        try:
            yield self
        finally:
            self._pause_owner.depth -= 1
            with self._pause:
                self._pause_holders -= 1
                self._pause.notify_all()

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, input_ids, request_id: Hashable | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False, eos_token_id=None,
                    **settings) -> Hashable:
        """Queue a request; returns its id. ``settings``: see :meth:`add_sequences`. With
        ``num_return_sequences=n`` its sequences are the requests ``sequence_ids(request_id, n)``."""
        return self.add_sequences(input_ids, request_id, max_new_tokens, streaming, record_timestamps, eos_token_id,
                                  **settings)[0]

    def add_sequences(self, input_ids, request_id: Hashable | None = None, max_new_tokens: int | None = None,
                      streaming: bool = False, record_timestamps: bool = False, eos_token_id=None, *,
                      top_logprobs: int = 0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                      logit_bias: dict[int, float] | None = None, **logit_processor_kwargs) -> list[Hashable]:
        """Queue a request; returns the ids of its sequences (``num_return_sequences``, default 1:
        the request's own id, then ``sequence_ids``'). ``logit_processor_kwargs``: any ``GenerationConfig``
        setting for this request alone (``do_sample``, ``temperature``, ``repetition_penalty``,
        ``no_repeat_ngram_size``, ``min_new_tokens``, ``stop_strings``, ...), plus ``seed=`` or ``key=``,
        and ``tokenizer=`` for ``stop_strings`` (default: the model's).

        OpenAI's settings: ``presence_penalty`` / ``frequency_penalty`` in [-2, 2] subtract
        ``presence * [count > 0] + frequency * count`` from each token's logit (``count``: its
        occurrences in this request's generated tokens); ``logit_bias`` adds a bias in [-100, 100]
        to token ids; ``top_logprobs`` (0..20) most likely tokens are reported per generated token
        (``GenerationOutput.top_logprobs``). All are per request: requests with different values
        share a batch. ``response_format`` (structured outputs, as ``generate`` takes it) constrains
        this request alone; a schema, regex or grammar that cannot be compiled raises ValueError here.
        ``num_beams > 1``: beam search as ``generate`` runs it (``genfn.batching.beam_groups``)."""
        if self._destroyed:
            raise RuntimeError("this manager was destroyed; create a new one")
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.reshape(-1).tolist()
        if request_id is None:
            request_id = f"req_{next(self._ids)}"
        prompt = list(input_ids)
        cap = self._sizes()
        max_len = cap.max_blocks_per_request * cap.block_size
        logit_processor_kwargs = dict(logit_processor_kwargs)
        tokenizer = logit_processor_kwargs.pop("tokenizer", None)  # for stop_strings, as generate takes it
        resolved = request_settings(self.model, prompt, self.generation_config, logit_processor_kwargs,
                                    max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, max_len=max_len,
                                    tokenizer=tokenizer,
                                    top_logprobs=top_logprobs, presence_penalty=presence_penalty,
                                    frequency_penalty=frequency_penalty, logit_bias=logit_bias)
        prompt = list(resolved.prompt_ids)  # healed under token_healing
        ids = sequence_ids(request_id, len(resolved.sequences))
        if resolved.beam is not None:
            check_beams_fit(resolved.beam.num_beams, cap.max_requests_per_batch, cap.max_batch_tokens)
            states = [beam_leader(request_id, prompt, resolved.settings, resolved.beam, ids)]
        else:
            # The request's sequences: its first, carrying the others until the prompt is computed.
            states = [leader_request(sequence_requests(ids, resolved))]
        now = time.perf_counter()
        with self._lock:
            taken = [rid for rid in ids if rid in self._live]
            if taken:
                raise ValueError(f"request id {taken[0]!r} is already in flight")
            for rid in ids:
                self._live.add(rid)
                self._records[rid] = RequestRecord(list(prompt), bool(streaming), bool(record_timestamps), now,
                                                   resolved.settings.top_logprobs)
            if resolved.beam is not None:
                self._beam_sequences[request_id] = ids[1:]
            if resolved.beam is None and len(ids) > 1:  # genfn.batching.sequence_groups
                self._held[request_id] = ids[1:]
        with self._gate:
            refused = self._closing or (self._stop_mode is not None and self.is_running())
            if not refused:
                self._inputs.put(states[0])
        if refused:
            self._end(request_id, RequestStatus.FAILED, (), "the continuous batching manager is stopping or "
                                                            "stopped; start() it before adding requests")
        self._wake.set()
        return ids

    def add_requests(self, inputs, max_new_tokens: int | None = None, streaming: bool = False,
                     record_timestamps: bool = False, **logit_processor_kwargs) -> list[Hashable]:
        """Queue every prompt of ``inputs``; returns the ids of all their sequences, in order."""
        return [rid for ids in inputs for rid in self.add_sequences(
            ids, max_new_tokens=max_new_tokens, streaming=streaming, record_timestamps=record_timestamps,
            **logit_processor_kwargs)]

    def cancel_request(self, request_id: Hashable) -> None:
        """Cancel a request in flight (it ends CANCELLED); no effect on one that has ended."""
        with self._lock:  # any sequence id of a beam request cancels the whole request
            request_id = next((r for r, seqs in self._beam_sequences.items() if request_id in seqs), request_id)
        self._cancels.put(request_id)
        self._wake.set()

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt and generated) one request may hold: the paged cache's room for
        one request, or the model's context when that is smaller. ``prompt + max_new_tokens``
        within it always fits; a request that grows further fails (the last token needs no cache
        room, so one more may fit), so a server refuses ``prompt + max_tokens`` beyond it up front."""
        sizes = self._sizes()
        room = sizes.block_size * min(sizes.max_blocks_per_request, sizes.num_blocks)
        context = self.model.max_position_embeddings
        return room if context is None else min(room, context)

    def metrics(self) -> EngineMetrics:
        """A snapshot of the engine's counters, latency histograms, queue and KV blocks (any thread)."""
        scheduler = self.scheduler  # read once: the loop may drop it after an error
        if scheduler is None:
            return self._metrics.snapshot(waiting=self._inputs.qsize(), kv_blocks_total=self._sizes().num_blocks)
        state = scheduler.state  # an immutable snapshot
        alloc = state.allocator
        return self._metrics.snapshot(running=len(state.active), waiting=len(state.waiting) + self._inputs.qsize(),
                                      kv_blocks_total=alloc.num_blocks,
                                      kv_blocks_used=sum(1 for refs in alloc.refs if refs),
                                      kv_blocks_cached=len(alloc.evictable))

    def _producing(self) -> bool:
        return self.is_running()

    def get_result(self, request_id: Hashable | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output (of ``request_id`` when given), waiting up to ``timeout`` seconds; ``None``
        when none came in time or the loop is not running and nothing is left."""
        return self._router.take(request_id, timeout, self._producing)

    def __iter__(self) -> Iterator[GenerationOutput]:
        while self._producing() or self._router.pending():
            out = self.get_result(timeout=_STOP_WAIT_S)
            if out is not None:
                yield out

    def request_id_iter(self, request_id: Hashable) -> Iterator[GenerationOutput]:
        """The outputs of one request as they come (every token when streaming), up to its end."""
        while True:
            out = self.get_result(request_id, timeout=_STOP_WAIT_S)
            if out is not None:
                yield out
                if out.is_finished():
                    return
            elif not self._producing() and request_id not in self._live:
                return

    def register_result_handler(self, request_id: Hashable, callback) -> None:
        """Deliver the request's outputs to ``callback`` on the calling thread's running asyncio loop
        (``call_soon_threadsafe``); the handler is removed when the request ends."""
        self._router.register(request_id, callback, asyncio.get_running_loop())

    def remove_result_handler(self, request_id: Hashable) -> None:
        """Nobody listens to the request any more: drop its outputs (the request itself runs on
        until it ends or is cancelled)."""
        self._router.ignore(request_id)

    # -- the loop (background thread only) -------------------------------------------------------

    def _run(self, inference_mode: bool) -> None:
        error = None
        try:
            with torch.inference_mode(inference_mode):
                while self._loop_once():
                    pass
        except Exception as exc:  # noqa: BLE001 - every error ends the in-flight requests with it
            logger.error("error in the continuous batching loop: %s", exc, exc_info=True)
            error = exc
            self.fatal_error = exc
        finally:
            message = (f"{type(error).__name__}: {error}" if error is not None
                       else "the continuous batching loop stopped before the request finished")
            with self._gate:
                self._closing = True
            self._fail_in_flight(message)
            if error is not None:
                self.engine = self.scheduler = None  # the donated cache may be half written
            with self._pause:
                self._paused = False
                self._pause.notify_all()
            self._router.close()

    def _loop_once(self) -> bool:
        self._drain_inputs()
        self._apply_cancellations()
        if self._stop_mode == "hard":
            return False
        if self._pause_holders:
            self._hold_pause()
            return True
        if self.scheduler.has_pending_requests():
            self._step()
            return True
        if self._stop_mode == "flush" and self._inputs.empty():
            return False
        self._wake.wait(_STOP_WAIT_S)
        self._wake.clear()
        return True

    def _hold_pause(self) -> None:
        with self._pause:
            self._paused = True
            self._pause.notify_all()
            while self._pause_holders and self._stop_mode != "hard":
                self._pause.wait(_STOP_WAIT_S)
            self._paused = False

    def _drain_inputs(self) -> None:
        while True:
            try:
                state = self._inputs.get_nowait()
            except queue.Empty:
                return
            self.scheduler.add_waiting_request(state)

    def _apply_cancellations(self) -> None:
        asked = False
        early, self._cancels_early = self._cancels_early, []
        while True:
            try:
                early.append(self._cancels.get_nowait())
            except queue.Empty:
                break
        for request_id in early:
            if request_id in self.scheduler.state.requests:
                self.scheduler.set_request_cancellation(request_id)
                asked = True
            elif request_id in self._live:
                # Added but queued after this loop's drain: cancel it once it reaches the scheduler.
                self._cancels_early.append(request_id)
        if asked:
            for request in self.scheduler.clear_cancelled_requests():
                self._end(request.request_id, RequestStatus.CANCELLED, request.generated_ids)

    def _step(self) -> None:
        engine = self.engine
        scheduled_at = time.perf_counter()
        outcome = self.scheduler.advance(lambda state: engine_step(engine, state, engine.max_batch_tokens))
        with self._lock:
            for request_id in outcome.joined:
                self._held.pop(request_id, None)  # the sequences are requests of the scheduler's now
        for request in outcome.cancelled:
            self._end(request.request_id, RequestStatus.CANCELLED, request.generated_ids)
        for request in outcome.failed:
            self._end(request.request_id, RequestStatus.FAILED, request.generated_ids, request.error)
        if not outcome.batch.chunks:
            self._wake.wait(0.001)  # blocks are held by requests in flight; look again shortly
            return
        self._record(outcome, scheduled_at)
        for request in outcome.finished:
            stopped = request.request_id in outcome.by_stop_string or request.generated_ids[-1] in request.eos_token_ids
            self._end(request.request_id, RequestStatus.FINISHED, request.generated_ids,
                      finish_reason="stop" if stopped else "length",
                      sequence_score=outcome.sequence_scores.get(request.request_id))

    def _record(self, outcome, scheduled_at: float) -> None:
        """Keep the step's logprobs and timings on the requests' records, stream the tokens of the
        requests still running, and count the step in the metrics."""
        now = time.perf_counter()
        self.stats.update(steps=1, tokens=outcome.num_tokens, preempted=len(outcome.preempted))
        self.stats.update(reused_tokens=outcome.reused_tokens, prompt_tokens_computed=outcome.batch.prompt_tokens)
        for chunk in outcome.batch.chunks:
            record = self._records.get(chunk.request_id)
            if record is not None and record.started < 0:
                record.started = scheduled_at
        ended = {request.request_id for request in outcome.finished}
        running = self.scheduler.state.requests
        first_latencies, inter_latencies, prompt_tokens, generated = [], [], 0, 0
        for request_id in outcome.new_tokens:
            record = self._records.get(request_id)
            if record is None:
                continue
            generated += record.add_step(outcome.new_tokens[request_id], outcome.logprobs[request_id],
                                         outcome.top_logprobs.get(request_id), now)
            if record.last_token < 0:
                first_latencies.append(now - record.created_time)
                prompt_tokens += len(record.prompt_ids)
            else:
                inter_latencies.append(now - record.last_token)
            record.last_token = now
            if record.streaming and request_id not in ended and request_id in running:
                self._router.deliver(self._output(request_id, RequestStatus.DECODING,
                                                  running[request_id].generated_ids))
        self._metrics.record_step(now, generated, first_latencies, inter_latencies,
                                  prompt_tokens, outcome.reused_tokens)

    # -- endings ---------------------------------------------------------------------------------

    def _output(self, request_id, status, generated, error=None, ended: float = -1.0,
                finish_reason: str | None = None, sequence_score: float | None = None) -> GenerationOutput:
        return self._records[request_id].output(request_id, status, generated, error, ended, finish_reason,
                                                sequence_score)

    def _end(self, request_id, status: RequestStatus, generated, error: str | None = None,
             finish_reason: str | None = None, sequence_score: float | None = None) -> None:
        """The one way a request ends: one terminal output, then it is forgotten."""
        with self._lock:
            if request_id not in self._live:
                return
            self._live.discard(request_id)
            output = self._output(request_id, status, generated, error, time.perf_counter(), finish_reason,
                                  sequence_score)
            del self._records[request_id]
            held = self._held.pop(request_id, ())
            beams = self._beam_sequences.pop(request_id, ())
        self._metrics.record_end(status)
        self._router.deliver(output)
        for sequence_id in held:  # it ended before its prompt was computed: so do its other sequences
            self._end(sequence_id, status, (), error)
        if status != RequestStatus.FINISHED:  # a beam request's other hypotheses end with it (finished: each its own)
            for rid in beams:
                self._end(rid, status, (), error)

    def _fail_queued(self, message: str) -> None:
        while True:
            try:
                state = self._inputs.get_nowait()
            except queue.Empty:
                break
            self._end(state.request_id, RequestStatus.FAILED, (), message)

    def _fail_in_flight(self, message: str) -> None:
        """Fail every request the loop holds or has queued (after a hard stop or an error)."""
        if self.scheduler is not None:
            for request_id, request in list(self.scheduler.state.requests.items()):
                self.scheduler.finish_request(request_id, RequestStatus.FAILED, message)
                self._end(request_id, RequestStatus.FAILED, request.generated_ids, message)
        self._fail_queued(message)
