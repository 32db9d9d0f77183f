"""The engine on SmolLM2-135M-Instruct (fp32): against transformers, and spec == no spec."""

import anyio
import pytest

from specloop.engine import AsyncEngine, EngineConfig
from specloop.samplers import SamplingParams

from ..smollm2 import NEW_TOKENS, PROMPTS

# The first test may also convert the GGUF and compute the session's shared reference.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

NEW = NEW_TOKENS
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW)


@pytest.fixture(scope="module")
def reference(smollm2_engine_reference):
    """The session's transformers tokens, cut after the first EOS (tests/conftest.py)."""
    return smollm2_engine_reference


def config(method="none", k=3, **spec):
    return EngineConfig.from_dict({
        "model": {"name": "smollm2-135m-instruct", "dtype": "float32", "max_seq_len": 512},
        "scheduler": {"max_batch_size": 8},
        "speculative": {"method": method, "num_draft_tokens": k, **spec}})


async def run(cfg, loaded):
    async with AsyncEngine(cfg, model=loaded) as engine:
        outs = {}

        async def one(i):
            outs[i] = [t async for o in engine.generate(PROMPTS[i], GREEDY)
                       for t in o.token_ids]
        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(one, i)
        return [outs[i] for i in range(len(PROMPTS))], engine.stats


async def test_no_speculation_equals_transformers_generate(smollm2, reference):
    outs, _ = await run(config(), smollm2)
    assert outs == reference
    assert sum(len(o) for o in outs) > 3 * NEW   # most prompts run the full 32


# Each case is a SmolLM2 engine run (~20 s of CPU); K = 5 is covered by the draft-model
# case below, the trained heads' cases (tests/train/test_smollm2_heads.py) and the tiny
# model's drafter tests.
@pytest.mark.parametrize("method, k", [("ngram", 1), ("ngram", 3), ("early_exit", 3)])
async def test_speculation_equals_no_speculation(smollm2, reference, method, k):
    outs, stats = await run(config(method, k), smollm2)
    assert outs == reference
    assert stats.num_draft_tokens > 0


# The longest chain: every one of the 5 positions must be accepted (the shorter K run the
# same code over a prefix of these positions).
@pytest.mark.parametrize("k", [5])
async def test_draft_model_equal_to_target_accepts_all(smollm2, reference, k):
    outs, stats = await run(config("draft_model", k, draft_model="smollm2-135m-instruct"),
                            smollm2)
    assert outs == reference
    assert stats.acceptance_rate == 1.0
    # Requests end at NEW tokens, so the last round of each may be cut short.
    assert stats.mean_acceptance_length > k
