"""The shipped SmolLM2 heads (eagle3 and mtp_eagle) on the real weights (CPU, fp32): greedy
with speculation equals transformers' greedy, token for token, 5 prompts x 48 tokens (the
session's long reference, whose prefix tests/engine/test_smollm2_engine.py uses), K in
{1, 3, 5}."""

import anyio
import pytest

from specloop.engine import AsyncEngine, EngineConfig
from specloop.samplers import SamplingParams

from ..smollm2 import HEAD_TOKENS, PROMPTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
NEW = HEAD_TOKENS
# The shipped heads by method.
HEADS = {"eagle3": "smollm2-135m-instruct-eagle3", "mtp_eagle": "smollm2-135m-instruct-eagle"}


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


# K = 1 is the one-draft edge; K = 3 is the embedded default's; K = 5 the longest chain the
# heads were evaluated at. Issue 13 asks for every trained head at K in {1, 3, 5}.
@pytest.mark.parametrize("method", list(HEADS))
@pytest.mark.parametrize("k", [1, 3, 5])
async def test_trained_head_greedy_equals_transformers(smollm2, smollm2_engine_reference_long,
                                                     k, method):
    outs, stats = await run(config(method, k, draft_weights=HEADS[method]), smollm2)
    assert outs == smollm2_engine_reference_long
    assert stats.num_accepted_tokens > 0       # the trained head's drafts do get accepted



# The tree of 15 nodes, depth 3, fitted on held-out prompts 200-263 (docs/configuration.md,
# "Draft trees"; bench/results/cpu_1204_tree_fit_200_263.json): all-greedy batches draft
# and verify it, on the CPU's reference path. Siblings at every depth: greedy must still
# be transformers' token for token.
TREE = [[0], [1], [2], [3], [4], [5], [0, 0], [0, 1], [0, 2], [1, 0], [2, 0], [0, 0, 0],
        [0, 0, 1], [0, 1, 0], [1, 0, 0]]


async def test_eagle3_with_a_draft_tree_equals_transformers(smollm2,
                                                            smollm2_engine_reference_long):
    outs, stats = await run(config("eagle3", 3, draft_weights=HEADS["eagle3"], tree=TREE),
                            smollm2)
    assert outs == smollm2_engine_reference_long
    assert stats.num_accepted_tokens > 0
