"""The shipped SmolLM2 head (eagle3) on the real weights (CPU, fp32): greedy with speculation equals
greedy without, token for token, 5 prompts x 48 tokens, K in {1, 3, 5}; one reference run
shared by every K."""

import anyio
import pytest

from specloop.engine import AsyncEngine, EngineConfig
from specloop.samplers import SamplingParams

from ..smollm2 import PROMPTS

pytestmark = pytest.mark.slow
NEW = 48
# The shipped heads by method (one: each head file travels in every device call's tree).
HEADS = {"eagle3": "smollm2-135m-instruct-eagle3"}


def config(method="none", k=1, **spec):
    return EngineConfig.from_dict({
        "model": {"name": "smollm2-135m-instruct", "dtype": "float32", "max_seq_len": 512},
        "scheduler": {"max_batch_size": 8},
        "speculative": {"method": method, "num_draft_tokens": k, **spec}})


async def run(cfg, loaded):
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW)
    outs = {}
    async with AsyncEngine(cfg, model=loaded) as engine:
        async def one(i):
            outs[i] = [t async for o in engine.generate(PROMPTS[i], greedy) for t in o.token_ids]
        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(one, i)
        return [outs[i] for i in range(len(PROMPTS))], engine.stats


@pytest.fixture(scope="module")
def reference(smollm2):
    return anyio.run(run, config(), smollm2)[0]


@pytest.mark.parametrize("method", list(HEADS))
@pytest.mark.parametrize("k", [1, 3, 5])
async def test_trained_head_greedy_equals_no_speculation(smollm2, reference, k, method):
    outs, stats = await run(config(method, k, draft_weights=HEADS[method]), smollm2)
    assert outs == reference
    assert stats.num_accepted_tokens > 0       # the trained head's drafts do get accepted
