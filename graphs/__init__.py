"""Graph keys and graph caches (eager now; CUDA graphs plug in behind the same protocol)."""

from ._cache import EagerGraphCache, GraphCache, bucket_for
from ._key import GraphKey, SamplingPath

__all__ = ["EagerGraphCache", "GraphCache", "GraphKey", "SamplingPath", "bucket_for"]
