"""The processor chain, and building it from a generation config in transformers' exact order.

``build_logits_processors`` mirrors ``GenerationMixin._get_logits_processor`` of transformers
5.24: the same processors, instantiated under the same conditions (no-ops at default values are
skipped, warpers only when ``do_sample``, ``min_tokens_to_keep = num_eos + 1`` under beam
sampling), in the same order:

    [CFG] -> sequence bias -> encoder repetition penalty -> repetition penalty -> no-repeat n-gram
    -> encoder no-repeat n-gram -> bad words -> min length -> min new tokens -> prefix constraint
    -> forced BOS -> forced EOS -> inf/nan removal -> exponential decay -> suppress tokens
    -> begin suppress tokens -> **user processors merged here** -> [do_sample: temperature -> top-h
    -> top-k -> top-p -> min-p -> typical -> epsilon -> eta] -> watermark -> renormalize

User processors are merged *before* the warpers, as transformers merges them: one of the same
type as a config-built processor takes that processor's place (transformers >= 4.50 logs a
warning and lets the user's win; ``on_duplicate="raise"`` restores the old ``ValueError``), the
others follow the config-built non-warpers.

Entries of ``user_processors`` that are not genfn processors (transformers' own processor
objects, any ``(input_ids, scores) -> scores`` callable) are wrapped as eager-only
:class:`~genfn.processors.external.ExternalLogitsProcessor`; a transformers processor of the same
class name as a config-built one takes its slot, as in transformers.

The chain ``generate`` builds holds transformers' Python values; :meth:`ProcessorChain.per_row`
turns it into the chain a compiled decode step carries as a leaf (every number a ``[B]`` tensor,
so the treedef, and :meth:`ProcessorChain.fingerprint`, only describe the kinds).
:func:`build_logits_processors_for_rows` builds one batch chain from a config per row.

Classifier-free guidance and token healing need the model or the tokenizer, so they are not
built here: they are reported in ``ProcessorChain.requires`` for the strategy layer (CFG goes at
the head of the chain, see :func:`genfn.processors.guidance.guidance_combine` and
:meth:`ProcessorChain.prepend`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from genfn.processors.base import as_id_list, check_vocab
from genfn.processors.bias import NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor
from genfn.processors.context import LogitsContext
from genfn.processors.external import ExternalLogitsProcessor, as_genfn_processor
from genfn.processors.forcing import (
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
from genfn.processors.ngrams import EncoderNoRepeatNGramLogitsProcessor, NoRepeatNGramLogitsProcessor
from genfn.processors.numerics import InfNanRemoveLogitsProcessor, LogitNormalization
from genfn.processors.penalties import (
    EncoderRepetitionPenaltyLogitsProcessor,
    ExponentialDecayLengthPenalty,
    RepetitionPenaltyLogitsProcessor,
)
from genfn.processors.prefix import PrefixConstrainedLogitsProcessor
from genfn.processors.rows import merge_processor_rows
from genfn.processors.synthid import SynthIDTextWatermarkLogitsProcessor, synthid_kwargs
from genfn.processors.warpers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from genfn.processors.watermark import WatermarkLogitsProcessor, watermarking_kwargs
from genfn.state.base import pytree_dataclass, static_field

__all__ = ["ProcessorChain", "build_logits_processors", "build_logits_processors_for_rows"]

logger = logging.getLogger(__name__)


def _is_stateful(p: Any) -> bool:
    return bool(getattr(p, "stateful", False))


@pytree_dataclass
class ProcessorChain:
    """An ordered tuple of processors, itself a processor: ``chain(logits, ctx) -> logits``.

    A chain that holds a stateful processor (SynthID) is driven with ``state =
    chain.init_state(B)`` and ``logits, state = chain.apply(logits, ctx, state)``; the state is a
    tuple with one entry per processor (``None`` for stateless ones).

    ``requires`` lists model-level features the config asked for that a logits processor cannot
    provide, as ``(name, value)`` pairs: ``("guidance_scale", s)``, ``("token_healing", True)``.
    """

    processors: tuple = ()
    requires: tuple = static_field(())

    @property
    def stateful(self) -> bool:
        return any(_is_stateful(p) for p in self.processors)

    @property
    def compile_safe(self) -> bool:
        """Whether every processor traces under ``torch.compile(fullgraph=True)``."""
        return all(getattr(p, "compile_safe", True) for p in self.processors)

    def __len__(self) -> int:
        return len(self.processors)

    def __iter__(self):
        return iter(self.processors)

    def __getitem__(self, index):
        return self.processors[index]

    def __call__(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        if self.stateful:
            raise TypeError("this chain has a stateful processor: use `init_state` and `apply`")
        for p in self.processors:
            logits = p(logits, ctx)
        return logits

    def init_state(self, batch_size: int, device: Any = None) -> tuple:
        return tuple(p.init_state(batch_size, device) if _is_stateful(p) else None for p in self.processors)

    def apply(self, logits: torch.Tensor, ctx: LogitsContext, state: tuple) -> tuple[torch.Tensor, tuple]:
        new_state = []
        for p, s in zip(self.processors, state):
            if _is_stateful(p):
                logits, s = p.apply(logits, ctx, s)
            else:
                logits = p(logits, ctx)
            new_state.append(s)
        return logits, tuple(new_state)

    def fingerprint(self) -> tuple:
        """A hashable description of the chain's *structure*: kinds, static fields, and the dtype,
        shape and device of every tensor leaf (Python-number leaves by value, as they are baked
        into a compiled step).

        Two per-row chains (:meth:`per_row`) of the same kinds therefore share a fingerprint
        whatever their numbers, and so share one compiled step when the chain is a leaf of the
        decode state. A chain held as a *static* option must be keyed by :meth:`content_key`.
        """
        return tuple(_structure(p) for p in self.processors)

    def content_key(self) -> tuple:
        """A hashable value that is equal for chains that compute the same function: like
        :meth:`fingerprint`, with tensor leaves hashed by content."""
        return tuple(_fingerprint(p) for p in self.processors)

    # -- per-row values ----------------------------------------------------------------------------

    def per_row(self, batch_size: int, device: Any = None) -> ProcessorChain:
        """The chain a decode step runs: every number a ``[batch_size]`` tensor leaf on ``device``."""
        return ProcessorChain(
            tuple(p.per_row(batch_size, device) if hasattr(p, "per_row") else p for p in self.processors),
            self.requires,
        )

    def with_row(self, slot: int | torch.Tensor, row_chain: ProcessorChain) -> ProcessorChain:
        """Pure: this per-row chain with row ``slot`` set from ``row_chain``'s single row.

        ``row_chain`` must hold the same kinds in the same order (build it with
        ``build_logits_processors_for_rows([config], like=this_chain, ...)``); tables shared by the
        batch stay as they are.
        """
        if len(row_chain) != len(self):
            raise ValueError(f"the row chain has {len(row_chain)} processors, the batch chain {len(self)}: build it "
                             "with build_logits_processors_for_rows(..., like=batch_chain)")
        out = []
        for mine, row in zip(self.processors, row_chain.processors):
            out.append(mine.with_row(slot, row) if hasattr(mine, "with_row") else mine)
        return ProcessorChain(tuple(out), self.requires)

    @classmethod
    def merge_rows(cls, chains: list[ProcessorChain], device: Any = None,
                   like: ProcessorChain | None = None) -> ProcessorChain:
        """One per-row batch chain whose row ``b`` computes what ``chains[b]`` computes."""
        if not chains:
            raise ValueError("merge_rows needs at least one row chain")
        requires = tuple(dict.fromkeys(r for c in chains for r in c.requires))
        processors = merge_processor_rows([list(c.processors) for c in chains], device,
                                          None if like is None else list(like.processors))
        return ProcessorChain(processors, requires if like is None else like.requires)

    def prepend(self, processor: Any) -> ProcessorChain:
        """A new chain with ``processor`` first (where transformers puts classifier-free guidance)."""
        return ProcessorChain((processor, *self.processors), self.requires)

    def append(self, processor: Any) -> ProcessorChain:
        return ProcessorChain((*self.processors, processor), self.requires)


def _fingerprint(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        return ("tensor", str(data.dtype), tuple(data.shape), hashlib.sha1(data.view(torch.uint8).numpy()).hexdigest()
                if data.numel() else "")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__,
                tuple((f.name, _fingerprint(getattr(value, f.name))) for f in dataclasses.fields(value)))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_fingerprint(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(k), _fingerprint(v)) for k, v in value.items())))
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    if callable(value):
        return ("callable", id(value))  # user callables (prefix_allowed_tokens_fn) are compared by identity
    try:
        hash(value)
        return (type(value).__qualname__, value)
    except TypeError:
        return (type(value).__qualname__, id(value))


def _structure(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), str(value.device))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__,
                tuple((f.name, _structure(getattr(value, f.name))) for f in dataclasses.fields(value)))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_structure(v) for v in value))
    return _fingerprint(value)


def _same_kind(custom: Any, default: Any) -> bool:
    """transformers replaces a default processor by a custom one of the same class; a wrapped
    transformers processor counts as the genfn class of the same name."""
    if isinstance(custom, ExternalLogitsProcessor):
        wrapped = type(custom.wrapped)
        return wrapped.__module__.startswith("transformers.") and wrapped.__name__ == type(default).__name__
    return type(custom) is type(default)


def _merge_user_processors(defaults: list, custom: Iterable[Any], on_duplicate: str) -> list:
    """transformers' ``_merge_criteria_processor_list``: a custom processor of the same type as a
    default one takes its slot; the remaining custom ones are appended in order."""
    custom = [as_genfn_processor(c) for c in custom]
    if not custom:
        return defaults
    merged = []
    for default in defaults:
        replacement = next((c for c in custom if _same_kind(c, default)), None)
        if replacement is None:
            merged.append(default)
            continue
        if on_duplicate == "raise":
            raise ValueError(
                f"A custom logits processor of type {type(replacement)} was passed, but one of the same type was "
                "also created from the generation config. Use the config flag or the custom processor, not both."
            )
        logger.warning(
            "A custom logits processor of type %s has been passed, but it was also created from the generation "
            "config. The custom one takes precedence.",
            type(replacement),
        )
        merged.append(replacement)
    for c in custom:
        if not any(c is m for m in merged):
            merged.append(c)
    return merged


def _has_usable_encoder_ids(encoder_input_ids: torch.Tensor | None) -> bool:
    """``None`` means "the prompt columns of the buffer"; a tensor must be 2-D and non-negative
    (transformers receives a -100-filled dummy when there are no ids)."""
    if encoder_input_ids is None:
        return True
    return encoder_input_ids.dim() == 2 and not bool((encoder_input_ids < 0).any())


def build_logits_processors(
    generation_config: Any,
    *,
    prompt_len: int,
    max_length: int,
    min_length: int,
    eos_token_ids: list[int] | None,
    num_beams: int | None = None,
    encoder_input_ids: torch.Tensor | None = None,
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None,
    user_processors: Iterable[Any] | None = None,
    attention_mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
    device: Any = None,
    on_duplicate: str = "replace",
) -> ProcessorChain:
    """Build the chain transformers' ``generate`` would build for ``generation_config``.

    ``generation_config`` is read by attribute name (transformers' field names) and must have its
    defaults resolved (``top_k=50``, ``temperature=1.0``, ...). Lengths are passed resolved:
    ``prompt_len`` is the padded prompt length (transformers' ``input_ids_seq_length``; processors
    read the same value from ``ctx.prompt_len`` at run time), ``max_length``/``min_length``
    include the prompt.

    ``encoder_input_ids``: the encoder ids for the encoder repetition penalty / n-gram ban, or
    ``None`` to use the prompt columns of the buffer (what transformers passes for a decoder-only
    model). ``attention_mask``: the prompt mask ``[B, P]`` (beam-expanded), from which the
    repetition penalty learns each row's left padding, as in transformers; ``None`` penalizes pad
    tokens too (transformers without a mask). ``vocab_size`` is required for watermarking and lets
    sequence bias / bad words reject out-of-range ids early. ``device`` places constant tables.
    ``on_duplicate``: ``"replace"`` (transformers 5.x) or ``"raise"``.
    """
    if on_duplicate not in ("replace", "raise"):
        raise ValueError(f"`on_duplicate` must be 'replace' or 'raise', got {on_duplicate!r}")

    def cfg(name: str, default: Any = None) -> Any:
        return getattr(generation_config, name, default)

    eos = as_id_list(eos_token_ids, "eos_token_ids")
    check_vocab(list(eos), vocab_size, "eos_token_id")
    for name in ("forced_bos_token_id", "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens"):
        if cfg(name) is not None:
            check_vocab(cfg(name), vocab_size, name)
    if num_beams is None:
        num_beams = cfg("num_beams", 1) or 1
    processors: list[Any] = []
    requires: list[tuple[str, Any]] = []

    guidance_scale = cfg("guidance_scale")
    if guidance_scale is not None and guidance_scale != 1:
        requires.append(("guidance_scale", guidance_scale))
    if cfg("token_healing"):
        requires.append(("token_healing", True))

    if cfg("sequence_bias") is not None:
        processors.append(SequenceBiasLogitsProcessor.create(cfg("sequence_bias"), vocab_size, device))

    has_encoder_ids = _has_usable_encoder_ids(encoder_input_ids)
    enc_penalty = cfg("encoder_repetition_penalty")
    if enc_penalty is not None and enc_penalty != 1.0:
        if has_encoder_ids:
            processors.append(EncoderRepetitionPenaltyLogitsProcessor(enc_penalty, encoder_input_ids))
        else:
            warnings.warn(
                "Passing `encoder_repetition_penalty` requires some form of `input_ids`, ignoring the argument.",
                UserWarning,
            )
    penalty = cfg("repetition_penalty")
    if penalty is not None and penalty != 1.0:
        pad_lengths = None
        if attention_mask is not None:
            pad_lengths = (attention_mask != 0).int().argmax(dim=1).to(torch.int64)
            if device is not None:
                pad_lengths = pad_lengths.to(device)
        processors.append(RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=pad_lengths))
    ngram = cfg("no_repeat_ngram_size")
    if ngram is not None and ngram > 0:
        processors.append(NoRepeatNGramLogitsProcessor(ngram))
    enc_ngram = cfg("encoder_no_repeat_ngram_size")
    if enc_ngram is not None and enc_ngram > 0:
        if has_encoder_ids:
            processors.append(EncoderNoRepeatNGramLogitsProcessor(enc_ngram, encoder_input_ids))
        else:
            warnings.warn(
                "Passing `encoder_no_repeat_ngram_size` requires some form of `input_ids`, ignoring the argument.",
                UserWarning,
            )
    if cfg("bad_words_ids") is not None:
        processors.append(NoBadWordsLogitsProcessor.create(cfg("bad_words_ids"), eos or None, vocab_size, device))
    if min_length is not None and eos and min_length > 0:
        processors.append(MinLengthLogitsProcessor(min_length, eos))
    min_new = cfg("min_new_tokens")
    if min_new is not None and eos and min_new > 0:
        processors.append(MinNewTokensLengthLogitsProcessor(None, min_new, eos))
    if prefix_allowed_tokens_fn is not None:
        group = max(num_beams, cfg("num_return_sequences", 1) or 1)
        processors.append(PrefixConstrainedLogitsProcessor(prefix_allowed_tokens_fn, group))
    forced_bos = cfg("forced_bos_token_id")
    if forced_bos is not None:
        processors.append(ForcedBOSTokenLogitsProcessor(forced_bos))
    forced_eos = cfg("forced_eos_token_id")
    if forced_eos is not None:
        processors.append(ForcedEOSTokenLogitsProcessor(max_length, forced_eos))
    if cfg("remove_invalid_values") is True:
        processors.append(InfNanRemoveLogitsProcessor())
    decay = cfg("exponential_decay_length_penalty")
    if decay is not None:
        processors.append(ExponentialDecayLengthPenalty.from_config(decay, eos))
    if cfg("suppress_tokens") is not None:
        processors.append(SuppressTokensLogitsProcessor(tuple(cfg("suppress_tokens"))))
    if cfg("begin_suppress_tokens") is not None:
        # The first free slot is one later when a forced BOS fills it after a 1-token prompt.
        offset = 0 if (prompt_len > 1 or forced_bos is None) else 1
        processors.append(SuppressTokensAtBeginLogitsProcessor(tuple(cfg("begin_suppress_tokens")), None, offset))

    if callable(user_processors) and not isinstance(user_processors, (list, tuple, ProcessorChain)):
        user_processors = [user_processors]  # a single processor (or callable) rather than a list
    processors = _merge_user_processors(processors, user_processors or (), on_duplicate)

    if cfg("do_sample"):
        # Beam sampling must keep at least one non-EOS continuation per beam.
        keep = (len(eos) + 1 if eos else 2) if num_beams > 1 else 1
        temperature = cfg("temperature")
        if temperature is not None and temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        if cfg("top_h") is not None:
            processors.append(TopHLogitsWarper(cfg("top_h")))
        top_k = cfg("top_k")
        if top_k is not None and top_k != 0:
            processors.append(TopKLogitsWarper(top_k, min_tokens_to_keep=keep))
        top_p = cfg("top_p")
        if top_p is not None and top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p, min_tokens_to_keep=keep))
        if cfg("min_p") is not None:
            processors.append(MinPLogitsWarper(cfg("min_p"), min_tokens_to_keep=keep))
        typical = cfg("typical_p")
        if typical is not None and typical < 1.0:
            processors.append(TypicalLogitsWarper(typical, min_tokens_to_keep=keep))
        epsilon = cfg("epsilon_cutoff")
        if epsilon is not None and 0.0 < epsilon < 1.0:
            processors.append(EpsilonLogitsWarper(epsilon, min_tokens_to_keep=keep))
        eta = cfg("eta_cutoff")
        if eta is not None and 0.0 < eta < 1.0:
            processors.append(EtaLogitsWarper(eta, min_tokens_to_keep=keep))

    watermarking = cfg("watermarking_config")
    if watermarking is not None:
        processors.append(_watermark_processor(watermarking, vocab_size, device))

    if cfg("renormalize_logits") is True:
        processors.append(LogitNormalization())
    return ProcessorChain(tuple(processors), tuple(requires))


def _watermark_processor(config: Any, vocab_size: int | None, device: Any) -> Any:
    is_synthid = (isinstance(config, dict) and "ngram_len" in config) or hasattr(config, "ngram_len")
    if is_synthid:
        return SynthIDTextWatermarkLogitsProcessor.create(**synthid_kwargs(config), device=device)
    if vocab_size is None:
        raise ValueError("watermarking needs the model's `vocab_size`: pass vocab_size= to build_logits_processors")
    return WatermarkLogitsProcessor.create(vocab_size, device=device, **watermarking_kwargs(config))


def _per_row_setting(value: Any, batch_size: int, name: str) -> list[Any]:
    """A setting shared by every row, or one value per row."""
    if isinstance(value, (list, tuple)):
        if len(value) != batch_size:
            raise ValueError(f"`{name}` has {len(value)} entries for {batch_size} rows")
        return list(value)
    return [value] * batch_size


def build_logits_processors_for_rows(
    generation_configs: list[Any],
    *,
    prompt_len: Any,
    max_length: Any,
    min_length: Any,
    eos_token_ids: Any,
    like: ProcessorChain | None = None,
    device: Any = None,
    attention_masks: Any = None,
    **kwargs: Any,
) -> ProcessorChain:
    """One per-row batch chain for a batch whose row ``b`` has ``generation_configs[b]``.

    Each row's chain is what :func:`build_logits_processors` builds for its config (so each row
    equals transformers for that request), then the rows are merged kind by kind
    (:meth:`ProcessorChain.merge_rows`): a kind absent from a row gets that row's "off" value.
    ``prompt_len``, ``max_length`` and ``min_length`` are one value for every row or a list with
    one per row; ``eos_token_ids`` is a list of ids for every row, or a list of such lists.
    ``attention_masks``: one ``[1, P]`` prompt mask per row (for the repetition penalty's left
    padding), or ``None``. ``like``: an existing batch chain the result must match kind for kind,
    to build a row for :meth:`ProcessorChain.with_row`. Other keyword arguments (``vocab_size``,
    ``num_beams``, ``user_processors``, ...) go to every row's build.
    """
    configs = list(generation_configs)
    if not configs:
        raise ValueError("build_logits_processors_for_rows needs at least one generation config")
    b = len(configs)
    masks = [None] * b if attention_masks is None else _per_row_setting(list(attention_masks), b, "attention_masks")
    prompt_lens = _per_row_setting(prompt_len, b, "prompt_len")
    max_lengths = _per_row_setting(max_length, b, "max_length")
    min_lengths = _per_row_setting(min_length, b, "min_length")
    if eos_token_ids and isinstance(eos_token_ids, (list, tuple)) and isinstance(eos_token_ids[0], (list, tuple)):
        eos_rows = _per_row_setting(list(eos_token_ids), b, "eos_token_ids")
    else:
        eos_rows = [eos_token_ids] * b
    chains = [
        build_logits_processors(
            config, prompt_len=pl, max_length=ml, min_length=mn, eos_token_ids=eos, attention_mask=mask,
            device=device, **kwargs)
        for config, pl, ml, mn, eos, mask in zip(configs, prompt_lens, max_lengths, min_lengths, eos_rows, masks)
    ]
    return ProcessorChain.merge_rows(chains, device=device, like=like)
