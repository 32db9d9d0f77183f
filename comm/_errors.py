"""Errors raised instead of hanging when ranks disagree or go missing."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from ._call import CollectiveCall


class CommError(RuntimeError):
    """Base of every error the communicators raise on purpose."""


class CollectiveMismatchError(CommError):
    """Ranks of one group entered different collectives at the same sequence number.

    `calls` maps each global rank that arrived to what it called; `missing` lists the
    ranks of the group that had not arrived when the difference was seen.
    """

    def __init__(self, calls: Mapping[int, CollectiveCall], missing: Sequence[int] = ()):
        self.calls = dict(sorted(calls.items()))
        self.missing = tuple(missing)
        parts = [f"rank {r} called {c.describe()}" for r, c in self.calls.items()]
        if self.missing:
            parts.append(f"rank(s) {_ranks(self.missing)} had not arrived")
        super().__init__("collective mismatch: " + "; ".join(parts))


class CollectiveTimeoutError(CommError, TimeoutError):
    """Some ranks of a group never entered a collective the others are waiting in.

    `missing` lists their global ranks (empty when the backend cannot tell which);
    `call` is what the waiting rank called; `reason` says how we know.
    """

    def __init__(self, call: CollectiveCall, missing: Sequence[int], reason: str):
        self.call = call
        self.missing = tuple(missing)
        self.reason = reason
        who = f"rank(s) {_ranks(self.missing)}" if self.missing else "some rank"
        super().__init__(f"{who} did not enter {call.describe()}: {reason}")


class InjectedFault(CommError):
    """Default error of `LocalGroup.fail`: a rank that dies on purpose in a test."""


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)
