"""The graph path on CPU: a cache that 'captures' a step by keeping the function and
'replays' it on the static inputs runs everything CUDA graphs run (padding rows, static
shapes, kv_len = max_seq_len, variant templates, draft graphs) without a GPU."""

import anyio
import pytest

from specloop.engine import AsyncEngine, EngineConfig
from specloop.graphs import CudaGraphCache, GraphKey
from specloop.graphs._cache import check_feeds_itself, inputs_written
from specloop.samplers import SamplingParams

from ..engine.conftest import PROMPTS, make_config


class StepReplayCache(CudaGraphCache):
    def capture(self, key: GraphKey, step, example) -> None:
        if self.sealed:
            raise RuntimeError("capture after warmup")
        self._graphs[key] = _Kept(step, {n: t.clone() for n, t in example.items()})

    def replay(self, key, inputs):
        kept = self._graphs[key]
        if inputs is None:      # as CUDA graphs: the inputs the step wrote last time
            check_feeds_itself(key, inputs_written(kept.step))
        else:
            for name, static in kept.inputs.items():
                static.copy_(inputs[name])
        kept.replays += 1
        return kept.step(kept.inputs)

    def feeds_itself(self, key):
        return bool(inputs_written(self._graphs[key].step))


class _Kept:
    def __init__(self, step, inputs):
        self.step, self.inputs, self.replays = step, inputs, 0


def config(tiny_dir, graphs, **kw):
    data = make_config(tiny_dir, max_batch_size=8, **kw).to_dict()
    data["components"]["graph_cache"] = ("tests.graphs.test_static_steps:StepReplayCache"
                                         if graphs else "eager")
    data["graphs"] = {"batch_buckets": [1, 2, 4, 8]}
    return EngineConfig.from_dict(data)


def requests():
    out = []
    for i, prompt in enumerate(PROMPTS * 2):
        params = (SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=16,
                                 ignore_eos=True) if i % 2 else
                  SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        out.append((prompt, params))
    return out


async def outputs_of(engine, reqs):
    """Every request at once, each through its own ``generate``: its token ids, in order."""
    outs = {}

    async def one(i, prompt, params):
        outs[i] = [t async for o in engine.generate(prompt, params) for t in o.token_ids]

    async with anyio.create_task_group() as tg:
        for i, (prompt, params) in enumerate(reqs):
            tg.start_soon(one, i, prompt, params)
    return [outs[i] for i in range(len(reqs))]


async def run(cfg, loaded, reqs):
    async with AsyncEngine(cfg, model=loaded) as engine:
        outs = await outputs_of(engine, reqs)
        counts = engine.worker.graph_cache.replay_counts() if hasattr(
            engine.worker.graph_cache, "replay_counts") else {}
    return outs, counts


@pytest.mark.parametrize("spec", [
    {"method": "none"},
    {"method": "ngram", "k": 3, "rejection": True},
    {"method": "mtp_eagle", "k": 3, "rejection": True},
    {"method": "mtp_eagle", "k": 2},
    {"method": "eagle3", "k": 3, "rejection": True},
    {"method": "early_exit", "k": 3, "rejection": True},
    # Slow: the strict path's graphs are mtp_eagle K=2's case in the fast subset, and these
    # drafters' draft graphs their K=3 cases (and tests/graphs/test_drafter_paths.py).
    pytest.param({"method": "early_exit", "k": 2}, marks=pytest.mark.slow),
    {"method": "draft_model", "k": 3, "rejection": True},
    pytest.param({"method": "draft_model", "k": 2}, marks=pytest.mark.slow),
])
async def test_static_steps_equal_eager(tiny_dir, tiny_draft_dir, tiny_loaded, spec):
    spec = dict(spec)
    if spec["method"] == "draft_model":
        spec["draft_model"] = tiny_draft_dir
    reqs = requests()
    eager, _ = await run(config(tiny_dir, False, **spec), tiny_loaded, reqs)
    replayed, counts = await run(config(tiny_dir, True, **spec), tiny_loaded, reqs)
    assert replayed == eager
    ran = {k for k, n in counts.items() if n}
    assert any(k.stage == "verify" for k in ran)
    if spec["method"] != "ngram" and spec["method"] != "none":
        assert any(k.stage == "draft" for k in ran)
