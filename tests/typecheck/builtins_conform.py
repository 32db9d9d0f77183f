"""Type-checked by mypy (tests/test_typecheck.py), never run: every built-in component, as
its registered factory builds it, is assignable to its kind's protocol. A built-in that
loses a member its protocol declares (so it would inherit the protocol's bare stub), or
changes one's signature or type, fails the check."""

from __future__ import annotations

from specloop.comm import (CollectiveCounter, Communicator, LocalGroup, SingleRankCommunicator,
                           TorchDistributedCommunicator)
from specloop.engine import EngineConfig, IterationObserver
from specloop.engine._components import (build_communicator, build_drafter, build_graph_cache,
                                         build_sampler, default_sampler, single_communicator,
                                         torch_distributed_communicator)
from specloop.engine._trace import TraceRecorder, TracedCommunicator
from specloop.graphs import CudaGraphCache, EagerGraphCache, GraphCache
from specloop.models.drafters import (DraftModelDrafter, Drafter, DrafterDeps, Eagle3Drafter,
                                      EarlyExitDrafter, MtpEagleDrafter, NgramDrafter)
from specloop.samplers import DefaultSampler, Sampler


def samplers(config: EngineConfig) -> list[Sampler]:
    return [DefaultSampler(), default_sampler(config), build_sampler(config)]


def graph_caches(config: EngineConfig) -> list[GraphCache]:
    return [EagerGraphCache(config), CudaGraphCache(config), build_graph_cache(config)]


def communicators(config: EngineConfig, group: LocalGroup) -> list[Communicator]:
    local = group.communicator(0)
    bounded: Communicator = local.bounded(1.0)
    return [SingleRankCommunicator(), local, bounded, CollectiveCounter(local),
            TracedCommunicator(local, TraceRecorder()), TorchDistributedCommunicator.from_env(),
            single_communicator(config), torch_distributed_communicator(config),
            build_communicator(config)]


def drafters(config: EngineConfig, deps: DrafterDeps) -> list[Drafter | None]:
    return [NgramDrafter(config, deps), DraftModelDrafter(config, deps),
            EarlyExitDrafter(config, deps), MtpEagleDrafter(config, deps),
            Eagle3Drafter(config, deps),
            build_drafter(config, deps)]


def observers() -> list[IterationObserver]:
    return [TraceRecorder()]
