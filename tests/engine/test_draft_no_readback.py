"""Drafters read the batch's slots and lengths from the host lists DRAFT passes, never
back from the device tensors (each such read is a device sync before VERIFY is queued)."""

import anyio
import pytest
import torch

import specloop.models.drafters as drafters
from specloop.engine import AsyncEngine
from specloop.samplers import SamplingParams

from .conftest import PROMPTS, collect, make_config


class _NoReadBack(torch.Tensor):
    """Refuses ``tolist`` on the guarded tensors themselves (results computed from them,
    read after VERIFY's own read-back, do not count)."""

    def tolist(self):
        if getattr(self, "guarded", False):
            raise AssertionError("a drafter read DraftContext.slots/seq_lens back")
        return super().tolist()


def _guard(tensor):
    tensor = tensor.as_subclass(_NoReadBack)
    tensor.guarded = True
    return tensor


@pytest.mark.parametrize("method", ["ngram", "draft_model", "early_exit", "mtp_eagle", "eagle3"])
def test_drafters_use_host_lists_and_stay_exact(monkeypatch, tiny_dir, tiny_draft_dir,
                                                tiny_loaded, method):
    real = drafters.DraftContext

    def guarded(**kw):
        if kw["token_ids"]:
            kw["slots"], kw["seq_lens"] = _guard(kw["slots"]), _guard(kw["seq_lens"])
        return real(**kw)

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def run(config):
        out = {}
        async with AsyncEngine(config, model=tiny_loaded) as engine:
            async def one(i, prompt):
                out[i] = await collect(engine, prompt, params)
            async with anyio.create_task_group() as tg:     # one batch of ragged rows
                for i, prompt in enumerate(PROMPTS[:4]):
                    tg.start_soon(one, i, prompt)
        return [out[i] for i in range(len(out))]

    expected = anyio.run(run, make_config(tiny_dir))
    monkeypatch.setattr(drafters, "DraftContext", guarded)
    draft = tiny_draft_dir if method == "draft_model" else None
    got = anyio.run(run, make_config(tiny_dir, method=method, draft_model=draft))
    assert got == expected
