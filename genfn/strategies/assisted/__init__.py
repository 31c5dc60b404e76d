"""Assisted (speculative) decoding: verification, draft-length schedules and proposers, as pure functions.

``verify`` decides which drafts a row keeps (``stats`` counts them); ``schedule`` sizes drafts and adapts the assistant's
confidence threshold; ``drafter`` is the interface proposers implement; ``prompt_lookup`` is the
proposer that drafts from the row's own tokens; ``draft_model``, ``early_exit``, ``mtp`` and
``block`` are the model-running proposers; ``universal`` drafts with an assistant of another
tokenizer, re-encoding through text on the host before each (pure) verification. ``step`` is the
speculative step that composes a proposer with one verifying target forward and the caches'
``rewind``; ``build`` picks the proposer a ``generate`` call asks for.
"""

from genfn.strategies.assisted.drafter import Draft, DraftInput, Drafter, PromptLookupDrafter, check_ensemble_weight
from genfn.strategies.assisted.prompt_lookup import propose_prompt_lookup
from genfn.strategies.assisted.schedule import (
    ConfidenceState,
    DraftSchedule,
    confident_length,
    draft_budget,
    init_confidence,
    init_schedule,
    roc_optimal_threshold,
    schedule_for_next_call,
    update_confidence,
    update_schedule,
)
from genfn.strategies.assisted.stats import AcceptanceStats, init_stats, record
from genfn.strategies.assisted.step import GenerateAssistedOutput, SpeculativeState, speculative_strategy
from genfn.strategies.assisted.verify import (
    Verified,
    accept_keys,
    draft_keys,
    limit_new_tokens,
    process_block,
    verify_greedy,
    verify_sampling,
)

__all__ = [
    "Draft", "DraftInput", "Drafter", "PromptLookupDrafter", "check_ensemble_weight",
    "propose_prompt_lookup",
    "ConfidenceState", "DraftSchedule", "confident_length", "draft_budget", "init_confidence", "init_schedule",
    "roc_optimal_threshold", "schedule_for_next_call", "update_confidence", "update_schedule",
    "AcceptanceStats", "init_stats", "record",
    "GenerateAssistedOutput", "SpeculativeState", "speculative_strategy",
    "Verified", "accept_keys", "draft_keys", "limit_new_tokens", "process_block", "verify_greedy", "verify_sampling",
]
