"""Generation with encoder-decoder models: the decoder-only strategies, given an encoder.

The encoder runs once, in ``init``; the cross-attention keys/values of every decoder layer are
computed from its output once too and live in the decode state, inside the cache
(``genfn.cache.encoder_decoder.EncoderDecoderCache``, which wraps the decoder's self-attention
cache and speaks the same protocol). From there on, greedy search, sampling and beam search are
the decoder-only strategies' own ``step`` functions, unchanged and compiled the same way: the
decoder's "prompt" is ``decoder_input_ids`` (by default one ``decoder_start_token_id`` per row).

``prepare_inputs`` is the imperative part ``generate`` calls: it resolves the encoder mask, the
decoder start tokens (an int, or one per batch row), and the ``decoder_``-prefixed kwargs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from genfn.cache.encoder_decoder import EncoderDecoderCache
from genfn.outputs import GenerateBeamEncoderDecoderOutput, GenerateEncoderDecoderOutput
from genfn.strategies import beam, sample
from genfn.strategies.base import Strategy
from genfn.strategies.request import GenerationRequest, StepTrace

__all__ = ["EncoderInputs", "ENCODER_DECODER_SAMPLE", "ENCODER_DECODER_BEAM", "DECODER_KWARGS",
           "for_encoder_decoder", "prepare_inputs", "split_model_kwargs", "start_cache"]

# The decoder_-prefixed model inputs generate routes to the decoder (transformers' names).
DECODER_KWARGS = ("decoder_input_ids", "decoder_attention_mask")


@dataclasses.dataclass(frozen=True)
class EncoderInputs:
    """The encoder's side of a request, one row per prompt (not expanded for beams / samples)."""

    input_ids: torch.Tensor  # [B, S]
    attention_mask: torch.Tensor  # [B, S] 0/1, either padding side
    # A precomputed encoder output (anything with ``last_hidden_state [B, S, d]``): skips the encoder.
    encoder_outputs: Any = None


def split_model_kwargs(unused: Mapping[str, Any]) -> tuple[dict, Any, dict]:
    """``(decoder kwargs, encoder_outputs, rest)`` from the kwargs that are not generation settings."""
    rest = dict(unused)
    decoder = {name[len("decoder_"):]: rest.pop(name) for name in list(rest) if name.startswith("decoder_")}
    unknown = sorted(f"decoder_{name}" for name in decoder if f"decoder_{name}" not in DECODER_KWARGS)
    if unknown:
        raise ValueError(f"generate() got decoder inputs the native decoders do not take: {unknown}; supported: "
                         f"{list(DECODER_KWARGS)}")
    return decoder, rest.pop("encoder_outputs", None), rest


def _encoder_mask(input_ids: torch.Tensor, attention_mask, pad_token_id: int | None,
                  eos_ids: tuple[int, ...]) -> torch.Tensor:
    """The encoder's ``[B, S]`` mask: the given one, or (as transformers) inferred from
    ``pad_token_id`` when it occurs and is not an EOS id. Either padding side is fine here."""
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask)
        if mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {list(mask.shape)} must equal input_ids shape "
                             f"{list(input_ids.shape)}")
        if mask.dtype.is_floating_point:
            raise ValueError(f"attention_mask must have an integer or bool dtype (values 0/1), got {mask.dtype}")
        return mask.to(device=input_ids.device, dtype=torch.int64)
    if pad_token_id is not None and pad_token_id not in eos_ids:
        return (input_ids != pad_token_id).long()
    return torch.ones_like(input_ids)


def _start_tokens(config, batch: int, device) -> torch.Tensor:
    """``[B, 1]``: ``decoder_start_token_id`` (an int or one per row), else ``bos_token_id``."""
    start = config.decoder_start_token_id
    if start is None:
        start = config.bos_token_id
    if start is None:
        raise ValueError("`decoder_start_token_id` or `bos_token_id` has to be defined for encoder-decoder "
                         "generation")
    if isinstance(start, (list, tuple)):
        if len(start) != batch:
            raise ValueError(f"decoder_start_token_id has {len(start)} values but the batch has {batch} rows: give "
                             f"one int, or one id per batch row")
        return torch.tensor(start, dtype=torch.int64, device=device).view(batch, 1)
    return torch.full((batch, 1), int(start), dtype=torch.int64, device=device)


def prepare_inputs(config, input_ids: torch.Tensor, attention_mask, decoder: Mapping[str, Any], encoder_outputs,
                   pad_token_id: int | None, eos_ids: tuple[int, ...]):
    """``(EncoderInputs, decoder_input_ids [B, P], decoder_attention_mask [B, P])``.

    As transformers: the decoder starts from ``decoder_start_token_id``; ``decoder_input_ids``,
    when given, continue from it, and get the start token prepended when no row begins with it.
    """
    batch, device = input_ids.shape[0], input_ids.device
    encoder = EncoderInputs(input_ids, _encoder_mask(input_ids, attention_mask, pad_token_id, eos_ids),
                            encoder_outputs)
    start = _start_tokens(config, batch, device)
    decoder_ids = decoder.get("input_ids")
    decoder_mask = decoder.get("attention_mask")
    if decoder_ids is None:
        return encoder, start, torch.ones_like(start)
    decoder_ids = torch.as_tensor(decoder_ids, dtype=torch.int64, device=device)
    if decoder_ids.dim() != 2 or decoder_ids.shape[0] != batch:
        raise ValueError(f"decoder_input_ids must be [batch, length] with batch {batch}, got "
                         f"{list(decoder_ids.shape)}")
    decoder_mask = (torch.ones_like(decoder_ids) if decoder_mask is None
                    else torch.as_tensor(decoder_mask, dtype=torch.int64, device=device))
    if decoder_mask.shape != decoder_ids.shape:
        raise ValueError(f"decoder_attention_mask shape {list(decoder_mask.shape)} must equal decoder_input_ids "
                         f"shape {list(decoder_ids.shape)}")
    if bool((decoder_ids[:, 0] != start[:, 0]).all()):
        decoder_ids = torch.cat([start, decoder_ids], dim=1)
        decoder_mask = torch.cat([torch.ones_like(start), decoder_mask], dim=1)
    return encoder, decoder_ids, decoder_mask


