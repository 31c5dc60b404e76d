"""Logits processors: pure functions of (logits, LogitsContext), and their chain.

Every processor equals its transformers counterpart (same name) on the same inputs; see
``chain.build_logits_processors`` for the order ``generate`` applies them in. Lengths in the
context are per row, and so are the processors' numbers (``ProcessorChain.per_row``): one
compiled step serves every value, and a batch whose rows differ.
"""

from genfn.processors.base import LogitsProcessor, ProcessorBase, StatefulLogitsProcessor
from genfn.processors.bias import NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor
from genfn.processors.chain import ProcessorChain, build_logits_processors, build_logits_processors_for_rows
from genfn.processors.context import LogitsContext
from genfn.processors.external import ExternalLogitsProcessor
from genfn.processors.forcing import (
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
from genfn.processors.guidance import (ClassifierFreeGuidanceLogitsProcessor, UnbatchedClassifierFreeGuidanceLogitsProcessor,
                                       guidance_combine)
from genfn.processors.ngrams import EncoderNoRepeatNGramLogitsProcessor, NoRepeatNGramLogitsProcessor
from genfn.processors.numerics import InfNanRemoveLogitsProcessor, LogitNormalization
from genfn.processors.openai_sampling import LogitBiasLogitsProcessor, PresenceFrequencyPenaltyLogitsProcessor
from genfn.processors.penalties import (
    EncoderRepetitionPenaltyLogitsProcessor,
    ExponentialDecayLengthPenalty,
    RepetitionPenaltyLogitsProcessor,
)
from genfn.processors.prefix import PrefixConstrainedLogitsProcessor
from genfn.processors.rows import RowSelect
from genfn.processors.rowvalues import RowValue
from genfn.processors.synthid import (
    SynthIDTextWatermarkLogitsProcessor,
    SynthIDTextWatermarkState,
    synthid_mean_score,
    synthid_weighted_mean_score,
)
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
from genfn.processors.watermark import (
    WatermarkDetector,
    WatermarkDetectorOutput,
    WatermarkLogitsProcessor,
    greenlist_ids,
)

__all__ = [
    "LogitsContext",
    "LogitsProcessor",
    "StatefulLogitsProcessor",
    "ProcessorBase",
    "ProcessorChain",
    "build_logits_processors",
    "build_logits_processors_for_rows",
    # per-row values
    "RowValue",
    "RowSelect",
    "guidance_combine",
    "ClassifierFreeGuidanceLogitsProcessor",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor",
    # warpers
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "MinPLogitsWarper",
    "TopHLogitsWarper",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
    # penalties
    "RepetitionPenaltyLogitsProcessor",
    "EncoderRepetitionPenaltyLogitsProcessor",
    "ExponentialDecayLengthPenalty",
    # n-grams
    "NoRepeatNGramLogitsProcessor",
    "EncoderNoRepeatNGramLogitsProcessor",
    # biases
    "SequenceBiasLogitsProcessor",
    "NoBadWordsLogitsProcessor",
    # OpenAI's sampling parameters
    "PresenceFrequencyPenaltyLogitsProcessor",
    "LogitBiasLogitsProcessor",
    # forcing / suppression
    "MinLengthLogitsProcessor",
    "MinNewTokensLengthLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor",
    "SuppressTokensLogitsProcessor",
    "SuppressTokensAtBeginLogitsProcessor",
    # numerics
    "InfNanRemoveLogitsProcessor",
    "LogitNormalization",
    # eager-only
    "PrefixConstrainedLogitsProcessor",
    "ExternalLogitsProcessor",
    # watermarking
    "WatermarkLogitsProcessor",
    "WatermarkDetector",
    "WatermarkDetectorOutput",
    "greenlist_ids",
    "SynthIDTextWatermarkLogitsProcessor",
    "SynthIDTextWatermarkState",
    "synthid_mean_score",
    "synthid_weighted_mean_score",
]

# transformers' processors for audio and speech models, whose generation loops genfn does not run.
_AUDIO_MODEL_PROCESSORS = {
    "AlternatingCodebooksLogitsProcessor": "Bark", "BarkEosPrioritizerLogitsProcessor": "Bark",
    "DiaClassifierFreeGuidanceLogitsProcessor": "Dia", "DiaEOSChannelFilterLogitsProcessor": "Dia",
    "DiaEOSDelayPatternLogitsProcessor": "Dia", "WhisperTimeStampLogitsProcessor": "Whisper",
    "WhisperNoSpeechDetection": "Whisper",
}


def __getattr__(name: str):
    model = _AUDIO_MODEL_PROCESSORS.get(name)
    if model is not None:
        raise AttributeError(f"genfn.processors has no {name}: it belongs to {model}'s audio generation, which genfn "
                             f"does not run; use transformers.generation.{name} with transformers' {model} model")
    raise AttributeError(f"module 'genfn.processors' has no attribute {name!r}")
