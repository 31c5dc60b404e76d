"""Which speculative strategy a ``generate`` call asks for, built from its resolved request.

The proposer follows transformers' precedence: ``assistant_early_exit``, then
``prompt_lookup_num_tokens``, then ``assistant_model``; an ``assistant_model`` given with
``tokenizer`` and ``assistant_tokenizer`` drafts through text (universal assisted generation,
:mod:`genfn.strategies.assisted.universal`). The ``"heuristic"`` draft-length schedule
carries its value from one call to the next with the same assistant (transformers keeps it in
the assistant's generation config; genfn keeps it here, next to the strategy that reads it).
"""

from __future__ import annotations

import weakref

from genfn.strategies.assisted.block import BlockDrafter
from genfn.strategies.assisted.draft_model import DraftModelDrafter
from genfn.strategies.assisted.drafter import PromptLookupDrafter
from genfn.strategies.assisted.early_exit import EarlyExitDrafter
from genfn.strategies.assisted.mtp import MTPDrafter, num_mtp_heads
from genfn.strategies.assisted.schedule import schedule_for_next_call
from genfn.strategies.assisted.step import speculative_strategy
from genfn.strategies.assisted.universal import universal_strategy
from genfn.strategies.base import Strategy
from genfn.strategies.request import GenerationRequest

__all__ = ["assisted_strategy", "carried_schedules", "drafter_for"]

# The schedule each assistant (or early-exiting target) ended its last call at, for "heuristic".
carried_schedules: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

def drafter_for(model, request: GenerationRequest, assistant_model, universal: bool = False):
    """``(drafter, schedule owner)`` of ``request``: the proposer its settings ask for, in transformers'
    precedence, and the value whose ``"heuristic"`` schedule carries across calls (None: no schedule)."""
    config = request.config
    num_tokens = int(config.num_assistant_tokens or 20)
    if config.speculation_type == "dflash" or isinstance(assistant_model, BlockDrafter):
        if not isinstance(assistant_model, BlockDrafter):
            raise ValueError("speculation_type='dflash' needs assistant_model to be a "
                             "genfn.strategies.assisted.block.BlockDrafter (a block drafter trained for this "
                             f"target), got {type(assistant_model).__name__}")
        return assistant_model, None
    if config.assistant_early_exit is not None:
        return EarlyExitDrafter(num_layers=int(config.assistant_early_exit), num_tokens=num_tokens), model
    if config.use_mtp:
        heads = num_mtp_heads(model)
        if heads == 0:
            raise ValueError("use_mtp=True needs a model with multi-token-prediction heads (params['mtp']); this "
                             "model has none")
        return MTPDrafter(num_tokens=min(heads, num_tokens)), None
    if config.prompt_lookup_num_tokens is not None:
        drafter = PromptLookupDrafter(num_tokens=int(config.prompt_lookup_num_tokens),
                                      max_matching_ngram_size=int(config.max_matching_ngram_size or 2),
                                      eos_token_ids=request.eos_token_ids)
        return drafter, None
    if assistant_model is None:
        raise ValueError("assisted generation needs assistant_model, prompt_lookup_num_tokens or assistant_early_exit")
    if universal:
        return None, assistant_model
    if getattr(assistant_model, "vocab_size", None) is not None and assistant_model.vocab_size != model.vocab_size:
        raise ValueError(f"assistant_model has a vocabulary of {assistant_model.vocab_size} tokens and the model "
                         f"{model.vocab_size}: an assistant with another tokenizer needs tokenizer= (the model's) and "
                         "assistant_tokenizer= (the assistant's) passed to generate (universal assisted generation)")
    threshold = float(config.assistant_confidence_threshold or 0.0)
    drafter = DraftModelDrafter(assistant=assistant_model, num_tokens=num_tokens, confidence_threshold=threshold,
                                confidence_capacity=max(1, request.max_length - request.prompt_len))
    return drafter, assistant_model


def _wants_universal(assistant_model, tokenizer, assistant_tokenizer) -> bool:
    if assistant_tokenizer is None:
        return False
    if tokenizer is None:
        raise ValueError("assistant_tokenizer= is given without tokenizer=: universal assisted generation re-encodes "
                         "the model's tokens through text, so it needs the model's tokenizer too")
    if assistant_model is None:
        raise ValueError("assistant_tokenizer= is the tokenizer of an assistant_model; pass assistant_model= too")
    return True


def assisted_strategy(model, request: GenerationRequest, assistant_model=None, *, tokenizer=None,
                      assistant_tokenizer=None) -> Strategy:
    """The speculative :class:`~genfn.strategies.base.Strategy` for ``request`` (mode ASSISTED_GENERATION).

    ``tokenizer`` and ``assistant_tokenizer`` (both, with ``assistant_model``) select universal
    assisted generation: eager, any batch size, drafts re-encoded through text.
    """
    universal = _wants_universal(assistant_model, tokenizer, assistant_tokenizer)
    drafter, schedule_owner = drafter_for(model, request, assistant_model, universal)
    if drafter is not None:
        universal = False  # an earlier proposer (early exit, prompt lookup, MTP, block) takes precedence
    config = request.config
    schedule, on_finish = None, None
    kind = config.num_assistant_tokens_schedule or "constant"
    if schedule_owner is not None and kind != "constant":
        carried = carried_schedules.get(schedule_owner)
        schedule = schedule_for_next_call(carried, drafter.num_tokens, request.batch_size, kind,
                                          request.input_ids.device)

        def on_finish(state):
            carried_schedules[schedule_owner] = state.schedule

    if universal:
        if request.grammar is not None:
            # Its drafts arrive as text re-encoded between steps, outside the matcher's token stream.
            raise ValueError("response_format cannot constrain universal assisted generation (an assistant_model "
                             "with its own assistant_tokenizer); use an assistant sharing the model's tokenizer, "
                             "prompt_lookup_num_tokens, or no assistant")
        if config.assistant_ensemble_weight is not None:
            raise ValueError("assistant_ensemble_weight needs the assistant's probabilities over the model's "
                             "vocabulary; an assistant with another tokenizer (assistant_tokenizer=) has none")
        return universal_strategy(assistant_model, tokenizer, assistant_tokenizer, request, schedule=schedule,
                                  on_finish=on_finish)
    return speculative_strategy(drafter, schedule=schedule, ensemble_weight=config.assistant_ensemble_weight,
                                on_finish=on_finish)
