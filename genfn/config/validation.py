"""GenerationConfig.validate: what raises, what is logged, as transformers v5 decides it.

Errors (always raised): a field of the wrong type (TypeError) or outside its allowed values
(ValueError), and combinations that cannot run. Minor issues (contradictions transformers also
reports: a sampling flag without sampling, say) are logged on the ``genfn.config.validation``
logger, a WARNING naming the flags and an INFO with the details, each message once per process as
transformers' ``warning_once``/``info_once`` do; with ``strict=True`` they raise instead. The
functions take the config as an argument and only read attributes, so this module does not need
the GenerationConfig class.
"""

from __future__ import annotations

import logging
from typing import Any

from .caches import DYNAMIC_CACHE_IMPLEMENTATIONS
from .checks import is_int
from .fields import FIELD_SPECS

__all__ = ["raise_on_invalid", "minor_issues", "report_minor_issues", "log_once", "forget_logged_messages"]

logger = logging.getLogger(__name__)

# Arguments of `generate()` that users sometimes put into the config by mistake.
GENERATE_ONLY_ARGUMENTS = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
)

# Flags that only matter when sampling, with the value at which they are inert (None: any value
# counts as set). Reported when do_sample is not True, as transformers does.
_SAMPLING_ONLY_FLAGS: tuple[tuple[str, Any], ...] = (
    ("temperature", 1.0),
    ("top_p", 1.0),
    ("min_p", None),
    ("top_h", None),
    ("typical_p", 1.0),
    ("top_k", 50),
    ("epsilon_cutoff", 0.0),
    ("eta_cutoff", 0.0),
)
_BEAM_ONLY_FLAGS: tuple[tuple[str, Any], ...] = (("early_stopping", False), ("length_penalty", 1.0))

# ----------------------------------------------------------------------------------------------
# Logging once
# ----------------------------------------------------------------------------------------------

# A config is validated on every update and every generate call: without this, one contradiction
# in a model's generation_config.json would be logged on each of them.
_logged: set[tuple[str, int, str]] = set()


def log_once(target: logging.Logger, level: int, message: str) -> None:
    """``target.log(level, message)`` the first time this message is emitted at this level.

    Unlike transformers' lru-cached ``warning_once``, a message the logger's level filtered out is
    not remembered, so it still appears once the user turns that level on.
    """
    key = (target.name, level, message)
    if key in _logged or not target.isEnabledFor(level):
        return
    _logged.add(key)
    target.log(level, message)


def forget_logged_messages() -> None:
    """Let every message of :func:`log_once` be logged again (tests that capture logs need this)."""
    _logged.clear()


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def raise_on_invalid(config: Any) -> None:
    """Raise TypeError/ValueError for a bad field value or a combination that cannot run."""
    # Single values first, combinations after: the first error then points at the root cause.
    _check_field_values(config)
    _check_no_generate_arguments(config)
    _check_num_return_sequences(config)
    _check_forced_tokens_not_suppressed(config)
    _check_sampling_temperature(config)


def _check_field_values(config: Any) -> None:
    for spec in FIELD_SPECS:
        value = getattr(config, spec.name)
        if value is not None:
            spec.check(spec.name, value)


def _check_num_return_sequences(config: Any) -> None:
    n = config.num_return_sequences
    if n is None or n <= 1:
        return
    if config.num_beams is None or config.num_beams == 1:
        if not config.do_sample:
            raise ValueError(
                f"`num_return_sequences` ({n}) must be 1 for greedy decoding (do_sample != True, one beam): "
                "every sequence would be the same. Set do_sample=True or num_beams >= num_return_sequences."
            )
    elif n > config.num_beams:
        raise ValueError(
            f"`num_return_sequences` ({n}) must be <= `num_beams` ({config.num_beams}): "
            "beam search can only return the beams it keeps."
        )


def _check_forced_tokens_not_suppressed(config: Any) -> None:
    # Forcing a token that is also suppressed leaves only -inf logits at that step: NaN probabilities.
    if config.suppress_tokens is None:
        return
    suppressed = set(config.suppress_tokens)
    for name in ("forced_bos_token_id", "forced_eos_token_id"):
        forced = getattr(config, name)
        if forced is None:
            continue
        forced = {forced} if is_int(forced) else set(forced)
        if forced and forced <= suppressed:
            raise ValueError(
                f"Every token in `{name}` ({sorted(forced)}) is also in `suppress_tokens`: forcing a suppressed "
                "token leaves no finite logit at that step. Remove the overlap (to delay EOS, use min_new_tokens)."
            )


def _check_sampling_temperature(config: Any) -> None:
    if config.do_sample is True and config.temperature is not None and config.temperature == 0:
        raise ValueError(
            "`temperature` must be > 0 when do_sample=True (0 would divide the logits by zero). "
            "For greedy decoding set do_sample=False."
        )


