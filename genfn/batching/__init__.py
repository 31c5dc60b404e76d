"""Continuous batching: the pure core (block allocator, schedulers, per-step index tensors, sizing hints).

``blocks``: the paged cache's block allocator with prefix caching; ``requests``: the request
record; ``scheduling``: ``SchedulerState`` and the pure scheduling functions; ``scheduler``:
transformers' ``Scheduler`` classes over them; ``inputs``: the index tensors of a packed
forward; ``hints``: ``WorkloadHints`` to default sizes; ``engine``: the step (packed forward,
per-request processors and sampling); ``settings``: a request's own generation settings;
``manager`` / ``results`` / ``api``: the thread, its outputs and transformers' entry points;
``metrics``: ``EngineMetrics`` snapshots; ``tensor_parallel``: the managers of a model's tensor-parallel ranks
(rank 0 leads, the others follow its engine's commands). The token choice and its log-probabilities are
``genfn.strategies.token_choice`` (``generate``'s too). The key/value tensors and the attention
over a packed batch are ``genfn.cache.paged``.
"""

from genfn.batching.blocks import BlockAllocator, init_allocator
from genfn.batching.hints import BatchingSizes, WorkloadHints, kv_bytes_per_block, resolve
from genfn.batching.inputs import BatchInputs, RowHistory, bucket, build_batch_inputs, build_row_history
from genfn.batching.requests import RequestState, RequestStatus, make_request
from genfn.batching.scheduler import SCHEDULERS, FIFOScheduler, PrefillFirstScheduler, Scheduler, make_scheduler
from genfn.batching.api import (
    continuous_batching_context_manager,
    destroy_cached_continuous_batching_manager,
    generate_batch,
    init_continuous_batching,
)
from genfn.batching.engine import Engine, RequestSettings, engine_step
from genfn.batching.manager import ContinuousBatchingManager, sequence_ids
from genfn.batching.tensor_parallel import FollowerManager, LeaderManager  # registers the ranks' managers
from genfn.batching.metrics import EngineMetrics, Histogram
from genfn.batching.results import GenerationOutput
from genfn.batching.scheduling import (
    ScheduledBatch,
    ScheduledChunk,
    SchedulerPolicy,
    SchedulerState,
    apply_step,
    init_scheduler,
    schedule,
)

__all__ = [
    "SCHEDULERS",
    "BatchInputs",
    "BatchingSizes",
    "BlockAllocator",
    "ContinuousBatchingManager",
    "Engine",
    "EngineMetrics",
    "FollowerManager",
    "GenerationOutput",
    "Histogram",
    "LeaderManager",
    "RequestSettings",
    "FIFOScheduler",
    "PrefillFirstScheduler",
    "RequestState",
    "RequestStatus",
    "RowHistory",
    "ScheduledBatch",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerPolicy",
    "SchedulerState",
    "WorkloadHints",
    "apply_step",
    "bucket",
    "build_batch_inputs",
    "build_row_history",
    "continuous_batching_context_manager",
    "destroy_cached_continuous_batching_manager",
    "engine_step",
    "generate_batch",
    "init_continuous_batching",
    "init_allocator",
    "init_scheduler",
    "kv_bytes_per_block",
    "make_request",
    "make_scheduler",
    "resolve",
    "schedule",
    "sequence_ids",
]
