"""A head with a reduced draft vocabulary (q = 0 outside it) keeps the target's
distribution under rejection sampling: per-position chi-square (tests/chi2.py), T = 1 and
T = 0.7 with top-p (and with the head computing in bf16). Drafts cover only every 4th
token id, so most accepted mass must come from residual sampling."""

import anyio
import pytest
import torch

from specloop.engine import AsyncEngine
from specloop.models.drafters import MtpEagleHead
from specloop.samplers import SamplingBatch, SamplingParams, compute_probs

from ..chi2 import chi2_statistic
from .conftest import make_config

PROMPT = [5, 17, 99, 3, 42, 17, 99]
N = 3000


def exact(loaded, params: SamplingParams):
    """p(t1) [V] and the marginal p(t2) [V] after PROMPT under ``params``."""
    model, V = loaded.model, loaded.args.vocab_size
    with torch.inference_mode():
        cache = model.make_cache(V, 64)
        prompt = torch.tensor([PROMPT])
        h = model(prompt, torch.tensor([0]), torch.tensor([0]), cache)
        p1 = compute_probs(model.logits(h[:, -1]), SamplingBatch.from_params([params], [0]))[0]
        seqs = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], dim=1)
        h = model(seqs, torch.zeros(V, dtype=torch.int64), torch.arange(V), cache)
        p2 = compute_probs(model.logits(h[:, -1]),
                           SamplingBatch.from_params([params] * V, list(range(V))))
    return p1.double(), (p1.double()[:, None] * p2.double()).sum(0)


@pytest.fixture(scope="module")
def reduced_head(tiny_loaded, tmp_path_factory):
    head = MtpEagleHead(tiny_loaded.model, dtype=torch.float64, device="cpu")
    head.init_random(seed=3)
    head.d2t = torch.arange(0, tiny_loaded.args.vocab_size, 4)
    path = tmp_path_factory.mktemp("head") / "reduced.safetensors"
    head.save(str(path))
    return path


@pytest.mark.slow
@pytest.mark.usefixtures("batched_prefill")   # tests/engine/conftest.py: why
@pytest.mark.parametrize("temperature, top_p, draft_dtype", [
    (1.0, 1.0, "auto"), (0.7, 0.9, "auto"),
    # The head computing in bf16 (a CPU's speculative.draft_dtype): q from its logits.
    (0.7, 0.9, "bfloat16")])
async def test_reduced_vocab_rejection_sampling_is_exact(tiny_dir, tiny_loaded, reduced_head,
                                                         temperature, top_p, draft_dtype):
    config = make_config(tiny_dir, method="mtp_eagle", k=3, rejection=True,
                         max_batch_size=64, speculative={"draft_weights": str(reduced_head),
                                                         "draft_dtype": draft_dtype})
    firsts, seconds = [], []

    async def one(engine, i):
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=i, max_tokens=2,
                                ignore_eos=True)
        toks = [t async for out in engine.generate(PROMPT, params) for t in out.token_ids]
        firsts.append(toks[0])
        seconds.append(toks[1])

    async with AsyncEngine(config, model=tiny_loaded) as engine:
        drafter = engine.worker.drafter
        assert drafter.lm.weight.shape[0] == tiny_loaded.args.vocab_size // 4
        limiter = anyio.CapacityLimiter(256)

        async def limited(i):
            async with limiter:
                await one(engine, i)
        async with anyio.create_task_group() as tg:
            for i in range(N):
                tg.start_soon(limited, i)
        stats = engine.stats
    assert 0 < stats.acceptance_rate < 1
    p1, p2 = exact(tiny_loaded, SamplingParams(temperature=temperature, top_p=top_p))
    for pos, (samples, p) in enumerate([(torch.tensor(firsts), p1),
                                        (torch.tensor(seconds), p2)]):
        chi2, limit = chi2_statistic(samples, p)
        assert chi2 < limit, f"position {pos + 1}: chi2 {chi2:.1f} >= {limit:.1f}"


def test_reduced_vocab_q_is_zero_outside(tiny_loaded):
    """The draft head's logits are -inf off the draft vocabulary, its argmax inside it."""
    from specloop.models.drafters import DraftHead
    d2t = torch.tensor([3, 7, 50, 200])
    lm = DraftHead(tiny_loaded.model.lm_head_weight, lm_head_tp=False, max_rows=2, d2t=d2t)
    hidden = torch.randn(2, tiny_loaded.args.hidden_size, dtype=torch.float64)
    logits = lm.logits(hidden)
    off = torch.ones(tiny_loaded.args.vocab_size, dtype=torch.bool)
    off[d2t] = False
    assert torch.isinf(logits[:, off]).all()
    torch.testing.assert_close(logits[:, d2t], (hidden @ tiny_loaded.model.lm_head_weight[d2t].T)
                               .float())
    assert set(logits.argmax(-1).tolist()) <= set(d2t.tolist())
