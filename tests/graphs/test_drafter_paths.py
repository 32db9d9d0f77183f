"""One drafting path per drafter: its eager DRAFT and its graph step (run eagerly on the
CPU by a cache that keeps the step function, on rows padded to a bucket with kv_len fixed)
go through the same loop, so they must give identical drafts, iteration by iteration."""

import pytest
import torch

from specloop.engine import AsyncEngine, EngineConfig, IterationRecord
from specloop.engine._request import NewRequest, Request
from specloop.samplers import SamplingParams, SpecMetadata

from ..engine.conftest import PROMPTS, make_config

ITERATIONS = 6


def config(tiny_dir, graphs, method, *, rejection, draft_dir) -> EngineConfig:
    data = make_config(tiny_dir, method=method, k=3, rejection=rejection, max_batch_size=4,
                       draft_model=draft_dir if method == "draft_model" else None).to_dict()
    data["components"]["graph_cache"] = ("tests.graphs.test_static_steps:StepReplayCache"
                                         if graphs else "eager")
    data["graphs"] = {"batch_buckets": [1, 2, 4]}
    return EngineConfig.from_dict(data)


def requests(sampled: bool) -> list[Request]:
    """Three rows (padded to the bucket of 4), a 1-token prompt among them; the middle row
    samples when ``sampled``."""
    out = []
    for i, prompt in enumerate(PROMPTS[:3]):
        params = SamplingParams(temperature=0.9 if sampled and i == 1 else 0.0, top_p=0.9,
                                max_tokens=10**6, ignore_eos=True)
        out.append(Request.from_new(NewRequest(f"r{i}", tuple(prompt), params, seed=i)))
    return out


async def drafts(cfg, loaded, sampled: bool):
    """(draft tokens, draft probs, whether DRAFT replayed) of every iteration, driving the
    handlers directly (no front door, so batches are the same in both runs)."""
    engine = AsyncEngine(cfg, model=loaded)
    engine._build()
    worker = engine.worker
    for request in requests(sampled):
        worker.scheduler.add(request)
    worker._prefill(worker.scheduler.admit())
    spec = SpecMetadata(use_rejection_sampling=cfg.speculative.use_rejection_sampling)
    seen = []
    for i in range(ITERATIONS):
        rec = IterationRecord(i, spec)
        rec.batch = list(worker.scheduler.running)
        await worker.sync(rec)
        await worker.pick_graph_key(rec)
        await worker.draft(rec)
        replayed = worker._draft_replay(rec) is not None
        await worker.verify(rec)
        await worker.rescan(rec)
        spec = rec.spec
        seen.append((rec.draft_token_ids.clone(), None if rec.draft_probs is None
                     else rec.draft_probs.clone(), replayed))
    return seen


@pytest.mark.parametrize("method", ["draft_model", "early_exit", "mtp_eagle", "eagle3"])
@pytest.mark.parametrize("rejection,sampled", [(False, False), (True, True)])
async def test_eager_and_graph_step_give_identical_drafts(tiny_dir, tiny_draft_dir,
                                                         tiny_loaded, method, rejection,
                                                         sampled):
    eager = await drafts(config(tiny_dir, False, method, rejection=rejection,
                                draft_dir=tiny_draft_dir), tiny_loaded, sampled)
    graph = await drafts(config(tiny_dir, True, method, rejection=rejection,
                                draft_dir=tiny_draft_dir), tiny_loaded, sampled)
    assert not any(r for _, _, r in eager)
    assert all(r for _, _, r in graph)         # every DRAFT ran the captured step
    for (tokens, probs, _), (g_tokens, g_probs, _) in zip(eager, graph):
        assert torch.equal(tokens, g_tokens)
        assert (probs is None) == (g_probs is None) == (not rejection)
        if probs is not None:
            torch.testing.assert_close(g_probs, probs, rtol=0, atol=1e-12)


@pytest.mark.parametrize("method", ["draft_model", "early_exit"])
async def test_a_fixed_k_drafter_refuses_a_step_of_another_k(tiny_dir, tiny_draft_dir,
                                                            tiny_loaded, method):
    """A drafter whose K is its own (``FixedKGraphDrafter``) captures its own K (asked for
    it or for none) and refuses any other, naming both, rather than draft K = 3 where the
    graph cache keyed another K."""
    engine = AsyncEngine(config(tiny_dir, True, method, rejection=False,
                                draft_dir=tiny_draft_dir), model=tiny_loaded)
    engine._build()
    drafter = engine.worker.drafter
    assert not drafter.variable_k and drafter.num_draft_tokens == 3
    # (The steps are built, not run: the test above runs them. No sampler or template is
    # read until a step runs.)
    for k in (None, 3):
        assert callable(drafter.graph_step(None, None, advanced=False, num_draft_tokens=k))
    with pytest.raises(ValueError, match=r"fixed K = 3 .*num_draft_tokens = 2"):
        drafter.graph_step(None, None, advanced=False, num_draft_tokens=2)
