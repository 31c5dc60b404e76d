"""The public API: the names a transformers user imports exist under the same names."""

import transformers

import genfn

# Names transformers exports at its top level that genfn must export too.
SHARED = ["GenerationConfig", "CompileConfig", "ContinuousBatchingConfig", "WatermarkingConfig",
          "SynthIDTextWatermarkingConfig", "StoppingCriteria", "StoppingCriteriaList", "MaxLengthCriteria",
          "MaxTimeCriteria", "EosTokenCriteria", "StopStringCriteria", "TextStreamer", "TextIteratorStreamer",
          "AsyncTextIteratorStreamer", "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper",
          "MinPLogitsWarper", "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper",
          "RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor", "NoBadWordsLogitsProcessor",
          "SequenceBiasLogitsProcessor", "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor",
          "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor", "SuppressTokensLogitsProcessor",
          "SuppressTokensAtBeginLogitsProcessor", "InfNanRemoveLogitsProcessor", "LogitNormalization",
          "PrefixConstrainedLogitsProcessor", "ExponentialDecayLengthPenalty", "WatermarkLogitsProcessor",
          "WatermarkDetector", "SynthIDTextWatermarkLogitsProcessor"]


def test_every_exported_name_exists():
    for name in genfn.__all__:
        assert hasattr(genfn, name), name


def test_transformers_names_are_exported_under_the_same_names():
    for name in SHARED:
        assert hasattr(transformers, name), f"transformers has no {name} (fix the list)"
        assert name in genfn.__all__ and hasattr(genfn, name), name
