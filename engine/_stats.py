"""Speculation counters of one rank."""

from __future__ import annotations

import collections
from typing import Sequence

# Above this many rows an iteration's acceptance is counted on the rows' bytes (at K >= 2):
# on this repository's CPU, K = 3 at 64 rows 1.3 against 1.8 us, at 256 3.6 against 6.7
# (a list's own count compares Python ints; collections.Counter took ~10 us at 256); at
# 32 rows level.
BYTES_ROWS = 48


def accepted_at_least(per_row: Sequence[int], k: int) -> list[int]:
    """Of rows that drafted ``k`` and had ``per_row`` of them accepted (each 0 .. k): per
    draft position j < k, the rows that had draft j+1 accepted (n > j). Their sum is the
    drafts accepted in all; rows that looked at draft j+1 are len(per_row) for j = 0, else
    the entry before. Computed once an iteration, for the stats and adaptive K alike: k
    passes in C, not a Python loop a row."""
    count = bytes(per_row).count if k > 1 and len(per_row) > BYTES_ROWS else per_row.count
    left, at_least = len(per_row), []
    for j in range(k):
        left -= count(j)
        at_least.append(left)
    return at_least


class EngineStats:
    """Speculation counters: AL = 1 + accepted / rows that drafted (vLLM's definition;
    rows of K = 0 iterations, adaptive K's "no drafting", draft nothing and do not count).
    Per draft position j (0-based): ``drafted_per_position[j]`` rows drafted it (K > j),
    ``accepted_per_position[j]`` had it accepted, so acceptance per position stays right
    when K varies (adaptive K); ``iterations_per_k`` counts iterations by the K drafted.
    ``num_overlapped_iterations``: iterations that took the step the last VERIFY queued
    ahead of them (no speculation's step ahead, or DRAFT + VERIFY chained; one GPU rank),
    so the host's work overlapped the GPU's; the rest queued their own after the host's
    (a one-token prompt joining a chained batch, a K switch that cannot chain, a group)."""

    def __init__(self) -> None:
        self.num_iterations = 0
        self.num_verify_rows = 0
        self.num_drafting_rows = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_generated_tokens = 0
        self.num_overlapped_iterations = 0
        # Triton kernels compiled after warm-up (each a stall of every request in flight;
        # engine/_compile_watch.py).
        self.kernels_compiled_while_serving = 0
        self.drafted_per_position: list[int] = []
        self.accepted_per_position: list[int] = []
        self.iterations_per_k: collections.Counter[int] = collections.Counter()

    def record_iteration(self, rows: int, k: int, accepted: int,
                         per_row: Sequence[int] | None = None, *,
                         at_least: Sequence[int] | None = None) -> None:
        """An iteration of ``rows`` rows that drafted ``k`` each and had ``accepted`` in
        all accepted; per position ``per_row`` (each row's accepted) or, where the caller
        has it, ``at_least`` (``accepted_at_least(per_row, k)``)."""
        self.num_iterations += 1
        self.num_verify_rows += rows
        self.num_drafting_rows += rows if k else 0
        self.num_draft_tokens += rows * k
        self.num_accepted_tokens += accepted
        self.iterations_per_k[k] += 1
        if at_least is None and per_row is not None:
            at_least = accepted_at_least(per_row, k)
        if not k or at_least is None:
            return
        grow = k - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        drafted, accepted_at = self.drafted_per_position, self.accepted_per_position
        for j in range(k):
            drafted[j] += rows
            accepted_at[j] += at_least[j]

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / max(1, self.num_drafting_rows)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(1, self.num_draft_tokens)

    @property
    def acceptance_per_position(self) -> list[float]:
        """Of the rows that drafted position j, the share whose draft j was accepted."""
        return [a / max(1, d) for a, d in zip(self.accepted_per_position,
                                              self.drafted_per_position)]

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in vars(self).items())
        return (f"EngineStats({counts}, mean_acceptance_length="
                f"{self.mean_acceptance_length:.3f}, acceptance_rate={self.acceptance_rate:.3f})")
