"""specloop.samplers: sampling params, exact sampling and rejection sampling, RNG streams,
SpecMetadata. Imports nothing of the project."""

from ._metadata import SpecMetadata
from ._params import SamplingBatch, SamplingParams, SamplingParamsError
from ._probs import compute_probs, sample_tokens
from ._rejection import RejectionResult, rejection_sample
from ._rng import Stream, derive_seed, uniform
from ._sampler import DefaultSampler, DraftSample, Sampler, strict_verify

__all__ = [
    "DefaultSampler",
    "DraftSample",
    "RejectionResult",
    "Sampler",
    "SamplingBatch",
    "SamplingParams",
    "SamplingParamsError",
    "SpecMetadata",
    "Stream",
    "compute_probs",
    "derive_seed",
    "rejection_sample",
    "sample_tokens",
    "strict_verify",
    "uniform",
]
