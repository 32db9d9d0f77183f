"""Run by tests/plugin/test_plugin.py with a fresh venv's python (specloop and the example
plugin installed as wheels): greedy generation from TOML configs that name the plugin's
drafter and observer; prints what the test checks as JSON. Imports nothing of tests/.

    python run_plugin.py single CONFIG.toml [CONFIG.toml ...]
    python run_plugin.py adp2 CONFIG.toml           # 2 LocalGroup ranks, ADP
    python run_plugin.py all SINGLE.toml [...] ADP2.toml
        # one process for the lot: {"registry": where specloop and the plugin were
        # imported from and what the registry lists, "single": [...], "adp2": [...]}

Also the import targets of two test components: ``run_plugin:KeepStepCache`` (a graph cache
that "captures" a step by keeping the function and "replays" it on the static inputs, so
the graph path runs on CPU) and ``run_plugin:NoGraphSuccessor`` (the plugin's drafter
saying it cannot run in graphs).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anyio

from specloop.comm import LocalGroup
from specloop.engine import AsyncEngine, EngineConfig
from specloop.graphs import CudaGraphCache, GraphKey, Step, Tensors
from specloop.samplers import SamplingParams
from specloop_example_plugin import SuccessorDrafter

PROMPTS = [[5, 17, 99, 3, 42, 5, 17, 99], [200, 201, 202, 203, 200, 201, 202], [7],
           [11, 12, 13, 14, 11, 12, 13, 14, 11], [300, 5, 300, 5, 300]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


class KeepStepCache(CudaGraphCache):
    def capture(self, key: GraphKey, step: Step, example: Tensors) -> None:
        if self.sealed:
            raise RuntimeError("capture after warmup")
        self._graphs[key] = _Kept(step, {n: t.clone() for n, t in example.items()})

    def replay(self, key: GraphKey, inputs: Tensors) -> Tensors:
        kept = self._graphs[key]
        for name, static in kept.inputs.items():
            static.copy_(inputs[name])
        kept.replays += 1
        return kept.step(kept.inputs)


class _Kept:
    def __init__(self, step: Step, inputs: Tensors) -> None:
        self.step, self.inputs, self.replays = step, inputs, 0


class NoGraphSuccessor(SuccessorDrafter):
    def can_graph(self, advanced: bool) -> bool:
        return False


def report(engine: AsyncEngine) -> dict[str, Any]:
    worker = engine.worker
    cache = worker.graph_cache
    counts = cache.replay_counts() if isinstance(cache, CudaGraphCache) else {}
    return {
        "drafter": None if worker.drafter is None else
        f"{type(worker.drafter).__module__}.{type(worker.drafter).__name__}",
        "observers": [{"type": type(o).__name__, "iterations": len(o.iterations),
                       "verify_iterations": o.verify_iterations, "histogram": o.histogram}
                      for o in engine.observers],
        "stats": {"num_iterations": worker.stats.num_iterations,
                  "num_verify_rows": worker.stats.num_verify_rows,
                  "num_accepted_tokens": worker.stats.num_accepted_tokens},
        "graphs": {f"{k.stage}/{k.batch_size}/{k.sampling_path.value}/{k.all_greedy}": n
                   for k, n in counts.items()},
    }


async def generate(engine: AsyncEngine) -> list[list[int]]:
    outs: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        outs[i] = [t async for o in engine.generate(PROMPTS[i], GREEDY) for t in o.token_ids]

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    return [outs[i] for i in range(len(PROMPTS))]


async def single(path: str) -> dict[str, Any]:
    async with AsyncEngine(EngineConfig.from_toml(path)) as engine:
        tokens = await generate(engine)
    return {"config": path, "tokens": tokens, "ranks": [report(engine)]}


async def adp2(path: str) -> dict[str, Any]:
    config = EngineConfig.from_toml(path)
    group = LocalGroup(2, timeout=60.0)
    tokens: list[list[int]] = []
    reports: dict[int, dict[str, Any]] = {}

    async def rank(comm: Any) -> None:
        async with AsyncEngine(config, communicator=comm) as engine:
            if comm.rank == 0:
                tokens.extend(await generate(engine))
            else:
                await engine.wait_closed()
        reports[comm.rank] = report(engine)

    await group.run(rank)
    return {"config": path, "tokens": tokens, "ranks": [reports[0], reports[1]]}


def registry() -> dict[str, Any]:
    import specloop.engine as engine
    import specloop_example_plugin as plugin

    return {"engine_file": engine.__file__, "plugin_file": plugin.__file__,
            "drafters": engine.known_components("drafter"),
            "observers": engine.known_components("observer")}


async def main(mode: str, paths: list[str]) -> None:
    if mode == "all":
        print(json.dumps({"registry": registry(),
                          "single": [await single(p) for p in paths[:-1]],
                          "adp2": [await adp2(paths[-1])]}))
        return
    run = single if mode == "single" else adp2
    print(json.dumps([await run(p) for p in paths]))


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2:])
