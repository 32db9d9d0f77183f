"""Driving engines for ``certify`` through the public API only: ``AsyncEngine`` with a
config, on one rank or N in-process ranks (``comm.LocalGroup``), and a request list."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Sequence

import anyio
import attrs

from specloop.comm import Communicator
from specloop.models import LoadedModel
from specloop.samplers import SamplingParams

from ._config import EngineConfig
from ._engine import AsyncEngine


@attrs.frozen
class Job:
    """One request: its prompt (token ids) and params (seeded, or greedy)."""

    prompt: tuple[int, ...]
    params: SamplingParams


def with_ranks(config: EngineConfig, ranks: int) -> EngineConfig:
    """The config on ``ranks`` in-process ranks (attention DP when > 1; LM-head TP kept
    only where it can run)."""
    data = config.to_dict()
    par = data["parallel"]
    par["world_size"] = ranks
    if ranks > 1:
        par["attention_dp"] = True
    else:
        par["attention_dp"] = par["lm_head_tp_in_adp"] = False
    return EngineConfig.from_dict(data)


def evolve(config: EngineConfig, section: str, **fields: Any) -> EngineConfig:
    data = config.to_dict()
    data[section] = {**data[section], **fields}
    return EngineConfig.from_dict(data)


async def on_engine(config: EngineConfig, model: LoadedModel | None,
                    fn: Callable[[AsyncEngine], Awaitable[Any]],
                    *, timeout: float = 60.0) -> Any:
    """``fn(engine)`` on rank 0 of a fresh engine (group) built from ``config``."""
    world = config.parallel.world_size
    if world == 1:
        async with AsyncEngine(config, model=model) as engine:
            return await fn(engine)
    from specloop.comm import LocalGroup  # noqa: PLC0415

    async def rank_main(comm: Communicator) -> Any:
        async with AsyncEngine(config, communicator=comm, model=model) as engine:
            if comm.rank == 0:
                return await fn(engine)
            await engine.wait_closed()
            return None

    return (await LocalGroup(world, timeout=timeout).run(rank_main))[0]


async def generate(engine: AsyncEngine, job: Job) -> tuple[int, ...]:
    tokens: list[int] = []
    async for out in engine.generate(list(job.prompt), job.params):
        tokens.extend(out.token_ids)
    return tuple(tokens)


async def generate_all(engine: AsyncEngine, jobs: Sequence[Job], *, concurrency: int
                       ) -> list[tuple[int, ...]]:
    """Every job, ``concurrency`` in flight at once (so they share batches); in order."""
    results: list[tuple[int, ...]] = [()] * len(jobs)
    limiter = anyio.CapacityLimiter(max(1, concurrency))

    async def one(i: int) -> None:
        async with limiter:
            results[i] = await generate(engine, jobs[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(jobs)):
            tg.start_soon(one, i)
    return results


async def generate_each(engine: AsyncEngine, jobs: Sequence[Job]) -> list[tuple[int, ...]]:
    """One job at a time, in order (each reuses the slot the one before freed)."""
    return [await generate(engine, job) for job in jobs]
