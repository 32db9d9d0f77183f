"""CUDA graphs on a GPU: replayed outputs equal eager ones; the right variant replays."""

import random

import anyio
import pytest
import torch

from specloop.engine import AsyncEngine
from specloop.graphs import SamplingPath
from specloop.models import load_model
from specloop.samplers import SamplingParams

from ..engine.conftest import PROMPTS, make_config
from .test_static_steps import requests, run

pytestmark = pytest.mark.gpu

# A draft tree of depth 3 (speculative.tree): batches verified strictly draft and verify
# it from its own graphs (keys of K = 7; without rejection sampling the sampled rows too),
# batches on the advanced path (rejection sampling and a sampled row) the chain of 3.
TREE = {"speculative": {"tree": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}}


@pytest.fixture(scope="module")
def gpu_loaded(tiny_dir):
    return load_model(tiny_dir, dtype=torch.float64, device="cuda")


def cfg(tiny_dir, graphs, **kw):
    base = make_config(tiny_dir, max_batch_size=8, **kw).to_dict()
    base["model"]["device"] = "cuda"
    base["components"]["graph_cache"] = "cuda" if graphs else "eager"
    base["graphs"] = {"batch_buckets": [1, 2, 4, 8]}
    from specloop.engine import EngineConfig
    return EngineConfig.from_dict(base)


@pytest.mark.parametrize("spec", [
    {"method": "none"},
    {"method": "ngram", "k": 3},
    {"method": "draft_model", "k": 3, "rejection": True},
    {"method": "mtp_eagle", "k": 2, "rejection": True},
    {"method": "eagle3", "k": 3, "rejection": True},
    {"method": "eagle3", "k": 3, **TREE},
    {"method": "eagle3", "k": 3, "rejection": True, **TREE},
])
async def test_replay_equals_eager(tiny_dir, tiny_draft_dir, gpu_loaded, spec):
    spec = dict(spec)
    if spec["method"] == "draft_model":
        spec["draft_model"] = tiny_draft_dir
    reqs = requests()
    eager, _ = await run(cfg(tiny_dir, False, **spec), gpu_loaded, reqs)
    graphed, counts = await run(cfg(tiny_dir, True, **spec), gpu_loaded, reqs)
    assert graphed == eager
    assert sum(counts.values()) > 0


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "k": 3},
    {"method": "eagle3", "k": 3, "rejection": True},
])
async def test_pdl_equals_no_pdl_bf16(tiny_dir, spec, monkeypatch):
    """bf16 (the fused Triton path; greedy and sampled rows, so the greedy verify, the
    rejection and, ngram, the device n-gram kernels too): the engine's tokens with
    Programmatic Dependent Launch equal those without (SPECLOOP_PDL=0's switch), replayed
    graphs and eager alike (bf16 graphs and eager steps may differ: other batch shapes).
    PDL changes when kernels start, not what they compute."""
    from specloop.samplers import _pdl

    if not _pdl.device_supports(torch.cuda.current_device()):
        pytest.skip("PDL needs sm_90+ and Triton's gdc_wait")
    loaded = load_model(tiny_dir, dtype=torch.bfloat16, device="cuda")
    reqs = requests()
    outs = {}
    for pdl in (False, True):
        monkeypatch.setattr(_pdl, "_ENV_ON", pdl)
        for graphs in (False, True):
            outs[pdl, graphs] = await run(cfg(tiny_dir, graphs, **spec), loaded, reqs)
    assert outs[True, False][0] == outs[False, False][0]
    assert outs[True, True][0] == outs[False, True][0]
    assert sum(outs[True, True][1].values()) > 0


async def test_switching_batches_replay_the_right_variant(tiny_dir, gpu_loaded):
    config = cfg(tiny_dir, True, method="ngram", k=2, rejection=True)
    greedy = [(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
              for p in PROMPTS[:3]]
    mixed = greedy[:2] + [(PROMPTS[3], SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                                                      ignore_eos=True))]
    async with AsyncEngine(config, model=gpu_loaded) as engine:
        cache = engine.worker.graph_cache
        for reqs, path, all_greedy in ((greedy, SamplingPath.GREEDY, True),
                                       (mixed, SamplingPath.ADVANCED, False)):
            before = dict(cache.replay_counts())
            async with anyio.create_task_group() as tg:
                for prompt, params in reqs:
                    tg.start_soon(_drain, engine, prompt, params)
            ran = {k for k, n in cache.replay_counts().items() if n > before.get(k, 0)}
            assert ran and all(k.sampling_path is path and k.all_greedy is all_greedy
                               for k in ran), ran


