"""A world of one rank: every collective is the identity, with the usual checks."""
from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import torch

from ._protocol import Communicator, ReduceOp, check_reduce_op, check_src, check_subgroup, check_tensor


class SingleRankCommunicator(Communicator):
    """Rank 0 of a world of 1; results are copies, as with more ranks."""

    def __init__(self, name: str = "world") -> None:
        self._name = name

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def name(self) -> str:
        return self._name

    @property
    def timeout_s(self) -> float:
        return 0.0      # nobody to wait for

    def bounded(self, seconds: float) -> SingleRankCommunicator:
        return self

    async def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return check_tensor(tensor).detach().unsqueeze(0).clone()

    async def all_gather_object(self, obj: Any) -> list[Any]:
        return [_copy(obj)]

    async def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        check_reduce_op(op)
        return check_tensor(tensor).detach().clone()

    async def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        check_src(src, 1)
        return _copy(obj)

    async def barrier(self) -> None:
        return None

    async def subgroup(self, ranks: Sequence[int], name: str) -> SingleRankCommunicator:
        check_subgroup(ranks, name, members=(0,), me=0)
        return SingleRankCommunicator(name)


def _copy(obj: Any) -> Any:
    # A pickle round trip, as between processes: unpicklable objects fail here too.
    return pickle.loads(pickle.dumps(obj))
