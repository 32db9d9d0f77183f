import weakref

import anyio
import pytest
import torch

from specloop.engine import AsyncEngine, EngineClosedError, FinishReason, RequestError
from specloop.samplers import SamplingParams

from .conftest import PROMPTS, collect, make_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


# model -> {prompt: the longest greedy continuation computed so far}. The references are
# deterministic (float64 full forwards) and a shorter one is a prefix of a longer one, so
# each (model, prompt) is decoded once per process and extended on demand: the engine
# modules ask for the same prompts again and again (~6 s of CPU in the fast subset).
_GREEDY_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reference_greedy(loaded, prompt, n):
    """Greedy decoding by full recomputation: no KV cache, no engine."""
    model = loaded.model
    memo = _GREEDY_MEMO.setdefault(model, {})
    done = memo.get(tuple(prompt), [])
    tokens = list(prompt) + done
    cache = model.make_cache(1, 512)
    with torch.inference_mode():
        for _ in range(n - len(done)):
            t = torch.tensor([tokens])
            hidden = model(t, torch.tensor([0]), torch.tensor([0]), cache)
            tokens.append(int(model.logits(hidden[0, -1]).argmax()))
    memo[tuple(prompt)] = max(done, tokens[len(prompt):], key=len)
    return tokens[len(prompt):len(prompt) + n]


async def run_all(config, loaded, prompts, params=GREEDY):
    async with AsyncEngine(config, model=loaded) as engine:
        results = {}

        async def one(i, p):
            results[i] = await collect(engine, p, params)

        async with anyio.create_task_group() as tg:
            for i, p in enumerate(prompts):
                tg.start_soon(one, i, p)
        stats = engine.stats
    return [results[i] for i in range(len(prompts))], stats


async def test_greedy_without_speculation_equals_reference(tiny_dir, tiny_loaded):
    outs, _ = await run_all(make_config(tiny_dir), tiny_loaded, PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        assert out == reference_greedy(tiny_loaded, prompt, GREEDY.max_tokens)


@pytest.fixture(scope="module")
def plain_greedy(tiny_dir, tiny_loaded):
    """The engine without speculation on PROMPTS (GREEDY): one run for the nine cases."""
    return anyio.run(run_all, make_config(tiny_dir), tiny_loaded, PROMPTS)[0]


@pytest.mark.parametrize("method", ["ngram", "draft_model", "early_exit"])
@pytest.mark.parametrize("k", [1, 3, 5])
async def test_speculative_greedy_equals_plain_greedy(tiny_dir, tiny_draft_dir, tiny_loaded,
                                                      plain_greedy, method, k):
    plain = plain_greedy
    draft = tiny_draft_dir if method == "draft_model" else None
    config = make_config(tiny_dir, method=method, k=k, draft_model=draft)
    spec, stats = await run_all(config, tiny_loaded, PROMPTS)
    assert spec == plain
    assert stats.num_draft_tokens > 0


@pytest.mark.parametrize("k", [1, 3, 5])
async def test_draft_equal_to_target_accepts_everything(tiny_dir, tiny_loaded, k):
    config = make_config(tiny_dir, method="draft_model", k=k, draft_model=tiny_dir)
    params = SamplingParams(temperature=0.0, max_tokens=6 * (k + 1), ignore_eos=True)
    _, stats = await run_all(config, tiny_loaded, PROMPTS[:2], params)
    assert stats.acceptance_rate == 1.0
    assert stats.mean_acceptance_length == k + 1


async def test_eight_concurrent_requests_of_different_lengths(tiny_dir, tiny_loaded):
    config = make_config(tiny_dir, method="ngram", k=3, max_batch_size=3)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    lengths = [3, 9, 17, 1, 25, 6, 12, 30]
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        results = {}

        async def one(i):
            params = SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True)
            results[i] = await collect(engine, prompts[i], params)

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
        assert engine.num_free_slots == 3
    for i in range(8):
        assert results[i] == reference_greedy(tiny_loaded, prompts[i], lengths[i])


async def test_cancel_midway_frees_the_slot(tiny_dir, tiny_loaded):
    config = make_config(tiny_dir, method="ngram", max_batch_size=2)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        outputs = []
        async for out in engine.generate([1, 2, 3], long, request_id="victim"):
            outputs.append(out)
            if sum(len(o.token_ids) for o in outputs) >= 5:
                engine.cancel("victim")
        assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.CANCELLED
        assert sum(len(o.token_ids) for o in outputs) < 200
        await anyio.sleep(0.05)
        assert engine.num_free_slots == 2


async def test_leaving_the_stream_early_frees_the_slot(tiny_dir, tiny_loaded):
    config = make_config(tiny_dir, max_batch_size=2)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        async for out in engine.generate([1, 2, 3], long):
            break
        for _ in range(50):
            await anyio.sleep(0.01)
            if engine.num_free_slots == 2:
                break
        assert engine.num_free_slots == 2


