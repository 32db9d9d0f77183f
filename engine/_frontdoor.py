"""Rank 0's front door: request routing and the one SCHEDULE exchange of a multi-rank group."""

from __future__ import annotations

from typing import Sequence

import attrs

from ._request import NewRequest, RequestOutput


@attrs.frozen
class FrontDoorMessage:
    """Rank 0's part of the SCHEDULE exchange: new requests, each with the rank that serves
    it, the request ids to cancel, and whether the group shuts down after this iteration."""

    assignments: tuple[tuple[int, NewRequest], ...] = ()
    cancels: tuple[str, ...] = ()
    shutdown: bool = False


# The message of an iteration with no news (most of them): one shared instance, compared
# against and returned without building one.
NO_MESSAGE = FrontDoorMessage()


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
