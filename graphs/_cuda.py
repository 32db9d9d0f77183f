"""CUDA graphs for VERIFY: one graph per batch bucket x draft length x sampling variant.

Captured at warmup only (never while serving), on one shared memory pool, with static
input and output buffers: a replay copies the iteration's inputs into the static inputs,
replays, and hands back the static outputs (valid until the next replay). A step that
writes its next inputs itself (``FeedsItself``: VERIFY at K = 0) is replayed again with no
inputs, so nothing runs between the two graphs. Randomness is read from the seeds and
positions in those inputs, so replays do not freeze the RNG.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, TypeVar

import structlog
import torch

from ._cache import GraphCache, Step, Tensors, bucket_for, check_feeds_itself, inputs_written
from ._key import GraphKey, SamplingPath

log = structlog.get_logger(__name__)
T = TypeVar("T")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def capture_graph(fn: Callable[[], T], *, warmups: int = 1,
                  **graph_kw: Any) -> tuple[torch.cuda.CUDAGraph, T]:
    """fn() captured in a new CUDA graph: ``warmups`` calls first on a side stream, as
    capture requires (kernels compile, lazy buffers are made, off the capture), then the
    captured call; ``graph_kw`` go to torch.cuda.graph (pool, capture_error_mode). Returns
    the graph and what the captured call returned (its static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, **graph_kw):
        out = fn()
    return graph, out


class _Captured:
    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: Tensors, outputs: Tensors,
                 writes: tuple[str, ...]):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs
        self.writes = writes    # inputs the graph writes for its next replay
        self.replays = 0
        # The source tensor last copied into each static input: inputs that are the very
        # same tensor as last time (sampling columns of an unchanged batch) are not copied
        # again. Callers never modify an input tensor in place after handing it over.
        self.sources: dict[str, torch.Tensor] = {}


class CudaGraphCache(GraphCache):
    def __init__(self, config: Any = None, *, buckets: Iterable[int] | None = None) -> None:
        if buckets is None:
            buckets = DEFAULT_BUCKETS if config is None else config.graphs.batch_buckets
        self.buckets = tuple(sorted(set(buckets)))
        self._graphs: dict[GraphKey, _Captured] = {}
        self._pool = None
        self.sealed = False  # after warmup nothing is captured

    def pick(self, batch_size: int, num_draft_tokens: int, sampling_path: SamplingPath,
             all_greedy: bool, *, agreed: bool = True) -> tuple[GraphKey, bool]:
        bucket = bucket_for(batch_size, self.buckets) if agreed else None
        if bucket is not None:
            key = GraphKey(bucket, num_draft_tokens, sampling_path, all_greedy)
            if key in self._graphs:
                return key, True
        return GraphKey(batch_size, num_draft_tokens, sampling_path, all_greedy), False

    def has(self, key: GraphKey) -> bool:
        return key in self._graphs

    def keys_to_capture(self, max_batch_size: int, num_draft_tokens: int,
                        variants: Iterable[tuple[SamplingPath, bool]]) -> list[GraphKey]:
        # Buckets up to the largest batch, which is always a bucket itself.
        sizes = sorted({b for b in self.buckets if b < max_batch_size} | {max_batch_size})
        self.buckets = tuple(sizes)
        return [GraphKey(b, num_draft_tokens, path, all_greedy)
                for path, all_greedy in variants for b in sizes]

    def capture(self, key: GraphKey, step: Step, example: Tensors) -> None:
        if self.sealed:
            raise RuntimeError(f"capture of {key} after warmup: graphs are captured only "
                               "at warmup")
        inputs = {name: t.clone() for name, t in example.items()}
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # thread_local: a CUDA call another thread makes meanwhile (the event loop's, or
        # a pinned host buffer freed there, which records an event) must not invalidate
        # this capture; calls in this thread are still checked. (Seen once in 57 GPU test
        # runs of an engine built right after another: "operation failed due to a
        # previous error during capture".)
        graph, outputs = capture_graph(lambda: step(inputs), warmups=2, pool=self._pool,
                                       capture_error_mode="thread_local")
        self._graphs[key] = _Captured(graph, inputs, outputs, inputs_written(step))
        log.info("graph_captured", batch_size=key.batch_size, k=key.num_draft_tokens,
                 sampling_path=key.sampling_path.value, all_greedy=key.all_greedy)

    def seal(self) -> None:
        self.sealed = True

    def replay(self, key: GraphKey, inputs: Tensors | None) -> Tensors:
        captured = self._graphs[key]
        if inputs is None:
            check_feeds_itself(key, captured.writes)
        else:
            for name, static in captured.inputs.items():
                source = inputs[name]
                if captured.sources.get(name) is not source:
                    if source is not static:    # else written in place (static_inputs)
                        static.copy_(source, non_blocking=True)
                    captured.sources[name] = source
        captured.graph.replay()
        captured.replays += 1
        for name in captured.writes:    # changed by the graph: the next inputs are copied
            captured.sources.pop(name, None)
        return captured.outputs

    def feeds_itself(self, key: GraphKey) -> bool:
        """Whether ``key``'s graph writes its next inputs (``replay(key, None)`` then runs
        on them). A subclass keeping its own records says False unless it overrides this."""
        return bool(getattr(self._graphs.get(key), "writes", ()))

    def static_inputs(self, key: GraphKey) -> Tensors:
        """The static inputs of ``key``: a caller may write an input there in place
        (queued on the stream, behind the replays that read the old value) and hand that
        very tensor to ``replay``, which then copies nothing for it (the chained step's
        glue, engine/_chain.py); tests compare what the graph wrote."""
        return self._graphs[key].inputs

    def replay_counts(self) -> dict[GraphKey, int]:
        """How often each captured key ran (tests assert which variant replayed)."""
        return {key: c.replays for key, c in self._graphs.items()}
