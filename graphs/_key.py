"""The graph key: what a captured VERIFY graph is specialised on."""

from __future__ import annotations

import enum

import attrs

from specloop.samplers import SpecMetadata


class SamplingPath(str, enum.Enum):
    GREEDY = "greedy"
    ADVANCED = "advanced"

    @classmethod
    def of(cls, spec: SpecMetadata) -> SamplingPath:
        # The one predicate decides; nothing here recomputes it.
        return cls.ADVANCED if spec.wants_advanced_draft_sampling else cls.GREEDY


@attrs.frozen
class GraphKey:
    """Frozen and hashable. ``batch_size`` is the padded batch every rank of the group runs;
    ``all_greedy`` lets an all-greedy batch replay the argmax-only variant."""

    batch_size: int
    num_draft_tokens: int
    sampling_path: SamplingPath
    all_greedy: bool = False
    # "verify" (target forward + sampler), "draft" (a drafter's whole K-step proposal) or
    # "prefill" (the target's forward over prompt rows, engine/_runner.py).
    stage: str = "verify"
    # Prefill: the tokens per row the graph runs (rows padded to it); 0 for the others.
    tokens: int = 0
