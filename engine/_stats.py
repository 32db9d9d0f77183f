"""Speculation counters of one rank."""

from __future__ import annotations


class EngineStats:
    """Speculation counters: AL = 1 + accepted / verify rows (vLLM's definition)."""

    def __init__(self) -> None:
        self.num_iterations = 0
        self.num_verify_rows = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_generated_tokens = 0

    def record_iteration(self, rows: int, k: int, accepted: int) -> None:
        self.num_iterations += 1
        self.num_verify_rows += rows
        self.num_draft_tokens += rows * k
        self.num_accepted_tokens += accepted

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / max(1, self.num_verify_rows)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(1, self.num_draft_tokens)

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in vars(self).items())
        return (f"EngineStats({counts}, mean_acceptance_length="
                f"{self.mean_acceptance_length:.3f}, acceptance_rate={self.acceptance_rate:.3f})")
