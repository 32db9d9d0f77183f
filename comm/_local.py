"""N ranks in one process on one event loop, every collective checked for symmetry."""
from __future__ import annotations

import pickle
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import structlog
import torch

from ._call import CollectiveCall
from ._errors import InjectedFault
from ._protocol import Communicator, ReduceOp, check_reduce_op, check_src, check_subgroup, check_tensor
from ._rendezvous import Rendezvous

log = structlog.get_logger(__name__)

_REDUCE = {"sum": lambda t: t.sum(0), "max": lambda t: t.amax(0), "min": lambda t: t.amin(0)}


class LocalGroup:
    """`world_size` in-process ranks for tests; `communicator(rank)` is rank's view.

    A collective completes when every rank of its group arrived with the same (sequence
    number, op, shape, dtype, group, arguments); a difference raises
    CollectiveMismatchError on every rank involved, at once. A rank that does not arrive
    within `timeout` seconds, or that is known to be gone, raises CollectiveTimeoutError
    on the waiting ranks, naming it.
    """

    def __init__(self, world_size: int, *, timeout: float = 5.0) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.world_size = world_size
        self.timeout = timeout
        self._gone: dict[int, str] = {}
        self._faults: dict[int, BaseException | None] = {}  # None = stall
        self._groups: dict[tuple[str, tuple[int, ...]], Rendezvous] = {}

    def communicator(self, rank: int) -> LocalCommunicator:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        return LocalCommunicator(self, self._rendezvous("world", tuple(range(self.world_size))), rank)

    def fail(self, rank: int, exc: BaseException | None = None) -> None:
        """Make `rank`'s next collective raise `exc` (default InjectedFault); the rank is
        then gone, and ranks waiting for it are told so at once."""
        self._faults[rank] = exc if exc is not None else InjectedFault(f"rank {rank}: injected failure")

    def stall(self, rank: int) -> None:
        """Make `rank`'s next collective never arrive; it returns only with the error
        the others end with (their timeout), so a task group can finish."""
        self._faults[rank] = None

    def mark_gone(self, rank: int, reason: str) -> None:
        """Declare that `rank` enters no more collectives; waiting ranks fail at once."""
        self._gone[rank] = reason
        for rendezvous in self._groups.values():
            if rank in rendezvous.members:
                rendezvous.rank_gone()

    async def run(self, fn: Callable[..., Awaitable[Any]], *args: Any, return_exceptions: bool = False) -> list[Any]:
        """Run `fn(communicator(r), *args)` for every rank concurrently; results by rank.

        A rank whose function returns or raises is marked gone, so ranks still waiting
        for it fail fast instead of timing out. With `return_exceptions` each rank's
        exception takes its place in the list; otherwise they are raised as a group.
        """
        self._gone.clear()
        results: list[Any] = [None] * self.world_size
        async with anyio.create_task_group() as tg:
            for rank in range(self.world_size):
                tg.start_soon(self._run_rank, rank, fn, args, results)
        errors = [r for r in results if isinstance(r, Exception)]
        if errors and not return_exceptions:
            raise ExceptionGroup(f"{len(errors)} of {self.world_size} ranks failed", errors)
        return results

    async def _run_rank(self, rank: int, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], results: list[Any]) -> None:
        try:
            results[rank] = await fn(self.communicator(rank), *args)
            self.mark_gone(rank, "returned from its function")
        except Exception as exc:  # collected per rank; cancellation still propagates
            results[rank] = exc
            log.info("local_rank_raised", rank=rank, error=repr(exc))
            self.mark_gone(rank, f"raised {exc!r}")

    def _rendezvous(self, name: str, members: tuple[int, ...]) -> Rendezvous:
        key = (name, members)
        if key not in self._groups:
            self._groups[key] = Rendezvous(name, members, self.timeout, self._gone)
        return self._groups[key]

    def _take_fault(self, rank: int) -> tuple[bool, BaseException | None]:
        if rank not in self._faults:
            return False, None
        return True, self._faults.pop(rank)


class LocalCommunicator(Communicator):
    """One rank's view of one group of a LocalGroup."""

    def __init__(self, group: LocalGroup, rendezvous: Rendezvous, global_rank: int,
                 timeout: float | None = None) -> None:
        self._group = group
        self._rv = rendezvous
        self._me = global_rank
        self._timeout = group.timeout if timeout is None else timeout

    @property
    def timeout_s(self) -> float:
        """The longest this rank waits in one collective for the others."""
        return self._timeout

    def bounded(self, seconds: float) -> LocalCommunicator:
        """This rank's view with every wait capped at `seconds` (a shorter own timeout stays)."""
        return LocalCommunicator(self._group, self._rv, self._me, min(self._timeout, seconds))

    @property
    def rank(self) -> int:
        return self._rv.members.index(self._me)

    @property
    def world_size(self) -> int:
        return len(self._rv.members)

    @property
    def name(self) -> str:
        return self._rv.name

    async def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        check_tensor(tensor)
        call = self._call("all_gather", tensor)
        stacked = await self._enter(call, tensor.detach(), torch.stack)
        return stacked.clone()  # each rank its own copy

    async def all_gather_object(self, obj: Any) -> list[Any]:
        call = self._call("all_gather_object")
        blobs = await self._enter(call, pickle.dumps(obj), list)
        return [pickle.loads(b) for b in blobs]

    async def all_gather_bytes(self, data: bytes) -> list[bytes]:
        # The length is part of the call: ranks passing different lengths mismatch.
        call = self._call("all_gather_bytes", detail=f"bytes={len(data)}")
        rows: list[bytes] = await self._enter(call, bytes(data), list)
        return rows

    async def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        check_tensor(tensor)
        check_reduce_op(op)
        call = self._call("all_reduce", tensor, f"op={op}")
        # Reduced once in rank order, so every rank gets bit-identical values.
        reduced = await self._enter(call, tensor.detach(), lambda ts: _REDUCE[op](torch.stack(ts)).to(ts[0].dtype))
        return reduced.clone()

    async def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        check_src(src, self.world_size)
        call = self._call("broadcast_object", detail=f"src={src}")
        blob = await self._enter(call, pickle.dumps(obj) if self.rank == src else None, lambda bs: bs[src])
        return pickle.loads(blob)

    async def barrier(self) -> None:
        await self._enter(self._call("barrier"), None, lambda _: None)

    async def subgroup(self, ranks: Sequence[int], name: str) -> LocalCommunicator:
        members = check_subgroup(ranks, name, self._rv.members, self._me)
        return LocalCommunicator(self._group, self._group._rendezvous(name, members), self._me,
                                 self._timeout)

    def _call(self, op: str, tensor: torch.Tensor | None = None, detail: str | None = None) -> CollectiveCall:
        seq = self._rv.next_seq(self._me)
        if tensor is None:
            return CollectiveCall(op, self.name, seq, detail=detail)
        return CollectiveCall.for_tensor(op, self.name, seq, tensor, detail)

    async def _enter(self, call: CollectiveCall, payload: Any, combine: Callable[[list[Any]], Any]) -> Any:
        faulted, exc = self._group._take_fault(self._me)
        if faulted and exc is None:
            log.info("local_rank_stalled", rank=self._me, call=call.describe())
            return await self._rv.stall(self._me, call)
        if exc is not None:
            self._group.mark_gone(self._me, f"died: {exc!r}")
            raise exc
        return await self._rv.enter(self._me, call, payload, combine, self._timeout)