async def test_step_queued_ahead_equals_reading_back_first(tiny_dir, gpu_loaded):
    """Replayed graphs with the next step queued ahead (its tokens read from the last
    replay's static outputs, which the next replay overwrites; for an unchanged batch
    written by the K = 0 graph into its own inputs) equal the same graphs read back
    before the next step, and the steps queued ahead with their inputs copied in; rows
    stop at different iterations, and the step queued ahead is also used for the rows
    left after requests finished."""
    stops = tuple(range(40, 80))
    reqs = [(p, SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=24,
                               stop_token_ids=stops if i % 3 else ()))
            for i, p in enumerate(PROMPTS * 2)]

    async def go(ahead, in_graph=True):
        outs, used = {}, []
        async with AsyncEngine(cfg(tiny_dir, True), model=gpu_loaded) as engine:
            worker = engine.worker
            worker.ahead.always, worker.ahead.in_graph = ahead, in_graph
            take = worker.ahead.take

            def counted(rec):
                queued = worker.ahead.queued
                pending, rows = take(rec)
                if queued is not None and pending is not None:
                    used.append(len(rows) < len(queued.batch))   # after requests left
                return pending, rows
            worker.ahead.take = counted

            async def one(i, prompt, params):
                outs[i] = [t async for o in engine.generate(prompt, params)
                           for t in o.token_ids]
            async with anyio.create_task_group() as tg:
                for i, (prompt, params) in enumerate(reqs):
                    tg.start_soon(one, i, prompt, params)
        return [outs[i] for i in range(len(reqs))], used, worker.ahead.in_graph_steps

    before, _, _ = await go(False)
    after, used, in_graph = await go(True)
    copied, _, none_in_graph = await go(True, in_graph=False)
    assert after == before == copied
    assert used and any(used)
    # Steps queued ahead with the inputs the K = 0 graph wrote (unchanged batches).
    assert in_graph > 0 and none_in_graph == 0


async def test_steps_queued_ahead_under_steady_load(tiny_dir, gpu_loaded):
    """A server's load on replayed graphs (a request submitted as each ends, lengths
    spread, greedy and seeded sampled rows on the rejection path): rows ending keep the
    step queued ahead, newcomers join one iteration later in it (under the bucket their
    batch needs); tokens equal reading back first, nearly every iteration takes a step
    queued ahead, and every page comes back."""
    from ..engine.test_ahead_steady import _steady
    rng = random.Random(5)
    lengths = [rng.randint(3, 24) for _ in range(24)]

    async def go(ahead):
        async with AsyncEngine(cfg(tiny_dir, True, rejection=True),
                               model=gpu_loaded) as engine:
            worker = engine.worker
            worker.ahead.always = ahead
            outs = await _steady(engine, lengths, 6)
            pages = worker.runner.pages
            assert pages.num_free == pages.num_pages
            return (outs, worker.ahead.taken_steps, worker.ahead.joined_steps,
                    engine.stats.num_iterations)

    before, *_ = await go(False)
    after, taken, joined, iterations = await go(True)
    assert after == before
    assert joined >= 5 and taken > 0.8 * iterations, (joined, taken, iterations)


async def _drain(engine, prompt, params):
    async for _ in engine.generate(prompt, params):
        pass


@pytest.fixture(scope="module")
def gpu_bf16(tiny_dir):
    return load_model(tiny_dir, dtype=torch.bfloat16, device="cuda")


@pytest.mark.parametrize("spec", [
    {"method": "none"},
    {"method": "ngram", "k": 3, "rejection": True},
    {"method": "mtp_eagle", "k": 2, "rejection": True},
    {"method": "eagle3", "k": 3, "rejection": True},
    {"method": "eagle3", "k": 3, **TREE},
    {"method": "eagle3", "k": 3, "rejection": True, **TREE},
])
async def test_fused_kernels_replay_equals_eager(tiny_dir, gpu_bf16, spec):
    """bf16 on the fused Triton path (paged attention over real lengths inside the graph):
    greedy and seeded sampled rows of ragged lengths in one batch, replay == eager."""
    assert gpu_bf16.model.uses_kernels
    reqs = requests()
    eager, _ = await run(cfg(tiny_dir, False, **spec), gpu_bf16, reqs)
    graphed, counts = await run(cfg(tiny_dir, True, **spec), gpu_bf16, reqs)
    assert graphed == eager
    assert sum(counts.values()) > 0
