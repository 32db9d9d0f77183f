"""Property-based lifecycle tests (hypothesis): random sampling params, and random
interleavings of submit / cancel / break / timeout / id reuse on 1 and 2 LocalGroup ranks.

Invariants after each run: every stream ended exactly once; every token a request saw is
its own (a prefix of its reference); seeded outputs repeat; slots, pages, schedulers and
the front door are empty again; no task is left; the engine still serves a fresh batch.
"""

import asyncio
import contextlib
import math

import anyio
import attrs
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from specloop.comm import LocalGroup
from specloop.engine import AsyncEngine, EngineConfig, FinishReason, RequestError
from specloop.samplers import (SamplingBatch, SamplingParams, SamplingParamsError,
                               compute_probs, sample_tokens)

from .conftest import PROMPTS, collect, make_config
from .test_engine import reference_greedy

BATCH = 2
FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens")
# Values at and just past the edges of each field's range and of its tensor dtype.
field_values = {
    "temperature": st.one_of(
        st.sampled_from([0, 0.0, 1e-6, 1e6, 5e-7, 2e6, 1e-40, 1e-300, 1e300, 3.5e38]),
        st.floats(0, 10)),
    "top_k": st.one_of(st.sampled_from([0, 1, 2**63 - 1, 2**63, 10**30, -1]),
                       st.integers(0, 1000)),
    "top_p": st.one_of(st.sampled_from([1e-300, 5e-324, 1.0, 0.0, 1e-45]), st.floats(0, 1)),
    "min_p": st.one_of(st.sampled_from([0.0, 1.0, 1e-300]), st.floats(0, 1)),
    "seed": st.sampled_from([0, 2**63 - 1, 2**63, -1]),
    "max_tokens": st.sampled_from([1, 2**63 - 1, 2**63, 0]),
}
weird = st.one_of(st.none(), st.booleans(), st.text(max_size=2),
                  st.sampled_from([math.nan, math.inf, -math.inf]), st.integers(-2**70, -1))


@settings(max_examples=150, deadline=None, database=None)
@given(kwargs=st.fixed_dictionaries({}, optional=field_values), data=st.data())
def test_params_fail_naming_a_field_or_never_fail_later(kwargs, data):
    try:
        params = SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        assert any(f"SamplingParams.{name} =" in str(exc) for name in kwargs), exc
        return
    seed = data.draw(st.integers(0, 2**63 - 1))
    greedy = SamplingParams(temperature=0)
    # Valid params must build their tensors and give finite probabilities and tokens.
    batch = SamplingBatch.from_params([params, greedy], [seed, 0], pad_to=3)
    logits = torch.randn(3, 4, 384, dtype=torch.float64) * data.draw(st.sampled_from([1, 30]))
    probs = compute_probs(logits, batch)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.sum(-1), torch.ones(3, 4, dtype=probs.dtype), atol=1e-3)
    positions = torch.arange(4).expand(3, 4)
    tokens = sample_tokens(probs, batch.seeds, positions, 0)
    assert ((tokens >= 0) & (tokens < 384)).all()


@settings(max_examples=60, deadline=None, database=None)
@given(field=st.sampled_from(FIELDS), value=weird)
def test_values_of_the_wrong_type_fail_naming_the_field(field, value):
    if field == "seed" and value is None:
        return                      # None is the one non-int seed allowed
    try:
        SamplingParams(**{field: value})
    except SamplingParamsError as exc:
        assert f"SamplingParams.{field} =" in str(exc)
    else:
        raise AssertionError(f"SamplingParams({field}={value!r}) was accepted")


# Engine interleavings ---------------------------------------------------------------
ACTIONS = ("complete", "cancel_before", "cancel_queued", "cancel_running", "cancel_after",
           "break", "timeout")


@attrs.frozen
class Plan:
    prompt: int                 # index into PROMPTS, or -1..-3 for a bad prompt
    seed: int | None            # None: greedy
    max_tokens: int
    action: str
    after: int                  # outputs seen before break / cancel
    request_id: str | None
    delay: float


