"""Graph keys and graph caches: eager, and CUDA graphs captured at warmup."""

from ._cache import EagerGraphCache, GraphCache, Step, Tensors, bucket_for
from ._cuda import CudaGraphCache
from ._key import GraphKey, SamplingPath

__all__ = ["CudaGraphCache", "EagerGraphCache", "GraphCache", "GraphKey", "SamplingPath",
           "Step", "Tensors", "bucket_for"]