async def test_bad_requests_fail_alone(tiny_dir, tiny_loaded):
    config = make_config(tiny_dir, method="ngram", max_seq_len=64)
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        good = {}

        async def ok(i):
            good[i] = await collect(engine, PROMPTS[i], GREEDY)

        async def bad(prompt, params, match):
            with pytest.raises(RequestError, match=match):
                await collect(engine, prompt, params)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ok, 0)
            tg.start_soon(bad, [], GREEDY, "empty")
            tg.start_soon(bad, "", GREEDY, "empty")
            tg.start_soon(bad, list(range(1, 100)), GREEDY, "max_seq_len")
            tg.start_soon(bad, [1, 2, 10**6], GREEDY, "token ids")
            tg.start_soon(bad, [1, 2], {"temperature": 0}, "SamplingParams")
            tg.start_soon(ok, 1)
    assert good[0] == reference_greedy(tiny_loaded, PROMPTS[0], GREEDY.max_tokens)
    assert good[1] == reference_greedy(tiny_loaded, PROMPTS[1], GREEDY.max_tokens)


async def test_stops_at_stop_token_and_max_tokens(tiny_dir, tiny_loaded):
    expected = reference_greedy(tiny_loaded, PROMPTS[0], 10)
    stop = expected[4]
    config = make_config(tiny_dir, method="ngram")
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        outs = [o async for o in engine.generate(
            PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=(stop,),
                                       ignore_eos=True))]
    tokens = [t for o in outs for t in o.token_ids]
    assert tokens == expected[:expected.index(stop) + 1]
    assert outs[-1].finish_reason is FinishReason.STOP


async def test_generate_outside_the_engine_context_is_an_error(tiny_dir, tiny_loaded):
    engine = AsyncEngine(make_config(tiny_dir), model=tiny_loaded)
    with pytest.raises(EngineClosedError):
        await collect(engine, [1, 2], GREEDY)


async def test_shutdown_cancels_open_streams(tiny_dir, tiny_loaded):
    config = make_config(tiny_dir)
    long = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    got = []
    async with anyio.create_task_group() as tg:
        async with AsyncEngine(config, model=tiny_loaded) as engine:
            async def consume():
                async for out in engine.generate([1, 2, 3], long):
                    got.append(out)
            tg.start_soon(consume)
            await anyio.sleep(0.2)
    assert got and got[-1].finished and got[-1].finish_reason is FinishReason.CANCELLED


async def test_unseeded_requests_are_reproducible_with_a_base_seed(tiny_dir, tiny_loaded):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = []
    for base in (7, 7, 8):
        config = make_config(tiny_dir, scheduler={"max_batch_size": 4, "seed": base})
        async with AsyncEngine(config, model=tiny_loaded) as engine:
            runs.append([await collect(engine, p, params) for p in PROMPTS[:3]])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


async def test_text_deltas_join_to_the_decoded_tokens(tiny_dir, tiny_loaded):
    async with AsyncEngine(make_config(tiny_dir), model=tiny_loaded) as engine:
        outs = [o async for o in engine.generate(PROMPTS[1], GREEDY)]
    tokens = [t for o in outs for t in o.token_ids]
    assert "".join(o.text for o in outs) == tiny_loaded.tokenizer.decode(tokens)


class SlowModel(torch.nn.Module):
    """The tiny model, with every forward blocking its thread for 20 ms."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.args = inner.args

    def forward(self, *args, **kwargs):
        import time
        time.sleep(0.02)
        return self.inner(*args, **kwargs)

    def logits(self, hidden):
        return self.inner.logits(hidden)


async def test_model_compute_runs_off_the_event_loop(tiny_dir, tiny_loaded):
    import attrs
    slow = attrs.evolve(tiny_loaded, model=SlowModel(tiny_loaded.model))
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await anyio.sleep(0.001)
            ticks += 1

    async with AsyncEngine(make_config(tiny_dir), model=slow) as engine:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await collect(engine, [1, 2, 3], SamplingParams(temperature=0, max_tokens=10))
            tg.cancel_scope.cancel()
        iterations = engine.stats.num_iterations
    # On the loop, a blocking forward would allow about one tick per iteration.
    assert ticks > 5 * iterations, (ticks, iterations)


async def test_shutdown_leaves_no_task_behind(tiny_dir, tiny_loaded):
    import asyncio
    before = asyncio.all_tasks()
    long = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    async with anyio.create_task_group() as tg:
        async with AsyncEngine(make_config(tiny_dir), model=tiny_loaded) as engine:
            tg.start_soon(collect, engine, [1, 2, 3], long)
            await anyio.sleep(0.1)
    assert asyncio.all_tasks() == before


async def test_running_engines_hold_the_gc_freeze_and_the_last_one_out_lifts_it(
        tiny_dir, tiny_loaded):
    import gc
    assert gc.get_freeze_count() == 0, "no engine of an earlier test still holds the freeze"
    on = make_config(tiny_dir, parallel={"freeze_gc": "on"})
    async with AsyncEngine(on, model=tiny_loaded) as one:
        assert gc.get_freeze_count() > 0
        async with AsyncEngine(on, model=tiny_loaded):
            pass                                 # a second engine leaves: still frozen
        assert gc.get_freeze_count() > 0
        assert await collect(one, [1, 2, 3], GREEDY)
    assert gc.get_freeze_count() == 0
    async with AsyncEngine(make_config(tiny_dir), model=tiny_loaded):
        assert gc.get_freeze_count() == 0       # "auto": CUDA devices only
