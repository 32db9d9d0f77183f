"""Rank 0's front door: request routing and the one SCHEDULE exchange of a multi-rank group."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Protocol, Sequence

import attrs

from ._request import FinishReason, NewRequest, RequestOutput

if TYPE_CHECKING:
    from ._wire import OutputRow


@attrs.frozen
class FrontDoorMessage:
    """Rank 0's part of the SCHEDULE exchange: new requests, each with the rank that serves
    it, the request ids to cancel, whether the group shuts down after this iteration, and
    the running batch's cap a rank from this SCHEDULE on (``FrontEnd.set_max_running``;
    None: unchanged)."""

    assignments: tuple[tuple[int, NewRequest], ...] = ()
    cancels: tuple[str, ...] = ()
    shutdown: bool = False
    max_running: int | None = None


# The message of an iteration with no news (most of them): one shared instance, compared
# against and returned without building one.
NO_MESSAGE = FrontDoorMessage()


def assign_to_rank0(new: Sequence[NewRequest]) -> tuple[tuple[int, NewRequest], ...]:
    """One rank (or one core behind a pipe): every request to rank 0."""
    return tuple((0, request) for request in new)


def assign_least_loaded(new: Sequence[NewRequest], loads: Sequence[int]
                        ) -> tuple[tuple[int, NewRequest], ...]:
    """Deterministic: each request goes to the rank with the fewest requests, lowest rank
    on ties; ``loads`` are the per-rank request counts agreed in the last SYNC."""
    loads = list(loads)
    out = []
    for request in new:
        rank = min(range(len(loads)), key=lambda r: (loads[r], r))
        loads[rank] += 1
        out.append((rank, request))
    return tuple(out)


@attrs.frozen
class RankReport:
    """A serving rank's part of the exchange: the outputs it produced since the last one."""

    outputs: tuple[RequestOutput, ...] = ()


class FrontDoorPort(Protocol):
    """The front door as the engine's loop sees it (rank 0): ``FrontDoor`` in the engine's
    process, ``PipeFrontDoor`` in a ``ProcessEngine``'s core (the real one is in the
    parent, across a pipe)."""

    closing: bool

    @property
    def has_news(self) -> bool:
        """Requests or cancels the next SCHEDULE takes."""

    async def wait_for_work(self, timeout: float | None) -> None:
        """Until there is news (or ``timeout`` seconds passed)."""

    def take_message(self, assign: Callable[[list[NewRequest]],
                                            tuple[tuple[int, NewRequest], ...]]
                     ) -> FrontDoorMessage:
        """The news since the last call (``NO_MESSAGE``: none)."""

    def deliver(self, outputs: Iterable[RequestOutput]) -> None:
        """Outputs towards their consumers, in the order produced."""

    @property
    def deliver_rows(self) -> Callable[[list[OutputRow]], None] | None:
        """``deliver`` for outputs built as ``_wire.OutputRow`` tuples, where the front
        door takes them so (a ``ProcessEngine`` core's pipe: RESCAN then builds no
        ``RequestOutput``); None: ``deliver`` only."""

    def deliver_blocks(self, blocks: Sequence[bytes], k: int) -> None:
        """Other ranks' outputs as the exchange carried them: one int64 block each
        (``_wire.encode_rows``' layout, handles for request ids), in the order produced.
        Decoded where the request ids are known: here (``FrontDoor``), or in a
        ``ProcessEngine``'s parent (``PipeFrontDoor`` forwards the bytes)."""

    def close(self) -> None:
        """The engine is leaving: no new requests."""

    def close_all(self, reason: FinishReason, error: str | None = None) -> None:
        """End every live request with a final output of ``reason``."""