def _rows_expanded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with each row repeated (consecutively) up to ``rows`` rows, as the decoder's rows are."""
    return tensor if tensor.shape[0] == rows else tensor.repeat_interleave(rows // tensor.shape[0], dim=0)


def start_cache(model, request: GenerationRequest, rows: int) -> EncoderDecoderCache:
    """Run the encoder once, compute every decoder layer's cross-attention keys/values, and wrap
    a fresh self-attention cache (``cache_implementation``, default dynamic) around them."""
    encoder: EncoderInputs = request.encoder
    mask = _rows_expanded(encoder.attention_mask, rows)
    hidden_states = attentions = None
    if encoder.encoder_outputs is not None:
        last = encoder.encoder_outputs.last_hidden_state
    else:
        # Once per prompt, then shared by its beams / samples (transformers reports it unexpanded too).
        out = model.encode(encoder.input_ids, encoder.attention_mask,
                           output_hidden_states=request.output_hidden_states,
                           output_attentions=request.output_attentions)
        last, hidden_states, attentions = out.last_hidden_state, out.hidden_states, out.attentions
    keys, values = model.cross_attention_kv(_rows_expanded(last, rows))
    self_attention = model.init_cache(rows, request.max_cache_len, request.config.cache_implementation or "dynamic",
                                      request.config.cache_config)
    return EncoderDecoderCache(self_attention=self_attention, cross_keys=keys, cross_values=values,
                               encoder_valid=mask.to(torch.bool), encoder_hidden_states=hidden_states,
                               encoder_attentions=attentions)


def _last_query(maps):
    return tuple(m[:, :, -1:].contiguous() for m in maps)


def _with_prefill_cross(state):
    """Keep the prefill's cross-attention maps aside and give the steps' field a step's shape, so no
    leaf of the state changes shape from the first step on."""
    cache = state.cache
    if cache.cross_attentions is None:
        return state
    return state.replace(cache=cache.replace(prefill_cross_attentions=cache.cross_attentions,
                                             cross_attentions=_last_query(cache.cross_attentions)))


def _encoder_decoder(inner: Strategy, output_type) -> Strategy:
    def init(model, request: GenerationRequest):
        if request.encoder is None:
            raise ValueError(f"the {inner.name!r} encoder-decoder strategy needs request.encoder (generate sets it "
                             f"for an encoder-decoder model)")
        cache = start_cache(model, request, request.input_ids.shape[0])
        return _with_prefill_cross(inner.init(model, request, cache=cache))

    def collect(state, trace: StepTrace) -> None:
        inner.collect(state, trace)
        cache = state.cache
        if cache.cross_attentions is not None:
            first = not trace.cross_attentions
            trace.cross_attentions.append(cache.prefill_cross_attentions if first else cache.cross_attentions)

    def finish(state, trace: StepTrace, request: GenerationRequest):
        out = inner.finish(state, trace, request)
        if not request.config.return_dict_in_generate:
            return out
        fields = {name: value for name, value in out.items() if name not in ("attentions", "hidden_states")}
        fields.pop("cache", None)
        cache = state.cache
        return output_type(
            **fields,
            encoder_attentions=cache.encoder_attentions,
            encoder_hidden_states=cache.encoder_hidden_states,
            decoder_attentions=out.attentions,
            cross_attentions=tuple(trace.cross_attentions) if request.output_attentions else None,
            decoder_hidden_states=out.hidden_states,
            cache=out.cache,
        )

    return dataclasses.replace(inner, name=f"encoder_decoder_{inner.name}", init=init, collect=collect,
                               finish=finish)


# Greedy search / sampling and beam search / beam sampling for encoder-decoder models: the same
# step functions as the decoder-only strategies (one compiled step serves both kinds of model).
ENCODER_DECODER_SAMPLE = _encoder_decoder(sample.SAMPLE, GenerateEncoderDecoderOutput)
ENCODER_DECODER_BEAM = _encoder_decoder(beam.BEAM, GenerateBeamEncoderDecoderOutput)

_FOR_ENCODER_DECODER = {sample.SAMPLE.name: ENCODER_DECODER_SAMPLE, beam.BEAM.name: ENCODER_DECODER_BEAM}


def for_encoder_decoder(strategy: Strategy) -> Strategy:
    """The encoder-decoder version of a built-in decoder-only strategy."""
    try:
        return _FOR_ENCODER_DECODER[strategy.name]
    except KeyError:
        raise ValueError(f"the {strategy.name!r} strategy has no encoder-decoder version; supported: "
                         f"{sorted(_FOR_ENCODER_DECODER)}") from None
