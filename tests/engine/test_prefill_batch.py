"""Requests admitted together share prefill forwards (``ModelRunner.prefill_many``, on by
default on a GPU): equal to one forward per request, token for token."""

import anyio
import pytest
import torch

from specloop.engine import AsyncEngine
from specloop.samplers import SamplingParams

from .conftest import make_config, serve_staggered

# Lengths 1 (nothing to prefill), 30 (over the 24-token budget: alone, in chunks) and
# short ones that share forwards, padded to the longest of their group.
LENGTHS = [5, 1, 9, 30, 3, 12, 7, 2]


@pytest.mark.parametrize("method", ["none", "mtp_eagle"])   # mtp_eagle reads the hidden
async def test_batched_prefill_equals_one_forward_per_request(tiny_dir, tiny_loaded, method):
    prompts = [[(11 * i + 7 * j) % 300 + 3 for j in range(n)] for i, n in enumerate(LENGTHS)]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + i, ignore_eos=True) if i % 2
              else SamplingParams(temperature=0.9, seed=i, max_tokens=6 + i, ignore_eos=True)
              for i in range(len(prompts))]

    async def run(batched):
        rows, hidden = [], {}       # forward sizes; the drafter's prefill input by prompt
        config = make_config(tiny_dir, method=method,
                             scheduler={"max_batch_size": 6, "max_num_tokens": 24})
        async with AsyncEngine(config, model=tiny_loaded) as engine:
            runner = engine.worker.runner
            runner.batch_prefill = batched
            forward_rows = runner._prefill_rows
            runner._prefill_rows = lambda group: rows.append(len(group)) or forward_rows(group)
            drafter = engine.worker.drafter
            if drafter is not None:
                prefill = drafter.prefill
                drafter.prefill = lambda slot, ids, h: (
                    hidden.__setitem__(tuple(ids), h.clone()), prefill(slot, ids, h))
            out = await serve_staggered(engine, [(p, q, 0) for p, q in zip(prompts, params)])
            await anyio.sleep(0.05)
            assert runner.pages.num_free == runner.pages.num_pages
        return out, rows, hidden

    (want, none, want_h), (got, rows, got_h) = await run(False), await run(True)
    assert got == want
    assert want_h.keys() == got_h.keys()
    for ids, h in want_h.items():       # drafts do not change the tokens: check the input
        assert h.shape == got_h[ids].shape and torch.allclose(h, got_h[ids], atol=1e-9)
    assert none == [] and max(rows) >= 2 and sum(rows) == len(LENGTHS) - 2


@pytest.mark.gpu
def test_batched_prefill_equals_single_on_the_fused_kernels(tmp_path):
    """bf16 on CUDA (the fused kernels): each request's hidden states and the K/V of its
    prompt positions from one padded forward equal its own forward's, to bf16 rounding."""
    from specloop.engine._request import Request
    from specloop.engine._runner import ModelRunner
    from specloop.models import load_model
    from specloop.models.testing import write_tiny_checkpoint

    loaded = load_model(write_tiny_checkpoint(tmp_path / "m", vocab_size=384, num_layers=2,
                                              hidden=64, seed=1),
                        dtype=torch.bfloat16, device="cuda")
    lengths = [5, 40, 17, 1, 33, 16]

    def run(batched):
        runner = ModelRunner(loaded, num_slots=8, max_seq_len=128, max_prefill_tokens=512)
        runner.batch_prefill = batched
        requests = [Request(f"r{i}", (), None, 0, [(13 * i + j) % 380 + 1 for j in range(n)],
                            slot=7 - i) for i, n in enumerate(lengths)]
        hidden = runner.prefill_many(requests)
        kv = []
        for r in requests:      # the written prompt positions, gathered through the pages
            pages = torch.tensor(runner.pages.pages_of(r.slot), device="cuda")
            n = r.seq_len - 1
            kv.append(torch.stack([runner.cache.k[:, pages], runner.cache.v[:, pages]])
                      .flatten(2, 3)[:, :, :n].float())
        return [h.float() for h in hidden], kv

    (h1, kv1), (h2, kv2) = run(False), run(True)
    for a, b, ka, kb in zip(h1, h2, kv1, kv2):
        assert a.shape == b.shape and ka.shape == kb.shape
        assert torch.allclose(a, b, atol=3e-2, rtol=3e-2)
        assert torch.allclose(ka, kb, atol=3e-2, rtol=3e-2)
