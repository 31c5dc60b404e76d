"""genfn: text generation as pure step functions over state pytrees."""

from genfn import random
from genfn.config import (
    CompileConfig,
    GenerationConfig,
    GenerationMode,
    SynthIDTextWatermarkingConfig,
    WatermarkingConfig,
)
from genfn.generation import generate
from genfn.models.model import Model, load
from genfn.outputs import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput
from genfn.scores import compute_transition_scores
from genfn.stopping import StoppingCriteria, StoppingCriteriaList

__all__ = [
    "random",
    "generate",
    "load",
    "Model",
    "GenerationConfig",
    "GenerationMode",
    "CompileConfig",
    "WatermarkingConfig",
    "SynthIDTextWatermarkingConfig",
    "GenerateDecoderOnlyOutput",
    "GenerateBeamDecoderOnlyOutput",
    "compute_transition_scores",
    "StoppingCriteria",
    "StoppingCriteriaList",
]
