"""Graph caches: which key an iteration runs under, and whether a captured graph serves it.

A step is a function ``fn(inputs) -> outputs`` over dicts of tensors with a static
shape for a given key; the engine names the keys to warm up, the cache captures them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol, runtime_checkable

import attrs
import torch

from ._key import GraphKey, SamplingPath

Tensors = dict[str, torch.Tensor]
Step = Callable[[Tensors], Tensors]


@attrs.frozen
class FeedsItself:
    """A step that also writes, in place, the inputs ``writes`` of the step after it for
    the same rows (VERIFY at K = 0: its token and the next position, engine/_verify.py).
    A cache that captured one replays it again with no inputs (``replay(key, None)``):
    nothing is copied in between. Called as the step itself."""

    fn: Step
    writes: tuple[str, ...]

    def __call__(self, inputs: Tensors) -> Tensors:
        return self.fn(inputs)


def inputs_written(step: Step) -> tuple[str, ...]:
    """The inputs ``step`` writes for its next replay (``FeedsItself``); () for others."""
    return step.writes if isinstance(step, FeedsItself) else ()


def check_feeds_itself(key: GraphKey, writes: tuple[str, ...]) -> None:
    """``replay(key, None)`` needs a step that wrote its own next inputs."""
    if not writes:
        raise RuntimeError(f"replay of {key} without inputs: its step does not write its "
                           "next inputs (only a FeedsItself step does)")


@runtime_checkable
class GraphCache(Protocol):
    """Everything the engine calls on a graph cache. The factory named in config is
    called as ``factory(config)``. Subclass it to inherit the default of ``seal`` (does
    nothing), or implement every member. Optional: ``feeds_itself(key) -> bool``, True
    where ``replay(key, None)`` replays the inputs a ``FeedsItself`` step wrote (the
    engine asks before it replays without inputs; without the method it never does);
    ``static_inputs(key) -> Tensors``, the captured key's static inputs, which a caller may
    write in place and hand back as the inputs themselves (a replay then copies nothing
    for them; without the method the engine hands over tensors to copy)."""

    def pick(self, batch_size: int, num_draft_tokens: int, sampling_path: SamplingPath,
             all_greedy: bool, *, agreed: bool = True) -> tuple[GraphKey, bool]:
        """(the key to run under, whether a captured graph serves it). Captured: the key's
        ``batch_size`` is the bucket the batch is padded to; else it is ``batch_size`` and
        the step runs eagerly. ``batch_size`` must be agreed by the group; ``agreed`` False
        (ranks differ in path) means every rank runs eagerly."""
        ...

    def keys_to_capture(self, max_batch_size: int, num_draft_tokens: int,
                        variants: Iterable[tuple[SamplingPath, bool]]) -> list[GraphKey]:
        """The keys to capture at warmup, for (sampling path, all-greedy) variants."""
        ...

    def capture(self, key: GraphKey, step: Step, example: Tensors) -> None: ...

    def has(self, key: GraphKey) -> bool:
        """Whether ``key`` (of either stage) was captured."""
        ...

    def replay(self, key: GraphKey, inputs: Tensors | None) -> Tensors:
        """Run the captured ``key`` on ``inputs``; the outputs may be static buffers that
        the next replay overwrites. ``inputs`` None (where ``feeds_itself(key)``): run on
        the inputs its last replay wrote (the caller knows they are the ones it wants:
        the same rows, nothing else replayed ``key`` since)."""
        ...

    def seal(self) -> None:
        """Warmup is over: nothing is captured after this (the engine calls it once,
        after the last ``capture``). Default: nothing."""
        return None


class EagerGraphCache(GraphCache):
    """Captures nothing: every key runs eagerly at the batch size asked for."""

    def __init__(self, config: Any = None) -> None:
        self.config = config

    def pick(self, batch_size: int, num_draft_tokens: int, sampling_path: SamplingPath,
             all_greedy: bool, *, agreed: bool = True) -> tuple[GraphKey, bool]:
        return GraphKey(batch_size, num_draft_tokens, sampling_path, all_greedy), False

    def keys_to_capture(self, max_batch_size: int, num_draft_tokens: int,
                        variants: Iterable[tuple[SamplingPath, bool]]) -> list[GraphKey]:
        return []

    def capture(self, key: GraphKey, step: Step, example: Tensors) -> None:
        raise RuntimeError("EagerGraphCache captures nothing")

    def has(self, key: GraphKey) -> bool:
        return False

    def replay(self, key: GraphKey, inputs: Tensors | None) -> Tensors:
        raise RuntimeError(f"no captured graph for {key}")


def captured_inputs(cache: GraphCache, key: GraphKey) -> Tensors | None:
    """``key``'s static inputs where ``cache`` captured it and shows them (the optional
    ``static_inputs``), to be written in place; else None."""
    statics = getattr(cache, "static_inputs", None)
    return statics(key) if statics is not None and cache.has(key) else None


def bucket_for(batch_size: int, buckets: Iterable[int]) -> int | None:
    """The smallest bucket that holds ``batch_size``, or None when none does."""
    return next((b for b in sorted(buckets) if b >= batch_size), None)
