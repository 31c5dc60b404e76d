"""The decoding strategies a GenerationConfig can select, and where the Hub-moved ones went."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from enum import Enum
from types import MappingProxyType
from typing import Any

__all__ = ["GenerationMode", "HUB_GENERATION_MODES", "generation_mode"]

logger = logging.getLogger(__name__)


class GenerationMode(str, Enum):
    """The decoding strategy a config selects (``str`` values equal transformers')."""

    GREEDY_SEARCH = "greedy_search"
    SAMPLE = "sample"
    BEAM_SEARCH = "beam_search"
    BEAM_SAMPLE = "beam_sample"
    ASSISTED_GENERATION = "assisted_generation"
    # transformers moved these to Hub repositories. genfn names them so that `generate` can say
    # so clearly; it never runs them.
    CONTRASTIVE_SEARCH = "contrastive_search"
    DOLA_GENERATION = "dola_generation"
    CONSTRAINED_BEAM_SEARCH = "constrained_beam_search"
    GROUP_BEAM_SEARCH = "group_beam_search"

    def __str__(self) -> str:
        return self.value


# Where transformers sends the modes it no longer implements itself.
HUB_GENERATION_MODES: Mapping[GenerationMode, str] = MappingProxyType(
    {
        GenerationMode.DOLA_GENERATION: "transformers-community/dola",
        GenerationMode.CONTRASTIVE_SEARCH: "transformers-community/contrastive-search",
        GenerationMode.GROUP_BEAM_SEARCH: "transformers-community/group-beam-search",
        GenerationMode.CONSTRAINED_BEAM_SEARCH: "transformers-community/constrained-beam-search",
    }
)


def generation_mode(config: Any, assistant_model: Any = None) -> GenerationMode:
    """The decoding strategy ``config``'s settings select (the same decision table as transformers).

    Passing ``assistant_model``, or setting ``use_mtp``, ``prompt_lookup_num_tokens`` or
    ``assistant_early_exit``, turns greedy search and sampling into assisted generation.
    Modes transformers moved to the Hub are returned by name (see HUB_GENERATION_MODES).
    """
    mode = _base_generation_mode(config)
    assisted = (
        assistant_model is not None
        or bool(config.use_mtp)
        or config.prompt_lookup_num_tokens is not None
        or config.assistant_early_exit is not None
    )
    if assisted:
        trigger = "an assistant (or use_mtp/prompt lookup/early exit)"
        mode = _extend_mode(mode, GenerationMode.ASSISTED_GENERATION, trigger)
    if config.dola_layers is not None:
        mode = _extend_mode(mode, GenerationMode.DOLA_GENERATION, "`dola_layers`")
    return mode


def _base_generation_mode(config: Any) -> GenerationMode:
    if config.constraints is not None or config.force_words_ids is not None:
        return GenerationMode.CONSTRAINED_BEAM_SEARCH
    if config.num_beams is None or config.num_beams == 1:
        if config.do_sample is True:
            return GenerationMode.SAMPLE
        contrastive = (
            config.top_k is not None
            and config.top_k > 1
            and config.penalty_alpha is not None
            and config.penalty_alpha > 0
        )
        return GenerationMode.CONTRASTIVE_SEARCH if contrastive else GenerationMode.GREEDY_SEARCH
    if config.num_beam_groups is not None and config.num_beam_groups > 1:
        return GenerationMode.GROUP_BEAM_SEARCH
    return GenerationMode.BEAM_SAMPLE if config.do_sample is True else GenerationMode.BEAM_SEARCH


def _extend_mode(mode: GenerationMode, extended: GenerationMode, trigger: str) -> GenerationMode:
    """Assisted and DoLa decoding extend greedy search and sampling only; anything else keeps its mode."""
    if mode in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return extended
    # A warning on every call, not once, as transformers logs it.
    logger.warning(
        "%s asks for %s, which only extends greedy search and sampling; the base mode is %s, so the flags "
        "requesting %s are ignored.",
        trigger,
        extended.value,
        mode.value,
        extended.value,
    )
    return mode
