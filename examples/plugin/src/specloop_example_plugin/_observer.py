"""An iteration observer: how many drafts each VERIFY row accepted, as a histogram."""

from __future__ import annotations

from specloop.engine import EngineConfig, IterationObserver, IterationState, TransitionEvent


class AcceptanceObserver(IterationObserver):
    """Called on the event loop after every state of every iteration; keeps counts only
    (an observer must be cheap; an exception would be logged and ignored)."""

    def __init__(self, config: EngineConfig) -> None:
        k = config.speculative.num_draft_tokens if config.speculative.enabled else 0
        self.histogram = [0] * (k + 1)   # histogram[n]: rows that accepted n drafts
        self.iterations: set[int] = set()
        self.verify_iterations = 0

    def on_transition(self, event: TransitionEvent) -> None:
        self.iterations.add(event.iteration)
        if event.state is IterationState.VERIFY and event.accepted is not None:
            self.verify_iterations += 1
            for n in event.accepted:
                self.histogram[n] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted drafts per VERIFY row (EngineStats' definition)."""
        rows = sum(self.histogram)
        return 1.0 + sum(n * c for n, c in enumerate(self.histogram)) / max(rows, 1)

    def __repr__(self) -> str:
        return (f"AcceptanceObserver(verify_iterations={self.verify_iterations}, "
                f"histogram={self.histogram}, "
                f"mean_acceptance_length={self.mean_acceptance_length:.3f})")
