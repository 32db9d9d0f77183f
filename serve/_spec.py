"""Per-request speculation figures for a response's ``usage`` (vLLM's per-request spec
metrics), from the same VERIFY events that feed the counters, so the two add up."""

from __future__ import annotations

from typing import Any

import attrs

from specloop.engine import IterationState, TransitionEvent


@attrs.define
class RequestSpec:
    k: int
    num_drafts: int = 0
    accepted_per_position: list[int] = attrs.Factory(list)
    num_draft_tokens: int = 0

    def record(self, accepted: int, k: int | None = None) -> None:
        """One VERIFY row: ``k`` drafts (this iteration's K; None: the configured K)."""
        k = self.k if k is None else k
        if not k:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    def usage(self) -> dict[str, Any]:
        accepted = sum(self.accepted_per_position)
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": accepted,
                "mean_acceptance_length": round(1 + accepted / max(self.num_drafts, 1), 4),
                "accepted_per_position": list(self.accepted_per_position)}


class SpecTracker:
    """An IterationObserver that follows the requests ``track`` was called for; under
    torchrun ADP rank 0 sees only its own rows, so other ranks' requests report none (a
    ``ProcessEngine`` group forwards every rank's events: all report)."""

    def __init__(self, num_draft_tokens: int) -> None:
        self.k = num_draft_tokens
        self._open: dict[str, RequestSpec] = {}

    def track(self, request_id: str) -> RequestSpec:
        spec = self._open[request_id] = RequestSpec(self.k, accepted_per_position=[0] * self.k)
        return spec

    def forget(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    def on_transition(self, event: TransitionEvent) -> None:
        if event.state is not IterationState.VERIFY or not event.accepted or not self.k:
            return
        for request_id, accepted in zip(event.request_ids, event.accepted):
            spec = self._open.get(request_id)
            if spec is not None:
                spec.record(accepted, event.num_draft_tokens)
