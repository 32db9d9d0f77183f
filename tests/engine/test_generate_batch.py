"""``AsyncEngine.generate_batch``: one stream for several requests, equal to running each
through ``generate``; leaving early and stop strings end the requests in the engine."""

import anyio
import pytest

from specloop.engine import AsyncEngine, FinishReason, RequestError
from specloop.samplers import SamplingParams

from .conftest import PROMPTS, make_config


async def _one(engine, prompt, params):
    text, ids, reason = "", [], None
    async for out in engine.generate(prompt, params):
        text, reason = text + out.text, out.finish_reason
        ids.extend(out.token_ids)
    return text, ids, reason


async def _free(engine, config):
    with anyio.fail_after(10):
        while engine.num_free_slots != config.scheduler.max_batch_size:
            await anyio.sleep(0.01)


@pytest.mark.parametrize("method", ["none", "ngram"])
async def test_batch_equals_one_stream_per_request(tiny_dir, tiny_loaded, method):
    config = make_config(tiny_dir, method=method, max_batch_size=3)
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        full, _, _ = await _one(engine, "The quick brown fox", greedy)
        stop = full[len(full) // 2:len(full) // 2 + 3]      # ends one request mid-way
        params = [greedy,
                  SamplingParams(temperature=0.8, seed=4, max_tokens=12, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=300, ignore_eos=True, stop=stop),
                  SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                  SamplingParams(temperature=1.0, seed=7, max_tokens=20,
                                 stop_token_ids=tuple(range(40, 80)))]
        prompts = ["The quick brown fox", PROMPTS[1], "The quick brown fox", PROMPTS[3],
                   PROMPTS[0]]
        expect = [await _one(engine, p, q) for p, q in zip(prompts, params)]
        got = {}
        items = 0
        async for item in engine.generate_batch(prompts, params):
            items += 1
            for out in item:
                text, ids, _ = got.get(out.request_id, ("", [], None))
                assert out.request_id not in got or not got[out.request_id][2]
                got[out.request_id] = (text + out.text, ids + list(out.token_ids),
                                       out.finish_reason)
        assert items > 1
        ended_at = engine.stats.num_iterations
        ids = sorted(got, key=lambda r: int(r.split("-")[1]))
        assert [got[r] for r in ids] == expect
        assert expect[2][2] is FinishReason.STOP and len(expect[2][1]) < 30
        # The stop string's request ends in the engine within iterations, not 300 tokens.
        await _free(engine, config)
        assert engine.stats.num_iterations - ended_at < 10


async def test_leaving_a_batch_early_cancels_its_requests(tiny_dir, tiny_loaded):
    config = make_config(tiny_dir, max_batch_size=2)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        async for item in engine.generate_batch([PROMPTS[0], PROMPTS[1], PROMPTS[2]], params):
            assert item
            break
        await _free(engine, config)     # two running and one queued, all ended
        with anyio.fail_after(10):
            while engine.front.num_live:
                await anyio.sleep(0.01)


async def test_a_bad_prompt_submits_none_of_the_batch(tiny_dir, tiny_loaded):
    async with AsyncEngine(make_config(tiny_dir), model=tiny_loaded) as engine:
        with pytest.raises(RequestError):
            async for _ in engine.generate_batch([PROMPTS[0], []]):
                pass
        assert engine.front.num_live == 0
        with pytest.raises(RequestError, match="2 prompts but 1 params"):
            async for _ in engine.generate_batch([PROMPTS[0], PROMPTS[1]],
                                                 [SamplingParams()]):
                pass
