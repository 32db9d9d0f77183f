"""The Communicator protocol and the argument checks every implementation shares."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import torch

ReduceOp = Literal["sum", "max", "min"]
REDUCE_OPS: tuple[str, ...] = ("sum", "max", "min")


@runtime_checkable
class Communicator(Protocol):
    """A group of ranks that enter the same collectives in the same order.

    The collectives (`all_gather` .. `subgroup`): all ranks of the group call them, in
    the same order, with the same shapes and dtypes (see DESIGN.md, "Collective
    symmetry"). Results are fresh objects, never aliases of another rank's data.

    Subclass it to inherit the defaults of `timeout_s` (None: waits are not bounded),
    `bounded` (returns self: cannot bound; the engine then logs `communicator_unbounded`),
    `close` (does nothing), `host_tensors` (False) and `all_gather_bytes` (through
    `all_gather_object`), or implement every member. The factory named in config is
    called as `factory(config)`.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def timeout_s(self) -> float | None:
        """The longest one collective waits for the other ranks; None: no bound."""
        return None

    def bounded(self, seconds: float) -> Communicator:
        """A view whose waits are capped at `seconds`, or a ValueError when that cannot be
        done; the engine applies `parallel.collective_timeout_s` through it. Not a
        collective. Default: self (unbounded, `timeout_s` stays None)."""
        return self

    def close(self) -> None:
        """Release what the communicator holds (process groups); called once, by the
        engine that built it, when it stops. Not a collective. Default: nothing."""
        return None

    @property
    def host_tensors(self) -> bool:
        """True when `all_gather` takes host (CPU) tensors whatever the group's device
        (gathering them on the host): the engine then keeps SCHEDULE's exchange on the
        host. Default False (the exchange's tensors go to the device)."""
        return False

    async def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[*shape] on every rank -> [world_size, *shape], row r from rank r."""
        ...

    async def all_gather_object(self, obj: Any) -> list[Any]:
        """Any picklable object -> list of every rank's object, in rank order."""
        ...

    async def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, in rank order; all ranks pass the same length. SCHEDULE's
        exchange, once per iteration in a group: an implementation for speed runs no
        torch op on the way (each releases the GIL and must take it back from the
        rank's busy compute thread; `torch_distributed` goes through shared memory).
        Default: `all_gather_object`, the lengths checked."""
        gathered: list[bytes] = await self.all_gather_object(bytes(data))
        check_lengths([len(d) for d in gathered])
        return gathered

    async def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Elementwise reduction over ranks; returns a new tensor, the input is untouched."""
        ...

    async def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s object on every rank (other ranks' `obj` is ignored)."""
        ...

    async def barrier(self) -> None: ...

    async def subgroup(self, ranks: Sequence[int], name: str) -> Communicator:
        """The sub-communicator of `ranks` (global ranks, this rank among them).

        Every member calls it with the same arguments; non-members do not call it.
        Inside, ranks are renumbered 0..len(ranks)-1 in the order of `ranks` sorted.
        """
        ...


def check_lengths(lengths: Sequence[int]) -> None:
    """`all_gather_bytes`' rule, checked where the lengths are seen: one length."""
    if len(set(lengths)) > 1:
        raise ValueError(f"all_gather_bytes: the ranks passed {list(lengths)} bytes; every "
                         "rank must pass the same length")


def check_tensor(tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def check_reduce_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op must be one of {REDUCE_OPS}, got {op!r}")
    return op


def check_src(src: int, world_size: int) -> int:
    if not isinstance(src, int) or not 0 <= src < world_size:
        raise ValueError(f"src must be a rank in [0, {world_size}), got {src!r}")
    return src


def check_subgroup(ranks: Sequence[int], name: str, members: Sequence[int], me: int) -> tuple[int, ...]:
    """Validate a subgroup request; return its global ranks sorted.

    `members` are the parent's global ranks and `me` this rank's global rank.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"subgroup name must be a non-empty string, got {name!r}")
    chosen = tuple(sorted(ranks))
    if not chosen or len(set(chosen)) != len(chosen):
        raise ValueError(f"subgroup {name!r}: ranks must be non-empty and distinct, got {list(ranks)}")
    outside = [r for r in chosen if r not in members]
    if outside:
        raise ValueError(f"subgroup {name!r}: ranks {outside} are not in the parent group {list(members)}")
    if me not in chosen:
        raise ValueError(
            f"subgroup {name!r}: rank {me} is not a member of {list(chosen)}; only members call subgroup()"
        )
    return chosen
