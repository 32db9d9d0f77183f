"""Continuous batching on one rank: a waiting queue, the running batch, and KV slots."""

from __future__ import annotations

from collections import deque

import structlog

from ._request import FinishReason, Request

log = structlog.get_logger(__name__)


class SlotAllocator:
    """KV-cache slots; slot ``num_slots`` is the cache's scratch slot and never handed out."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"slot {slot} freed twice or never allocated")
        self._free.append(slot)


class Scheduler:
    """Admits waiting requests between iterations, up to the batch (its slots and
    ``max_running``) and the prefill budget."""

    def __init__(self, max_batch_size: int, max_num_tokens: int) -> None:
        self.max_num_tokens = max_num_tokens
        self.slots = SlotAllocator(max_batch_size)
        # The running batch's cap (``FrontEnd.set_max_running``, at most the slots):
        # lowering it ends no running request, it only stops admissions until the batch
        # is below it.
        self.max_running = max_batch_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests admitted so far: the only way into the batch (adaptive K's tail tells a
        # join by it, engine/_adaptive_tail.py).
        self.admitted = 0

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def admit(self) -> list[Request]:
        """Move waiting requests into the batch; returns the ones that need a prefill.

        The first admitted prompt may exceed max_num_tokens (it is prefilled in chunks);
        later ones wait for the next iteration rather than overrun the budget.
        """
        admitted: list[Request] = []
        budget = self.max_num_tokens
        while self.waiting and self.slots.num_free and len(self.running) < self.max_running:
            prompt_tokens = len(self.waiting[0].token_ids) - 1
            if admitted and prompt_tokens > budget:
                break
            request = self.waiting.popleft()
            request.slot = self.slots.allocate()
            budget -= prompt_tokens
            admitted.append(request)
            self.running.append(request)
        self.admitted += len(admitted)
        return admitted

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Take a request out of the batch (or the queue) and free its slot."""
        request.finish_reason = request.finish_reason or reason
        if request in self.running:
            self.running.remove(request)
            self.slots.free(request.batch_slot)
            request.slot = None
        elif request in self.waiting:
            self.waiting.remove(request)

    def find(self, request_id: str) -> Request | None:
        return next((r for r in [*self.running, *self.waiting]
                     if r.request_id == request_id), None)
