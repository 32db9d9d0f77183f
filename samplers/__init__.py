"""specloop.samplers: sampling params, exact sampling and rejection sampling, RNG streams,
SpecMetadata. Imports nothing of the project.

Public names load on first use (``._lazy``), so that the CLI can check SamplingParams
and catch SamplingParamsError without importing torch; mypy reads the imports under
``TYPE_CHECKING``."""

from typing import TYPE_CHECKING

from ._lazy import lazy_exports

if TYPE_CHECKING:
    from ._errors import SamplingParamsError
    from ._metadata import SpecMetadata
    from ._params import SamplingBatch, SamplingParams
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

if not TYPE_CHECKING:      # mypy reads the imports above: an unknown name stays an error
    __getattr__, __dir__ = lazy_exports(globals(), {
        "._errors": ("SamplingParamsError",),
        "._metadata": ("SpecMetadata",),
        "._params": ("SamplingBatch", "SamplingParams"),
        "._probs": ("compute_probs", "sample_tokens"),
        "._rejection": ("RejectionResult", "rejection_sample"),
        "._rng": ("Stream", "derive_seed", "uniform"),
        "._sampler": ("DefaultSampler", "DraftSample", "Sampler", "strict_verify"),
    })
