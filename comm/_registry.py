"""Communicator names that config may use, each mapped to a factory."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._protocol import Communicator
from ._single import SingleRankCommunicator
from ._torch_dist import TorchDistributedCommunicator


def _local(**_: Any) -> Communicator:
    raise ValueError(
        "communicator 'local' cannot be built from config: create a LocalGroup(world_size) "
        "and pass group.communicator(rank) to the engine (AsyncEngine(config, communicator=...))"
    )


def communicator_factories() -> dict[str, Callable[..., Communicator]]:
    """A fresh dict per call, so no caller can change what another sees."""
    return {
        "single": SingleRankCommunicator,
        "local": _local,
        "torch_distributed": TorchDistributedCommunicator.from_env,
    }


def create_communicator(name: str, **kwargs: Any) -> Communicator:
    """Build the communicator registered as `name`, passing `kwargs` to its factory."""
    factories = communicator_factories()
    if name not in factories:
        raise ValueError(f"unknown communicator {name!r}; choose one of {sorted(factories)}")
    return factories[name](**kwargs)
