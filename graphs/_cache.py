"""Graph caches: which key an iteration runs under, and whether a captured graph serves it."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ._key import GraphKey, SamplingPath


@runtime_checkable
class GraphCache(Protocol):
    def pick(self, batch_size: int, num_draft_tokens: int,
             sampling_path: SamplingPath) -> GraphKey:
        """The key to run under; ``batch_size`` must already be agreed by the group."""
        ...


class EagerGraphCache:
    """Captures nothing: every key runs eagerly at the batch size asked for."""

    def __init__(self, config: Any = None) -> None:
        self.config = config

    def pick(self, batch_size: int, num_draft_tokens: int,
             sampling_path: SamplingPath) -> GraphKey:
        return GraphKey(batch_size, num_draft_tokens, sampling_path, captured=False)


def bucket_for(batch_size: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds ``batch_size``, or None when none does."""
    return next((b for b in sorted(buckets) if b >= batch_size), None)
