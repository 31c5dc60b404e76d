"""genfn: text generation as pure step functions over state pytrees.

The names a transformers user imports live here under the same names: the config types,
``generate``, the logits processors and warpers, the stopping criteria, the streamers and the
output types; plus genfn's own: ``random`` (keys), ``Strategy``, ``load``.
"""

# Before anything imports torch (libgomp reads its wait policy once, when torch loads it): genfn's
# command line chooses OpenMP's wait policy here; a library import leaves the environment alone.
from genfn import wait_policy as _wait_policy

_wait_policy.apply_default()

from genfn import random  # noqa: E402
from genfn._version import package_version as _package_version  # noqa: E402
from genfn.config import (
    CompileConfig,
    ContinuousBatchingConfig,
    GenerationConfig,
    GenerationMode,
    SynthIDTextWatermarkingConfig,
    WatermarkingConfig,
)
from genfn.driver import NonFiniteLogitsError
from genfn.generation import generate
from genfn.kernels.invariant import deterministic
from genfn.models.functional import FunctionalModel
from genfn.models.adapter import from_module
from genfn.models.loading import load
from genfn.models.model import EncoderDecoderModel, Model
from genfn.model_methods import attach_model_methods
from genfn.models.save import save
from genfn.outputs import (GenerateBeamDecoderOnlyOutput, GenerateBeamEncoderDecoderOutput, GenerateDecoderOnlyOutput,
                           GenerateEncoderDecoderOutput)
from genfn.processors import (
    ClassifierFreeGuidanceLogitsProcessor,
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    ProcessorChain,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    SynthIDTextWatermarkLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
    WatermarkDetector,
    WatermarkLogitsProcessor,
)
from genfn.scores import compute_transition_scores
from genfn.stopping import (
    ConfidenceCriteria,
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
    validate_stopping_criteria,
)
from genfn.strategies.base import Strategy
from genfn.streamers import (
    AsyncTextIteratorStreamer,
    BaseStreamer,
    GenerationError,
    TextIteratorStreamer,
    TextStreamer,
)

__version__ = _package_version()

attach_model_methods(Model)  # model.generate, model.generate_batch, ...: the public API's, not models/'

__all__ = [
    "random", "generate", "deterministic", "load", "save", "from_module", "Model", "EncoderDecoderModel", "FunctionalModel", "Strategy",
    "NonFiniteLogitsError",
    "GenerationConfig", "GenerationMode", "CompileConfig", "ContinuousBatchingConfig", "WatermarkingConfig",
    "SynthIDTextWatermarkingConfig",
    "GenerateDecoderOnlyOutput", "GenerateBeamDecoderOnlyOutput", "GenerateEncoderDecoderOutput",
    "GenerateBeamEncoderDecoderOutput", "compute_transition_scores",
    # stopping criteria
    "StoppingCriteria", "StoppingCriteriaList", "MaxLengthCriteria", "MaxTimeCriteria", "EosTokenCriteria",
    "ConfidenceCriteria", "StopStringCriteria", "validate_stopping_criteria",
    # streamers
    "BaseStreamer", "TextStreamer", "TextIteratorStreamer", "AsyncTextIteratorStreamer", "GenerationError",
    # logits processors
    "LogitsProcessor", "ProcessorChain", "ClassifierFreeGuidanceLogitsProcessor",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor", "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper",
    "MinPLogitsWarper", "TopHLogitsWarper", "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper",
    "RepetitionPenaltyLogitsProcessor", "EncoderRepetitionPenaltyLogitsProcessor", "ExponentialDecayLengthPenalty",
    "NoRepeatNGramLogitsProcessor", "EncoderNoRepeatNGramLogitsProcessor", "SequenceBiasLogitsProcessor",
    "NoBadWordsLogitsProcessor", "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor", "SuppressTokensLogitsProcessor",
    "SuppressTokensAtBeginLogitsProcessor", "InfNanRemoveLogitsProcessor", "LogitNormalization",
    "PrefixConstrainedLogitsProcessor", "WatermarkLogitsProcessor", "WatermarkDetector",
    "SynthIDTextWatermarkLogitsProcessor",
]
