"""Batched self-distillation (train/_batched.py) answers as the target does: greedy rows
token for token as the engine's greedy answers; sampled rows from softmax(logits / T)."""

import anyio
import pytest
import torch

from specloop.engine import AsyncEngine, EngineConfig
from specloop.models import load_model
from specloop.models.testing import write_tiny_checkpoint
from specloop.samplers import SamplingParams
from specloop.samplers._stats import chi2_samples
from specloop.train._batched import _sample, distill_batched
from specloop.train._progress import _Silent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("b") / "m", vocab_size=384,
                                 num_layers=2, hidden=64, seed=11)
    return path, load_model(path, dtype=torch.float64)


def _engine_greedy(path, loaded, prompts, max_tokens):
    config = EngineConfig.from_dict({
        "model": {"name": str(path), "dtype": "float64", "device": "cpu", "max_seq_len": 96,
                  "chat_template": False},
        "scheduler": {"max_batch_size": 4, "seed": 0}, "speculative": {"method": "none"}})
    answers = [[] for _ in prompts]

    async def main():
        async with AsyncEngine(config, model=loaded) as engine:
            async def one(i):
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
                async for out in engine.generate(prompts[i], params):
                    answers[i].extend(out.token_ids)
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)

    anyio.run(main)
    return answers


def test_greedy_waves_equal_the_engines_answers(tiny):
    path, loaded = tiny
    gen = torch.Generator().manual_seed(2)
    # Lengths differ (right padding within a wave), and 7 jobs in waves of 3 (a short wave).
    prompts = [torch.randint(3, 384, (n,), generator=gen).tolist()
               for n in (5, 9, 2, 14, 7, 3, 11)]
    jobs = [(p, 0.0, 0) for p in prompts]
    got = distill_batched(loaded, jobs, batch_size=3, max_new_tokens=20, max_seq_len=96,
                          time_budget_s=1e6, seed=0, bar=_Silent())
    want = _engine_greedy(path, loaded, prompts, 20)
    eos = loaded.tokenizer.eos_token_ids
    for g, w in zip(got, want):
        # The engine stops at EOS without returning it when it is a stop token.
        assert g[:len(w)] == w and (len(g) == len(w) or (len(g) == len(w) + 1 and g[-1] in eos))


@pytest.mark.parametrize("temperature, assumed, passes", [(0.7, 0.7, True), (1.0, 0.7, False)])
def test_sampled_rows_follow_the_tempered_softmax(temperature, assumed, passes):
    """Chi-square of 20,000 draws against softmax(logits / assumed); the biased twin draws
    at T = 1 but is judged against T = 0.7 and must fail."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    n = 20_000
    draws = _sample(logits.expand(n, -1), torch.full((n,), temperature),
                    torch.Generator().manual_seed(0))
    result = chi2_samples(draws, torch.softmax(logits / assumed, -1))
    assert result.passed == passes, result.as_dict()