plans = st.builds(
    Plan, prompt=st.sampled_from([0, 1, 2, 3, 4, 0, 1, -1, -2, -3]),
    seed=st.sampled_from([None, None, 1, 2]), max_tokens=st.sampled_from([1, 6, 12]),
    action=st.sampled_from(ACTIONS), after=st.integers(1, 3),
    request_id=st.sampled_from([None, None, "a", "b"]),
    delay=st.sampled_from([0, 0, 0.002, 0.02]))
_REFS: dict = {}
BAD_PROMPTS = {-1: [], -2: [1, 2, 10**6], -3: "bad \ud800 text"}


class References:
    """Greedy references by full recomputation; seeded outputs from their first full run."""

    def __init__(self, loaded):
        self.loaded = loaded
        self.greedy = {}
        self.seeded = {}

    def check(self, plan: Plan, tokens: list[int], reason) -> None:
        if plan.seed is None:
            key = (plan.prompt, plan.max_tokens)
            if key not in self.greedy:
                self.greedy[key] = reference_greedy(self.loaded, PROMPTS[plan.prompt],
                                                    plan.max_tokens)
            want = self.greedy[key]
        else:
            key = (plan.prompt, plan.seed, plan.max_tokens)
            if reason is FinishReason.LENGTH:
                self.seeded.setdefault(key, tokens)
            want = self.seeded.get(key)
        # Only its own tokens, ever: a prefix of its reference; all of it when complete.
        if want is not None:
            assert tokens == want[:len(tokens)], (plan, tokens, want)
            assert reason is not FinishReason.LENGTH or tokens == want, (plan, tokens, want)
        assert reason in (FinishReason.LENGTH, FinishReason.CANCELLED, None), (plan, reason)


async def run_plan(engine, tg, plan: Plan, refs: References, ended: list) -> None:
    await anyio.sleep(plan.delay)
    prompt = BAD_PROMPTS[plan.prompt] if plan.prompt < 0 else PROMPTS[plan.prompt]
    params = SamplingParams(temperature=0 if plan.seed is None else 1.0, seed=plan.seed,
                            max_tokens=plan.max_tokens, ignore_eos=True)
    cancel_id = plan.request_id or "not-live"
    if plan.action == "cancel_before":
        engine.cancel(cancel_id)        # not submitted yet: ignored
    if plan.action == "cancel_queued":
        tg.start_soon(cancel_soon, engine, cancel_id)   # runs once this plan has submitted
    tokens, final, endings = [], None, 0
    stream = engine.generate(prompt, params, request_id=plan.request_id)
    try:
        async with contextlib.aclosing(stream):
            scope = anyio.move_on_after(0.005 if plan.action == "timeout" else math.inf)
            with scope:
                async for out in stream:
                    assert final is None, "output after the final one"
                    tokens.extend(out.token_ids)
                    if out.finished:
                        final, endings = out.finish_reason, endings + 1
                    elif plan.action == "break" and len(tokens) >= plan.after:
                        break
                    elif plan.action == "cancel_running" and len(tokens) >= plan.after:
                        engine.cancel(cancel_id)
        if plan.action == "cancel_after":
            engine.cancel(cancel_id)
    except RequestError:
        assert not tokens
        assert plan.prompt < 0 or plan.request_id is not None, plan   # bad, or id in use
        endings += 1
    if plan.prompt < 0:
        assert endings == 1 and final is None, (plan, final)  # a bad prompt always fails
        return
    left = plan.action in ("break", "timeout")
    assert endings == 1 or (left and endings == 0), (plan, endings, final)
    refs.check(plan, tokens, final)
    ended.append(plan)


async def cancel_soon(engine, request_id: str) -> None:
    await anyio.sleep(0)
    engine.cancel(request_id)


async def assert_empty(engines) -> None:
    """Cancels reach other ranks with the next exchanges: poll briefly."""
    with anyio.fail_after(10):
        while True:
            busy = [e for e in engines if e.num_free_slots != BATCH
                    or e.worker.scheduler.num_requests
                    or (e.front is not None and e.front.open_request_ids)
                    or e.worker.runner.pages.num_free != e.worker.runner.pages.num_pages]
            if not busy:
                return
            await anyio.sleep(0.005)


