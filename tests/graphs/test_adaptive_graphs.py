"""Adaptive K on the graph path: every K's VERIFY (and DRAFT) is captured, the K chosen per
iteration replays its own graphs, and greedy stays exact — on CPU through the step-replay
cache (test_static_steps) and on a GPU through CUDA graphs."""

import collections

import pytest
import torch

from specloop.engine import AsyncEngine
from specloop.engine._adaptive import CostTable
from specloop.models import load_model

from ..engine.conftest import serve_staggered
from ..engine.test_adaptive import KS, KLog, staggered, switching_cost
from .test_cuda_graphs import cfg as cuda_cfg
from .test_static_steps import config as step_cfg


async def check_adaptive_graphs(config, plain, loaded, cost=switching_cost):
    reqs = staggered()
    klog = KLog()
    async with AsyncEngine(config, model=loaded, observers=[klog]) as engine:
        cache = engine.worker.graph_cache
        assert sorted(engine.worker.adaptive.cost.device) == [
            (b, k) for b in (1, 2, 4, 8) for k in (0, 1, 2, 3)]
        engine.worker.adaptive.cost = cost()
        outs = await serve_staggered(engine, reqs)
        ran = {key for key, n in cache.replay_counts().items() if n}
    ks = collections.Counter(k for _, k in klog.ks)
    assert len(ks) >= 2 and ks[0], ks
    verify_ks = {key.num_draft_tokens for key in ran if key.stage == "verify"}
    assert len(verify_ks) >= 2, ran
    if config.speculative.method != "ngram":     # n-gram drafts on the host: no graphs
        # K = 0 calls no drafter; an iteration after K = 0 ones drafts eagerly (its
        # catch-up is wider than the graph's).
        drafted = {key.num_draft_tokens for key in ran if key.stage == "draft"}
        assert 0 not in drafted and drafted and drafted <= verify_ks - {0}
    # Greedy rows equal the engine's without speculation.
    async with AsyncEngine(plain, model=loaded) as engine:
        reference = await serve_staggered(engine, reqs)
    for (_, params, _), out, ref in zip(reqs, outs, reference):
        if params.is_greedy:
            assert out == ref


@pytest.mark.parametrize("method", ["ngram", "mtp_eagle"])
async def test_adaptive_k_on_the_graph_path_cpu(tiny_dir, tiny_loaded, method):
    spec = {"adaptive": True}
    await check_adaptive_graphs(
        step_cfg(tiny_dir, True, method=method, k=3, rejection=True, speculative=spec),
        step_cfg(tiny_dir, False, method="none"), tiny_loaded)


@pytest.fixture(scope="module")
def gpu_loaded(tiny_dir):
    return load_model(tiny_dir, dtype=torch.float64, device="cuda")


def dear_from_two():
    """Free drafts at batch 1, too dear from 2 rows on. On a GPU the chained n-gram
    drafter is fast enough that the staggered requests rarely overlap 3 at a time, where
    switching_cost first prices K = 0 best."""
    return CostTable({(b, k): 1.0 + {1: 0.001, 2: 3.0, 4: 3.0}[b] * k
                      for b in (1, 2, 4) for k in KS}, learn=False)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["ngram", "mtp_eagle", "eagle3"])
async def test_adaptive_k_replays_each_ks_cuda_graphs(tiny_dir, gpu_loaded, method):
    spec = {"adaptive": True}
    await check_adaptive_graphs(
        cuda_cfg(tiny_dir, True, method=method, k=3, rejection=True, speculative=spec),
        cuda_cfg(tiny_dir, False, method="none"), gpu_loaded, dear_from_two)
