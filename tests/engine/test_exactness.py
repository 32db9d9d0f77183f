"""End to end: speculation with rejection sampling leaves the target's distribution intact.

Many seeded requests with one prompt; the first two generated tokens are compared, per
position, with the target's exact distributions (position 2 as the marginal over the
first token, computed by enumerating it). Chi-square with bins of expected count < 5
merged; pass if chi2 < df + 10*sqrt(2*df). The biased twin: the same first-position samples
against the target at temperature 1.0 instead of 0.8 must fail that threshold, in every
test (the power of the very run).
"""

import anyio
import pytest
import torch

from specloop.comm import LocalGroup
from specloop.engine import AsyncEngine
from specloop.samplers import SamplingBatch, SamplingParams, compute_probs

from ..chi2 import chi2_statistic
from .conftest import make_config

PROMPT = [5, 17, 99, 3, 42, 17, 99]
N = 3000
T = 0.8


def exact_distributions(loaded, temperature):
    """p(t1) [V] and the marginal p(t2) [V] after PROMPT, from full forwards."""
    model = loaded.model
    V = loaded.args.vocab_size
    batch = SamplingBatch.from_params([SamplingParams(temperature=temperature)] * V,
                                      list(range(V)))
    with torch.inference_mode():
        cache = model.make_cache(V, 64)
        prompt = torch.tensor([PROMPT])
        h = model(prompt, torch.tensor([0]), torch.tensor([0]), cache)
        p1 = compute_probs(model.logits(h[:, -1]), SamplingBatch.from_params(
            [SamplingParams(temperature=temperature)], [0]))[0]
        seqs = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], dim=1)
        h = model(seqs, torch.zeros(V, dtype=torch.int64), torch.arange(V), cache)
        p2_given = compute_probs(model.logits(h[:, -1]), batch)          # [V, V]
    return p1.double(), (p1.double()[:, None] * p2_given.double()).sum(0)


async def sample_many(engine, n, *, greedy_every=0):
    firsts, seconds, greedy = [], [], []
    limiter = anyio.CapacityLimiter(256)

    async def one(i):
        async with limiter:
            is_greedy = greedy_every and i % greedy_every == 0
            params = SamplingParams(temperature=0.0 if is_greedy else T, seed=i,
                                    max_tokens=2, ignore_eos=True)
            toks = []
            async for out in engine.generate(PROMPT, params):
                toks.extend(out.token_ids)
            (greedy if is_greedy else firsts).append(toks if is_greedy else toks[0])
            if not is_greedy:
                seconds.append(toks[1])

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    return torch.tensor(firsts), torch.tensor(seconds), greedy


def assert_matches(firsts, seconds, p1, p2, *, wrong=None):
    """Each position's samples fit its exact distribution; with ``wrong`` (the
    distributions at another temperature, WRONG_T), the first position's samples must
    also fail against it: the check had the power to see that bias, on these very samples."""
    for pos, (samples, p) in enumerate([(firsts, p1), (seconds, p2)]):
        chi2, limit = chi2_statistic(samples, p)
        assert chi2 < limit, f"position {pos + 1}: chi2 {chi2:.1f} >= {limit:.1f}"
    if wrong is not None:
        chi2, limit = chi2_statistic(firsts, wrong[0])
        assert chi2 > limit, f"no power: chi2 {chi2:.1f} <= {limit:.1f} against T={WRONG_T}"


# The biased twin: the same samples against the target at another temperature must fail.
# (It used to be its own test, 3000 more requests through a plain engine; the samples every
# exactness test draws anyway serve, and show the power of that very run.)
WRONG_T = 1.0


@pytest.fixture(scope="module")
def exact(tiny_loaded):
    return exact_distributions(tiny_loaded, T)


@pytest.fixture(scope="module")
def wrong(tiny_loaded):
    return exact_distributions(tiny_loaded, WRONG_T)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("batched_prefill")   # tests/engine/conftest.py: why
@pytest.mark.parametrize("draft", ["other", "same"])
async def test_draft_model_rejection_sampling_is_exact(tiny_dir, tiny_draft_dir, tiny_loaded,
                                                       exact, wrong, draft):
    config = make_config(tiny_dir, method="draft_model", k=3, rejection=True,
                         max_batch_size=64,
                         draft_model=tiny_draft_dir if draft == "other" else tiny_dir)
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        firsts, seconds, greedy = await sample_many(engine, N, greedy_every=10)
        stats = engine.stats
    assert 0.0 < stats.acceptance_rate <= 1.0
    assert_matches(firsts, seconds, *exact, wrong=wrong)
    expected_greedy = greedy[0]
    assert all(g == expected_greedy for g in greedy)   # greedy rows exact in mixed batches


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("batched_prefill")   # tests/engine/conftest.py: why
async def test_adp_lm_head_tp_rejection_is_exact(tiny_dir, tiny_loaded, exact, wrong):
    config = make_config(tiny_dir, method="mtp_eagle", k=3, rejection=True,
                         max_batch_size=32,
                         parallel={"world_size": 2, "attention_dp": True,
                                   "lm_head_tp_in_adp": True})
    group = LocalGroup(2, timeout=10.0)

    async def rank_main(comm):
        async with AsyncEngine(config, communicator=comm, model=tiny_loaded) as engine:
            if comm.rank == 0:
                return await sample_many(engine, N, greedy_every=7)
            await engine.wait_closed()

    firsts, seconds, greedy = (await group.run(rank_main))[0]
    assert_matches(firsts, seconds, *exact, wrong=wrong)
    assert len(set(map(tuple, greedy))) == 1
