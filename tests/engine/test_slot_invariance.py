"""A request's drafts depend only on the request: not on what its KV slot held before, nor
on which other requests share its batch (issue 14: mtp_eagle with 1-token prompts read the
slot's stale hidden row and shared the scratch slot with batch neighbours).

Deterministic: the drafter's logits and drafted tokens are recorded per seed by a sampler
named through config and compared exactly (tokens) or to 1e-9 (float64 logits)."""

import anyio
import pytest
import torch

from specloop.engine import AsyncEngine
from specloop.samplers import SamplingParams

from . import planted
from .conftest import collect, make_config

ONE_TOKEN = [7]


def params(seed):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)


STEP_REPLAY = "tests.graphs.test_static_steps:StepReplayCache"   # the graph path on CPU


def config_for(tiny_dir, tiny_draft_dir, method, graph_cache="eager"):
    return make_config(tiny_dir, method=method, k=3, rejection=True, max_batch_size=4,
                       draft_model=tiny_draft_dir if method == "draft_model" else None,
                       components={"sampler": "tests.engine.planted:recording_sampler",
                                   "graph_cache": graph_cache},
                       graphs={"batch_buckets": [1, 2, 4]})


async def run_scenario(config, loaded, scenario):
    planted.RECORDERS.clear()
    async with AsyncEngine(config, model=loaded) as engine:
        if scenario == "reuse":
            # A longer request holds slot 0 first; the 1-token request then reuses it.
            await collect(engine, [3, 4, 5, 6, 8, 9], params(2))
            await collect(engine, ONE_TOKEN, params(1))
        elif scenario == "batched":
            async with anyio.create_task_group() as tg:
                tg.start_soon(collect, engine, ONE_TOKEN, params(1))
                tg.start_soon(collect, engine, [8], params(3))
        else:
            await collect(engine, ONE_TOKEN, params(1))
    (recorder,) = planted.RECORDERS
    return recorder


def assert_same(a, b):
    assert [pos for pos, _ in a.verified[1]] == [pos for pos, _ in b.verified[1]]
    assert a.verified[1] == b.verified[1]
    assert len(a.drafts.get(1, [])) == len(b.drafts.get(1, []))
    for (pa, la), (pb, lb) in zip(a.drafts.get(1, []), b.drafts.get(1, [])):
        assert pa == pb
        torch.testing.assert_close(la, lb, atol=1e-9, rtol=0)




@pytest.mark.parametrize("graph_cache", ["eager", STEP_REPLAY])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "early_exit", "mtp_eagle"])
async def test_one_token_prompt_drafts_ignore_slot_history_and_neighbours(
        tiny_dir, tiny_draft_dir, tiny_loaded, method, graph_cache):
    config = config_for(tiny_dir, tiny_draft_dir, method, graph_cache)
    alone = await run_scenario(config, tiny_loaded, "alone")
    reuse = await run_scenario(config, tiny_loaded, "reuse")
    batched = await run_scenario(config, tiny_loaded, "batched")
    assert max(batched.batch_sizes) == 2, "the two 1-token requests never shared a batch"
    assert_same(alone, reuse)
    assert_same(alone, batched)