def _check_no_generate_arguments(config: Any) -> None:
    for name in GENERATE_ONLY_ARGUMENTS:
        if name in config.__dict__:
            raise ValueError(
                f"`{name}` is an argument of `generate()`, not a GenerationConfig field; pass it to generate directly."
            )


# ----------------------------------------------------------------------------------------------
# Minor issues
# ----------------------------------------------------------------------------------------------


def _counts_as_conflict(outer: str, inner: str, user_set: set[str] | None) -> bool:
    """Whether a flag combination should be reported, given which attributes the caller set.

    A sampling flag inherited from a model's generation_config.json is harmless when the caller
    explicitly asked for greedy decoding: report only if the caller set the inner flag, or did
    not set the outer one (or if provenance is unknown).
    """
    if user_set is None:
        return True
    return inner in user_set or outer not in user_set


def _is_flag_active(value: Any, inert: Any) -> bool:
    return value is not None and (inert is None or value != inert)


def minor_issues(config: Any, user_set: set[str] | None) -> dict[str, str]:
    """``{field: what is wrong with it}`` for the contradictions transformers reports."""
    issues: dict[str, str] = {}
    if config.pad_token_id is not None and config.pad_token_id < 0:
        issues["pad_token_id"] = (
            f"`pad_token_id` should be >= 0 but is {config.pad_token_id}; batched generation with padding will fail."
        )
    issues.update(_sampling_only_issues(config, user_set))
    issues.update(_beam_only_issues(config, user_set))
    issues.update(_no_cache_issues(config))
    issues.update(_output_flag_issues(config))
    return issues


def _sampling_only_issues(config: Any, user_set: set[str] | None) -> dict[str, str]:
    if config.do_sample is True:
        return {}
    return {
        name: (
            f"`do_sample` is not True, but `{name}` is {getattr(config, name)!r}; it only affects sampling. "
            f"Set do_sample=True or unset `{name}`."
        )
        for name, inert in _SAMPLING_ONLY_FLAGS
        if _is_flag_active(getattr(config, name), inert) and _counts_as_conflict("do_sample", name, user_set)
    }


def _beam_only_issues(config: Any, user_set: set[str] | None) -> dict[str, str]:
    if config.num_beams is not None and config.num_beams != 1:
        return {}
    return {
        name: (
            f"`num_beams` is {config.num_beams}, but `{name}` is {getattr(config, name)!r}; it only affects beam "
            f"search. Set num_beams>1 or unset `{name}`."
        )
        for name, inert in _BEAM_ONLY_FLAGS
        if _is_flag_active(getattr(config, name), inert) and _counts_as_conflict("num_beams", name, user_set)
    }


def _no_cache_issues(config: Any) -> dict[str, str]:
    if config.use_cache is not False:
        return {}
    return {
        name: f"`use_cache` is False, so `{name}` ({getattr(config, name)!r}) has no effect."
        for name in ("cache_implementation", "cache_config")
        if getattr(config, name) is not None
    }


def _output_flag_issues(config: Any) -> dict[str, str]:
    if config.return_dict_in_generate is True:
        return {}
    return {
        name: f"`return_dict_in_generate` is not True, so `{name}` is ignored."
        for name in config.extra_output_flags
        if getattr(config, name) is True
    }


def warn_unused_max_cache_len(config: Any) -> None:
    # genfn's default cache (cache_implementation=None) is static, so only an explicitly dynamic
    # choice makes max_cache_len pointless (transformers, whose default is dynamic, also logs for None).
    if config.max_cache_len is not None and config.cache_implementation in DYNAMIC_CACHE_IMPLEMENTATIONS + ("paged",):
        log_once(
            logger,
            logging.WARNING,
            f"`max_cache_len` is only used by static caches; it is ignored with "
            f"cache_implementation={config.cache_implementation!r}.",
        )


def report_minor_issues(issues: dict[str, str], strict: bool) -> None:
    """Raise the issues as one ValueError if ``strict``; else log the flags (WARNING) and the details (INFO)."""
    if not issues:
        return
    details = "\n".join(f"- `{name}`: {text}" for name, text in issues.items())
    details += "\nIf you're using a pretrained model, some of these values may come from its generation_config.json."
    if strict:
        raise ValueError("GenerationConfig is invalid:\n" + details)
    summary = f"The following generation flags are not valid and may be ignored: {list(issues)}."
    if not logger.isEnabledFor(logging.INFO):
        summary += f" Set the `{logger.name}` logger to INFO for details."
    log_once(logger, logging.WARNING, summary)
    log_once(logger, logging.INFO, details)
