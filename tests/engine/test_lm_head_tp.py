"""Rejection sampling under attention DP with a tensor-parallel LM head (mtp_eagle)."""

import anyio
import pytest
import torch

from specloop.comm import CollectiveMismatchError, LocalGroup
from specloop.engine import AsyncEngine, IterationRecord
from specloop.samplers import SamplingParams, SpecMetadata

from .conftest import make_config, serve_staggered
from .test_engine import reference_greedy

# One worker runs the module, so its memos below are computed once per run: the greedy
# references (full recomputation, ~2 s CPU for the workload) and each method's one-rank run.
pytestmark = pytest.mark.xdist_group("lm_head_tp")


@pytest.fixture(scope="module")
def references(tiny_loaded):
    """reference_greedy(prompt, n), memoized over the module's tests."""
    memo = {}

    def get(prompt, n):
        key = (tuple(prompt), n)
        if key not in memo:
            memo[key] = reference_greedy(tiny_loaded, prompt, n)
        return memo[key]
    return get


@pytest.fixture(scope="module")
def one_rank_runs():
    """method -> the workload's outputs on one rank (rejection sampling on), filled by the
    first test that needs them: the 2- and 4-rank cases compare against the same run."""
    return {}


def tp_config(model_dir, world, *, rejection=True, k=3, max_batch_size=4, method="mtp_eagle"):
    return make_config(model_dir, method=method, k=k, rejection=rejection,
                       max_batch_size=max_batch_size,
                       parallel={"world_size": world, "attention_dp": True,
                                 "lm_head_tp_in_adp": True})


def workload(n=16):
    """Requests arriving over time: greedy ones and seeded sampled ones, varied lengths."""
    out = []
    for i in range(n):
        prompt = [3 + i, 40 + 2 * i, 7, 90 + i]
        if i % 3 == 1:
            params = SamplingParams(temperature=0.9, top_k=50, seed=1000 + i,
                                    max_tokens=10 + 2 * i, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=20 + 3 * i, ignore_eos=True)
        out.append((prompt, params, 0.02 * i))
    return out


async def run_group(world, config, loaded, reqs, *, disable_sync=False, timeout=5.0):
    group = LocalGroup(world, timeout=timeout)

    async def rank_main(comm):
        async with AsyncEngine(config, communicator=comm, model=loaded) as engine:
            if disable_sync:
                engine.worker.group_sync = False   # test-only switch: proves the test bites
            if comm.rank == 0:
                return await serve_staggered(engine, reqs), engine.stats.num_iterations
            await engine.wait_closed()

    return await group.run(rank_main)


async def single_rank(config, loaded, reqs):
    async with AsyncEngine(config, model=loaded) as engine:
        return await serve_staggered(engine, reqs), engine.stats.num_iterations


@pytest.mark.parametrize("method", ["mtp_eagle", "eagle3"])
async def test_mtp_eagle_single_rank_greedy_is_exact(tiny_dir, tiny_loaded, references,
                                                      method):
    reqs = [(p, prm, d) for p, prm, d in workload() if prm.is_greedy]
    config = make_config(tiny_dir, method=method, k=3)
    outs, _ = await single_rank(config, tiny_loaded, reqs)
    for (prompt, params, _), out in zip(reqs, outs):
        assert out == references(prompt, params.max_tokens)


# 4 ranks cost twice the 2-rank case for the same property: slow, so the fast subset keeps 2.
# eagle3's case (~8 s CPU) is slow too: the fast subset keeps mtp_eagle's group case and
# eagle3's single-rank greedy case above.
@pytest.mark.parametrize("world, method", [
    (2, "mtp_eagle"), pytest.param(2, "eagle3", marks=pytest.mark.slow),
    pytest.param(4, "mtp_eagle", marks=pytest.mark.slow)])
async def test_mixed_ranks_never_mismatch_and_match_one_rank(tiny_dir, tiny_loaded, references,
                                                             one_rank_runs, world, method):
    reqs = workload()
    results = await run_group(world, tp_config(tiny_dir, world, method=method), tiny_loaded,
                              reqs)
    outs, iterations = results[0]
    assert iterations >= 50
    for (prompt, params, _), out in zip(reqs, outs):
        if params.is_greedy:
            assert out == references(prompt, params.max_tokens)
    # Seeded sampled requests: the same tokens on one rank (float64, so batch-shape
    # rounding cannot flip a draw).
    if method not in one_rank_runs:
        one_rank_runs[method], _ = await single_rank(
            make_config(tiny_dir, method=method, k=3, rejection=True), tiny_loaded, reqs)
    assert outs == one_rank_runs[method]