async def scenario(config, loaded, world, batch: list[Plan], refs: References,
                   ahead: bool = False, chained: bool = False) -> None:
    before = asyncio.all_tasks()
    group = LocalGroup(world, timeout=20.0)
    engines, ended = [], []

    async def rank_main(comm):
        async with AsyncEngine(config, communicator=comm, model=loaded) as engine:
            engines.append(engine)
            if ahead:       # one GPU rank's path: steps queued ahead, newcomers deferred
                engine.worker.verify_inline = engine.worker.ahead.always = True
            if chained:     # one GPU rank's path with a drafter: DRAFT + VERIFY chained
                from specloop.engine._chain import DeviceChain
                engine.worker.verify_inline = True
                engine.worker.chain = DeviceChain(worker=engine.worker)
            if comm.rank != 0:
                await engine.wait_closed()
                return
            async with anyio.create_task_group() as tg:
                for plan in batch:
                    tg.start_soon(run_plan, engine, tg, plan, refs, ended)
            await assert_empty(engines)
            async with anyio.create_task_group() as tg:
                for plan in fresh_plans():
                    tg.start_soon(run_plan, engine, tg, plan, refs, ended)
            await assert_empty(engines)

    with anyio.fail_after(60):
        await group.run(rank_main)
    assert len(ended) == len(fresh_plans()) + sum(p.prompt >= 0 for p in batch)
    assert asyncio.all_tasks() == before


def fresh_plans() -> list[Plan]:
    return [Plan(i, None, 6, "complete", 1, None, 0) for i in (0, 1, 2)]


def _engine_property(world, ahead=False, chained=False, tree=False, adaptive=False):
    # No shrinking: a failure prints its example; shrinking engine runs takes minutes.
    @settings(max_examples=10, deadline=None, database=None,
              phases=(Phase.explicit, Phase.generate),
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow])
    @given(batch=st.lists(plans, min_size=2, max_size=7))
    def run(tiny_dir, tiny_loaded, batch):
        method = "none" if ahead else "mtp_eagle" if chained or tree else "ngram"
        # A draft tree of depth 2 (every batch drafts it: strict verification; chained
        # after a tree; under adaptive K where the rule picks K = 2).
        spec = {"tree": [[0], [1], [0, 0], [1, 0]]} if tree else {}
        if adaptive:
            spec["adaptive"] = True
        config = make_config(tiny_dir, method=method, k=2 if chained or tree else 3,
                             max_batch_size=BATCH, speculative=spec,
                             parallel={"world_size": world, "attention_dp": world > 1})
        if chained:     # replays that write static outputs, as CUDA graphs do
            data = config.to_dict()
            data["components"]["graph_cache"] = "tests.graphs.test_chain:StaticOutputCache"
            data["graphs"] = {"batch_buckets": [1, 2]}
            config = EngineConfig.from_dict(data)
        # Shared by both rank counts: seeded outputs must not depend on placement.
        refs = _REFS.setdefault((id(tiny_loaded), ahead), References(tiny_loaded))
        anyio.run(scenario, config, tiny_loaded, world, batch, refs, ahead, chained)
    return run


test_interleavings_on_one_rank = _engine_property(1)
test_interleavings_on_two_local_ranks = _engine_property(2)
# No speculation on one GPU rank's path: steps queued ahead taken for the rows left after
# cancels, breaks and ends, requests admitted meanwhile joining one iteration later.
test_interleavings_with_steps_queued_ahead = _engine_property(1, ahead=True)
# mtp_eagle on one GPU rank's path: DRAFT + VERIFY chained, taken for the rows left after
# cancels, breaks and ends, requests admitted meanwhile joining the step chained for them.
test_interleavings_with_chained_steps = _engine_property(1, chained=True)
# The same two paths on two ranks: each rank holds the requests it admits back one
# iteration while its step queued ahead (or chained) is on the device, as one rank does.
test_interleavings_with_steps_queued_ahead_in_a_group = _engine_property(2, ahead=True)
test_interleavings_with_chained_steps_in_a_group = _engine_property(2, chained=True)
# A draft tree on one GPU rank's path (chained): pages for its nodes taken and given back.
test_interleavings_with_a_draft_tree_chained = _engine_property(1, chained=True, tree=True)
# A draft tree under adaptive K on two ranks (each rank's batch its own tree or chain).
test_interleavings_with_a_draft_tree_under_adaptive_k_in_a_group = _engine_property(
    2, tree=True, adaptive=True)
