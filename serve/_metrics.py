"""Prometheus metrics named like vLLM's, fed by the engine's iteration observer and by the
server's view of each request. One registry per server (no global state)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

from specloop.engine import IterationState, TransitionEvent

if TYPE_CHECKING:
    from specloop.engine import EngineStats

P = "specloop:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                   0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
STATE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025,
                 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServeMetrics:
    """``on_transition`` is an IterationObserver (rank 0's iterations); the ``request_*``
    methods are called by the request handlers."""

    def __init__(self, *, num_draft_tokens: int,
                 free_slots: Callable[[], float] | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.k = num_draft_tokens
        self.num_drafts = Counter(
            P + "spec_decode_num_drafts", "Verified rows that carried draft tokens", registry=r)
        self.num_draft_tokens = Counter(
            P + "spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.num_accepted = Counter(
            P + "spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter(
            P + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = first)", ["position"],
            registry=r)
        self.iterations_per_k = Counter(
            P + "spec_decode_iterations_per_k",
            "Iterations by the number of tokens drafted (adaptive K varies it)", ["k"],
            registry=r)
        self.requests = Counter(P + "request_success", "Finished requests by reason",
                                ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens",
                                         registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds",
                             "Time between output tokens (per token)",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.state_duration = Histogram(
            P + "iteration_state_duration_seconds", "Time in each iteration state",
            ["state"], buckets=STATE_BUCKETS, registry=r)
        self.batch_size = Histogram(P + "iteration_batch_size", "Requests per iteration",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.sampling_path = Counter(P + "iterations_by_sampling_path",
                                     "Iterations by the sampling path taken", ["path"],
                                     registry=r)
        self.overlapped = Counter(
            P + "iterations_overlapped",
            "Iterations whose step was queued ahead or chained behind the last one (host "
            "and GPU overlapped), by whether it was", ["overlapped"], registry=r)
        self.kernels_compiled = Counter(
            P + "kernels_compiled_while_serving",
            "Triton kernels compiled after warm-up (each a stall of every request in "
            "flight; EngineStats.kernels_compiled_while_serving)", registry=r)
        self._compiled_seen = 0
        self.running = Gauge(P + "num_requests_running", "Requests in flight", registry=r)
        self.slots_free = Gauge(P + "kv_slots_free", "Free KV-cache slots (rank 0)",
                                registry=r)
        if free_slots is not None:
            self.slots_free.set_function(free_slots)
        for position in range(num_draft_tokens):
            self.accepted_per_pos.labels(position=str(position))   # show zeros too

    # the observer -----------------------------------------------------------------------
    def on_transition(self, event: TransitionEvent) -> None:
        self.state_duration.labels(state=event.state.value).observe(event.duration_us / 1e6)
        if event.state is IterationState.PICK_GRAPH_KEY and event.sampling_path:
            self.sampling_path.labels(path=event.sampling_path).inc()
            self.batch_size.observe(event.batch_size)
        if event.overlapped is not None:
            self.overlapped.labels(overlapped=str(event.overlapped).lower()).inc()
        if event.state is IterationState.VERIFY and event.accepted is not None and self.k:
            self.iterations_per_k.labels(k=str(event.num_draft_tokens)).inc()
            if event.accepted and event.num_draft_tokens:
                self._record_acceptance(event.accepted, event.num_draft_tokens)

    def _record_acceptance(self, accepted: Sequence[int], k: int) -> None:
        rows = len(accepted)
        self.num_drafts.inc(rows)
        self.num_draft_tokens.inc(rows * k)
        self.num_accepted.inc(sum(accepted))
        for position in range(k):
            hits = sum(1 for n in accepted if n > position)
            if hits:
                self.accepted_per_pos.labels(position=str(position)).inc(hits)

    # the engine's counters (read at each scrape) -------------------------------------------
    def from_stats(self, stats: EngineStats) -> None:
        """The counters that live in the engine's stats, brought up to ``stats``."""
        compiled = stats.kernels_compiled_while_serving
        if compiled > self._compiled_seen:
            self.kernels_compiled.inc(compiled - self._compiled_seen)
            self._compiled_seen = compiled

    # requests ---------------------------------------------------------------------------
    def request_started(self, prompt_tokens: int) -> None:
        self.running.inc()
        self.prompt_tokens.inc(prompt_tokens)

    def request_tokens(self, count: int, gap_s: float, first: bool) -> None:
        if count <= 0:
            return
        self.generation_tokens.inc(count)
        if first:       # tokens that come with the first one have no latency of their own
            self.ttft.observe(gap_s)
            return
        for _ in range(count):          # one iteration's tokens share its gap
            self.itl.observe(gap_s / count)

    def request_finished(self, reason: str, latency_s: float) -> None:
        self.running.dec()
        self.requests.labels(finished_reason=reason).inc()
        self.e2e.observe(latency_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
