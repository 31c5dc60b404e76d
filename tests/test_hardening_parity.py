"""Parity with transformers' generation objects (transformers is the test-only oracle): the public
attributes users read back, construction with transformers' arguments, the classifier-free
guidance classes, SynthID's state-initialising first call on an empty ``input_ids``, and the
channels through which validation reports (logger warnings, UserWarning, ValueError)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import transformers.generation as tg

import genfn
from conftest import tiny_pair
from genfn.processors.context import LogitsContext

# Constructor arguments in transformers' form, for every class both libraries export.
ARGUMENTS = {
    "TemperatureLogitsWarper": dict(temperature=0.7),
    "TopKLogitsWarper": dict(top_k=5, filter_value=-5.0, min_tokens_to_keep=2),
    "TopPLogitsWarper": dict(top_p=0.8, min_tokens_to_keep=2),
    "MinPLogitsWarper": dict(min_p=0.1),
    "TopHLogitsWarper": dict(top_h=0.5),
    "TypicalLogitsWarper": dict(mass=0.8),
    "EpsilonLogitsWarper": dict(epsilon=0.01),
    "EtaLogitsWarper": dict(epsilon=0.01),
    "RepetitionPenaltyLogitsProcessor": dict(penalty=1.3),
    "EncoderRepetitionPenaltyLogitsProcessor": dict(penalty=2.0, encoder_input_ids=torch.tensor([[1, 2, 3]])),
    "ExponentialDecayLengthPenalty": dict(exponential_decay_length_penalty=(2, 1.1), eos_token_id=2,
                                          input_ids_seq_length=3),
    "NoRepeatNGramLogitsProcessor": dict(ngram_size=2),
    "EncoderNoRepeatNGramLogitsProcessor": dict(encoder_ngram_size=2, encoder_input_ids=torch.tensor([[1, 2, 3]])),
    "SequenceBiasLogitsProcessor": dict(sequence_bias=[[[1], 2.0], [[3, 4], -1.0]]),
    "NoBadWordsLogitsProcessor": dict(bad_words_ids=[[1], [3, 4], [2]], eos_token_id=2),
    "MinLengthLogitsProcessor": dict(min_length=5, eos_token_id=2),
    "MinNewTokensLengthLogitsProcessor": dict(prompt_length_to_skip=3, min_new_tokens=2, eos_token_id=2),
    "ForcedBOSTokenLogitsProcessor": dict(bos_token_id=1),
    "ForcedEOSTokenLogitsProcessor": dict(max_length=10, eos_token_id=2),
    "SuppressTokensLogitsProcessor": dict(suppress_tokens=[1, 2]),
    "SuppressTokensAtBeginLogitsProcessor": dict(begin_suppress_tokens=[1, 2], begin_index=3),
    "PrefixConstrainedLogitsProcessor": dict(prefix_allowed_tokens_fn=lambda b, ids: [1], num_beams=1),
    "WatermarkLogitsProcessor": dict(vocab_size=97, device="cpu"),
    "SynthIDTextWatermarkLogitsProcessor": dict(ngram_len=3, keys=[1, 2, 3], sampling_table_size=2**8,
                                                sampling_table_seed=0, context_history_size=16, device="cpu"),
    "ClassifierFreeGuidanceLogitsProcessor": dict(guidance_scale=1.5),
    "MaxLengthCriteria": dict(max_length=10),
    "MaxTimeCriteria": dict(max_time=1.0, initial_timestamp=5.0),
    "EosTokenCriteria": dict(eos_token_id=2),
    "ConfidenceCriteria": dict(assistant_confidence_threshold=0.4),
}

# transformers' private working state, not values a user sets or reads back.
INTERNAL = {"length_1_bias", "multi_token_biases", "prepared_bias_variables", "logits_indices", "cu_seq_lens_q",
            "rng", "fixed_table", "generated_ngrams"}


def _same(ours, theirs) -> bool:
    if isinstance(ours, torch.Tensor) or isinstance(theirs, torch.Tensor):
        ours, theirs = torch.as_tensor(ours), torch.as_tensor(theirs)
        return ours.shape == theirs.shape and torch.equal(ours, theirs.to(ours.dtype))
    return ours == theirs


@pytest.mark.parametrize("name", sorted(ARGUMENTS))
def test_public_attributes_equal_transformers(name):
    ours = getattr(genfn, name)(**ARGUMENTS[name])
    theirs = getattr(tg, name)(**ARGUMENTS[name])
    for attribute, value in vars(theirs).items():
        if attribute.startswith("_") or attribute in INTERNAL:
            continue
        assert hasattr(ours, attribute), f"{name} has no {attribute!r}"
        assert _same(getattr(ours, attribute), value), f"{name}.{attribute}: {getattr(ours, attribute)!r} != {value!r}"


def test_every_transformers_processor_class_exists():
    audio = {"AlternatingCodebooksLogitsProcessor", "WhisperTimeStampLogitsProcessor"}  # audio models only
    names = [n for n in dir(tg) if n.endswith(("LogitsProcessor", "LogitsWarper", "Criteria"))]
    assert sorted(n for n in names if not hasattr(genfn, n)) == sorted(audio & set(names))


def test_encoder_repetition_penalty_reads_back_transformers_inverse_and_merges_per_row():
    # transformers keeps 1 / penalty; genfn's per-row leaf keeps the value given (1 = off).
    built = genfn.EncoderRepetitionPenaltyLogitsProcessor(penalty=2.0)
    assert built.penalty == tg.EncoderRepetitionPenaltyLogitsProcessor(penalty=2.0, encoder_input_ids=None).penalty == 0.5
    assert built.encoder_penalty == 2.0
    merged = genfn.EncoderRepetitionPenaltyLogitsProcessor.merge_rows([built, None, genfn.EncoderRepetitionPenaltyLogitsProcessor(0.8)])
    assert merged.encoder_penalty.tolist() == [2.0, 1.0, 0.8]
    assert torch.allclose(merged.penalty, torch.tensor([0.5, 1.0, 1.25], dtype=torch.float64))
    tokens = torch.tensor([[4, 6, 0], [4, 6, 0], [4, 6, 0]])
    ctx = LogitsContext(tokens=tokens, cur_len=torch.tensor([2, 2, 2]), prompt_len=torch.tensor([2, 2, 2]))
    logits = torch.randn(3, 9)
    out = merged(logits, ctx)
    for row, given in enumerate([2.0, None, 0.8]):
        expected = logits[row:row + 1] if given is None else tg.EncoderRepetitionPenaltyLogitsProcessor(
            given, tokens[row:row + 1, :2])(tokens[row:row + 1, :2], logits[row:row + 1])
        assert torch.equal(out[row:row + 1], expected)


@pytest.mark.parametrize("name, transformers_form, genfn_form", [
    ("SequenceBiasLogitsProcessor", ([[[1], 2.0], [[3, 4], -1.0]],),
     lambda cls: cls.create([[[1], 2.0], [[3, 4], -1.0]])),
    ("NoBadWordsLogitsProcessor", ([[1], [3, 4]], 2), lambda cls: cls.create([[1], [3, 4]], 2)),
    ("ExponentialDecayLengthPenalty", ((2, 1.1), 2, 3), lambda cls: cls.from_config((2, 1.1), 2, 3)),
    ("EncoderNoRepeatNGramLogitsProcessor", (2, torch.tensor([[5, 6, 7]])),
     lambda cls: cls(ngram_size=2, encoder_input_ids=torch.tensor([[5, 6, 7]]))),
])
def test_transformers_arguments_build_the_same_processor(name, transformers_form, genfn_form):
    cls = getattr(genfn, name)
    torch.manual_seed(0)
    logits = torch.randn(2, 97)
    tokens = torch.tensor([[5, 6, 7, 3, 0, 0], [5, 6, 3, 4, 1, 0]])
    ctx = LogitsContext(tokens=tokens, cur_len=torch.tensor([4, 5]), prompt_len=torch.tensor([2, 2]))
    assert torch.equal(cls(*transformers_form)(logits, ctx), genfn_form(cls)(logits, ctx))
    rebuilt = cls(*transformers_form).replace()  # the dataclass form still works (replace, pytrees)
    assert torch.equal(rebuilt(logits, ctx), genfn_form(cls)(logits, ctx))


def test_batched_guidance_equals_transformers():
    torch.manual_seed(1)
    ids, scores = torch.randint(0, 97, (3, 4)), torch.randn(6, 97).log_softmax(-1)
    ours = genfn.ClassifierFreeGuidanceLogitsProcessor(1.5)(ids, scores)
    theirs = tg.ClassifierFreeGuidanceLogitsProcessor(1.5)(ids, scores)
    torch.testing.assert_close(ours, theirs)
    with pytest.raises(ValueError, match="guidance scale >1"):
        genfn.ClassifierFreeGuidanceLogitsProcessor(1.0)
    with pytest.raises(ValueError, match="twice the batch size"):
        genfn.ClassifierFreeGuidanceLogitsProcessor(1.5)(ids, scores[:3])


def test_unbatched_guidance_equals_transformers_over_several_steps():
    hf_model, model = tiny_pair()
    ours = genfn.UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, model)
    theirs = tg.UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, hf_model)
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.manual_seed(2)
    for _ in range(3):
        scores = torch.randn(1, 97)
        torch.testing.assert_close(ours(ids, scores), theirs(ids, scores), rtol=1e-4, atol=1e-4)
        ids = torch.cat([ids, torch.randint(3, 97, (1, 1))], dim=1)


def test_synthid_first_call_with_an_empty_input_ids():
    processor = genfn.SynthIDTextWatermarkLogitsProcessor(**ARGUMENTS["SynthIDTextWatermarkLogitsProcessor"])
    state = processor.init_state(2)
    empty = torch.zeros((2, 0), dtype=torch.int64)
    ctx = LogitsContext(tokens=empty, cur_len=torch.zeros(2, dtype=torch.int64),
                        prompt_len=torch.zeros(2, dtype=torch.int64))
    logits = torch.randn(2, 97)
    out, state = processor.apply(logits, ctx, state)
    assert out.shape == (2, 97) and state.num_calls.tolist() == [1, 1]
    # The same as a first call on a real prompt: the first call never reads a token.
    prompt = LogitsContext(tokens=torch.tensor([[5, 6], [7, 8]]), cur_len=torch.tensor([2, 2]),
                           prompt_len=torch.tensor([2, 2]))
    expected, _ = processor.apply(logits, prompt, processor.init_state(2))
    assert torch.equal(out, expected)


def test_validate_stopping_criteria_reports_as_transformers():
    for module in (genfn, tg):
        with pytest.warns(UserWarning):
            kept = module.validate_stopping_criteria(module.StoppingCriteriaList([module.MaxLengthCriteria(10)]), 11)
        assert len(kept) == 1
        added = module.validate_stopping_criteria(module.StoppingCriteriaList(), 11)
        assert len(added) == 1 and added[0].max_length == 11


@pytest.mark.parametrize("settings, flagged", [
    (dict(do_sample=False, temperature=0.5), "temperature"),
    (dict(num_beams=1, length_penalty=2.0), "length_penalty"),
    (dict(early_stopping=True), "early_stopping"),
    (dict(num_return_sequences=2), None),
])
def test_generation_config_validation_channels_match_transformers(settings, flagged, caplog, monkeypatch):
    """Where transformers logs a warning (not a Python warning), genfn logs one too; where it raises
    ValueError, genfn does."""
    import transformers
    from genfn.config import validation

    if flagged is None:
        for cls in (genfn.GenerationConfig, transformers.GenerationConfig):
            with pytest.raises(ValueError):
                cls(**settings)
        return
    monkeypatch.setattr(validation, "_logged", set())  # said once per process: forget earlier tests
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither library turns these into Python warnings
        with caplog.at_level(logging.WARNING):
            genfn.GenerationConfig(**settings)
        transformers.GenerationConfig(**settings)
    assert any(flagged in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


@pytest.mark.parametrize("name, model", [("BarkEosPrioritizerLogitsProcessor", "Bark"),
                                         ("DiaEOSChannelFilterLogitsProcessor", "Dia"),
                                         ("WhisperTimeStampLogitsProcessor", "Whisper")])
def test_audio_model_processors_are_refused_by_name(name, model):
    import genfn.processors

    with pytest.raises(AttributeError, match=f"{name}.*{model}'s audio generation.*transformers"):
        getattr(genfn.processors, name)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchProcessor'"):
        genfn.processors.NoSuchProcessor  # noqa: B018
