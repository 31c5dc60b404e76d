"""transformers' ``ContinuousMixin`` entry points as functions of a model (``genfn.Model`` delegates).

``init_continuous_batching`` makes a manager (or returns the one a previous session kept with
``stop(keep_for_next_session=True)``); ``continuous_batching_context_manager`` starts and stops
it around a block; ``generate_batch`` runs a list of prompts to completion and returns
``{request_id: GenerationOutput}`` in the order of the inputs.
"""

from __future__ import annotations

import contextlib
import logging

from genfn.batching.hints import WorkloadHints
from genfn.batching.manager import UNCAPPED, ContinuousBatchingManager
from genfn.kernels.invariant import batch_invariant
from genfn.batching.results import GenerationOutput

__all__ = ["continuous_batching_context_manager", "destroy_cached_continuous_batching_manager", "generate_batch",
           "init_continuous_batching"]

logger = logging.getLogger(__name__)

_RESULT_WAIT_S = 1.0


def init_continuous_batching(model, generation_config=None, continuous_batching_config=None,
                             workload_hints: WorkloadHints | None = None, **manager_options) -> ContinuousBatchingManager:
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    wants_invariant = bool(getattr(continuous_batching_config, "batch_invariant", False)) or batch_invariant()
    # A kept manager runs in the mode it was built in: never hand it to a session of the other mode.
    if isinstance(cached, ContinuousBatchingManager) and cached.batch_invariant == wants_invariant:
        logger.info("reusing the continuous batching manager kept by the previous session")
        return cached
    return ContinuousBatchingManager(model, generation_config, continuous_batching_config, workload_hints,
                                     **manager_options)


def destroy_cached_continuous_batching_manager(model) -> None:
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if isinstance(cached, ContinuousBatchingManager):
        cached.destroy()
    if hasattr(model, "_cached_continuous_batching_manager"):
        del model._cached_continuous_batching_manager


@contextlib.contextmanager
def continuous_batching_context_manager(model, generation_config=None, block: bool = True, timeout: float | None = None,
                                        continuous_batching_config=None, persistent_manager: bool = False,
                                        warmup: bool = True, workload_hints: WorkloadHints | None = None,
                                        **manager_options):
    manager = init_continuous_batching(model, generation_config, continuous_batching_config, workload_hints,
                                       **manager_options)
    if warmup and not manager.warmed_up:
        manager.warmup()
    manager.start()
    try:
        yield manager
    finally:
        manager.stop(block=block, timeout=timeout, keep_for_next_session=persistent_manager)
        if not persistent_manager:
            manager.destroy()


def _hints(model, inputs, generation_config, max_new_tokens, concurrent: int | None, settings: dict) -> WorkloadHints:
    lengths = [len(ids) for ids in inputs]
    config = generation_config if generation_config is not None else model.generation_config
    if max_new_tokens is None:
        max_new_tokens = getattr(config, "max_new_tokens", None) or 20
    # Each prompt runs as several rows: its beams (decoding in one forward) or its sequences.
    rows = max(int(settings.get(name) or getattr(config, name, None) or 1)
               for name in ("num_beams", "num_return_sequences"))
    longest = max(lengths)
    typical = max(1, sum(lengths) // len(lengths))
    return WorkloadHints(expected_prompt_len=typical, expected_new_tokens=max_new_tokens,
                         concurrent_requests=max(1, min(len(inputs) * rows, concurrent or max(32, rows))),
                         max_prompt_len=max(longest, typical), max_new_tokens=max_new_tokens)


def generate_batch(model, inputs, generation_config=None, continuous_batching_config=None,
                   record_timestamps: bool = False, progress_bar: bool = False, persistent_manager: bool = False,
                   warmup: bool = True, **kwargs) -> dict:
    """Run every prompt of ``inputs`` (lists of token ids) to its end with continuous batching.

    ``kwargs``: generation settings for every request (``max_new_tokens``, ``do_sample``, ...),
    ``chunked_prefill`` and ``prefill_tokens_while_decoding`` (the manager's; here ``"uncapped"`` unless
    given). Returns ``{request_id: GenerationOutput}`` in the order of ``inputs``; a
    request that failed is there with its status and error.
    """
    from tqdm.auto import tqdm

    inputs = [list(ids.reshape(-1).tolist()) if hasattr(ids, "reshape") else list(ids) for ids in inputs]
    if not inputs:
        return {}
    manager_options = {k: kwargs.pop(k) for k in ("chunked_prefill", "prefill_tokens_while_decoding") if k in kwargs}
    # An offline batch wants throughput: prompts fill whatever of the budget decoding leaves, as
    # vLLM schedules (see ContinuousBatchingManager for what the serving cap trades).
    manager_options.setdefault("prefill_tokens_while_decoding", UNCAPPED)
    max_new_tokens = kwargs.pop("max_new_tokens", None)
    cb = continuous_batching_config
    hints = _hints(model, inputs, generation_config, max_new_tokens,
                   None if cb is None else cb.max_requests_per_batch, kwargs)
    results: dict = {}
    with continuous_batching_context_manager(model, generation_config, block=True, timeout=None,
                                             continuous_batching_config=cb, persistent_manager=persistent_manager,
                                             warmup=warmup, workload_hints=hints, **manager_options) as manager, \
            tqdm(total=len(inputs), disable=not progress_bar, desc=f"Solving {len(inputs)} requests",
                 unit="request") as bar:
        request_ids = manager.add_requests(inputs, max_new_tokens=max_new_tokens, record_timestamps=record_timestamps,
                                           **kwargs)
        while len(results) < len(request_ids):
            output = manager.get_result(timeout=_RESULT_WAIT_S)
            if output is None:
                if not manager.is_running():
                    break
                continue
            if output.is_finished():
                results[output.request_id] = output
                bar.update(1)
        # The loop may have ended every request as it stopped (an error): collect what is left.
        while len(results) < len(request_ids):
            output = manager.get_result(timeout=0)
            if output is None:
                break
            if output.is_finished():
                results[output.request_id] = output
    if manager.fatal_error is not None and not results:
        raise RuntimeError(f"continuous batching failed: {manager.fatal_error}") from manager.fatal_error
    return {rid: results[rid] for rid in request_ids if rid in results}


__all__ += ["GenerationOutput"]
