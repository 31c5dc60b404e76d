"""Stopping: pure in-step checks (``checks``), stop strings matched on tensors (``strings``), and
the eager, transformers-shaped criteria users pass to ``generate`` (``criteria``)."""

from genfn.stopping.checks import eos_emitted, eos_in_new_tokens, max_length_reached
from genfn.stopping.criteria import (
    ConfidenceCriteria,
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
    call_user_criteria,
    validate_stopping_criteria,
)
from genfn.stopping.strings import (
    StopStringMatcher,
    stop_string_criteria,
    stop_string_in_new_tokens,
    stop_string_matching_mode,
)

__all__ = [
    "max_length_reached",
    "eos_emitted",
    "eos_in_new_tokens",
    "StoppingCriteria",
    "StoppingCriteriaList",
    "MaxLengthCriteria",
    "MaxTimeCriteria",
    "EosTokenCriteria",
    "ConfidenceCriteria",
    "StopStringCriteria",
    "validate_stopping_criteria",
    "call_user_criteria",
    "StopStringMatcher",
    "stop_string_criteria",
    "stop_string_matching_mode",
    "stop_string_in_new_tokens",
]