@pytest.mark.parametrize("world", [2, 4])
async def test_without_group_sync_the_collectives_mismatch(tiny_dir, tiny_loaded, world):
    with pytest.raises(BaseExceptionGroup) as info:
        with anyio.fail_after(20):
            await run_group(world, tp_config(tiny_dir, world), tiny_loaded, workload(),
                            disable_sync=True, timeout=2.0)
    flat = []

    def walk(e):
        for sub in getattr(e, "exceptions", [e]):
            walk(sub) if isinstance(sub, BaseExceptionGroup) else flat.append(sub)
    walk(info.value)
    assert any(isinstance(e, CollectiveMismatchError) for e in flat), flat


@pytest.mark.parametrize("gate", [False, True])
async def test_synced_flag_is_the_and_of_the_ranks_flags(tiny_dir, tiny_loaded, gate):
    """SYNC on 3 ranks whose local batches are greedy, greedy, sampled (after the
    exchange its facts ride, as SCHEDULE runs it)."""
    from specloop.engine._request import Request
    config = make_config(tiny_dir, method="ngram", rejection=True,
                         parallel={"world_size": 3, "attention_dp": True,
                                   "lm_head_tp_in_adp": gate})
    group = LocalGroup(3)
    flags = [True, True, False]

    async def rank_main(comm):
        engine = AsyncEngine(config, communicator=comm, model=tiny_loaded)
        engine._build()                     # the worker alone, no iteration loop
        params = SamplingParams(temperature=0.0 if flags[comm.rank] else 1.0)
        rec = IterationRecord(0, SpecMetadata(use_rejection_sampling=True))
        rec.batch = [Request("x", (1, 2), params, 0, [1, 2])]
        await engine.worker.exchange(engine.worker._facts(rec))
        await engine.worker.sync(rec)
        return rec.spec

    specs = await group.run(rank_main)
    for rank, spec in enumerate(specs):
        assert spec.is_all_greedy_sample == flags[rank]
        if gate:
            assert spec.group_all_greedy_sample is False
            assert spec.wants_advanced_draft_sampling
        else:
            assert spec.group_all_greedy_sample is None
            assert spec.wants_advanced_draft_sampling == (not flags[rank])


async def test_mtp_head_weights_load_from_safetensors(tiny_dir, tiny_loaded, tmp_path):
    """A saved head reloads through config (speculative.mtp_weights) and drafts the same."""
    from specloop.models.drafters import MtpEagleHead
    head = MtpEagleHead(tiny_loaded.model, dtype=torch.float64, device="cpu")
    head.init_random(seed=7)
    path = tmp_path / "head.safetensors"
    head.save(str(path))
    reqs = [(p, prm, 0.0) for p, prm, _ in workload(6)]
    saved = make_config(tiny_dir, method="mtp_eagle", k=3, rejection=True,
                        speculative={"mtp_weights": str(path)})
    random0 = make_config(tiny_dir, method="mtp_eagle", k=3, rejection=True)
    async with AsyncEngine(saved, model=tiny_loaded) as engine:
        loaded_head = engine.worker.drafter.head
        for name, tensor in head.own_state().items():
            assert torch.equal(loaded_head.own_state()[name], tensor), name
        out_saved = await serve_staggered(engine, reqs)
        drafted_saved = engine.stats.num_accepted_tokens
    async with AsyncEngine(random0, model=tiny_loaded) as engine:
        out_seed0 = await serve_staggered(engine, reqs)
    # Exact either way; the sampled continuations differ because the drafts differ.
    greedy = [i for i, (_, prm, _) in enumerate(reqs) if prm.is_greedy]
    assert [out_saved[i] for i in greedy] == [out_seed0[i] for i in greedy]
    assert drafted_saved >= 0


def test_mtp_head_file_errors(tiny_loaded, tmp_path):
    from safetensors.torch import save_file
    from specloop.models.drafters import MtpEagleHead
    head = MtpEagleHead(tiny_loaded.model, dtype=torch.float64, device="cpu")
    bad = tmp_path / "bad.safetensors"
    save_file({"fc": torch.zeros(2, 2, dtype=torch.float64)}, str(bad))
    with pytest.raises(ValueError, match="lacks"):
        head.load(str(bad))
