from __future__ import annotations

import anyio
import pytest
import torch

from specloop.engine import AsyncEngine, EngineConfig
from specloop.engine._runner import ModelRunner
from specloop.models import load_model
from specloop.models.drafters._mtp import MtpEagleDrafter
from specloop.models.testing import write_tiny_checkpoint

# float64: greedy comparisons across batch shapes must not flip on rounding near-ties.
TINY_DTYPE = "float64"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "target", vocab_size=384,
                                 num_layers=4, hidden=64, seed=1)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory):
    # A different random model sharing the tokenizer: a weak drafter, so drafts get rejected.
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "draft", vocab_size=384,
                                 num_layers=1, hidden=32, num_heads=2, num_kv_heads=1,
                                 intermediate=64, seed=2)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_dir):
    return load_model(tiny_dir, dtype=torch.float64)


@pytest.fixture
def batched_prefill(monkeypatch):
    """Every engine the test builds prefills the requests admitted together in shared
    forwards, the target's and the MTP/EAGLE-3 head's (``batch_prefill``, the GPU's
    default; the CPU's, one forward per request, is what every other engine test runs).
    For the chi-square tests: their thousands of requests of one short prompt spent ~40%
    of their CPU in one prefill forward each (test_exactness and the K-change case: 41 s
    -> 26 s with the target's shared). What they test, the sampled tokens' distribution,
    does not depend on how the prompt's forwards were batched (the same tokens and drafts
    as one forward per request: tests/engine/test_prefill_batch.py,
    tests/graphs/test_chain.py's shared head prefill)."""
    for cls in (ModelRunner, MtpEagleDrafter):
        monkeypatch.setattr(cls, "__init__", _batching(cls.__init__))


def _batching(init):
    def batched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.batch_prefill = True
    return batched


def make_config(model_dir, *, method="none", k=3, max_batch_size=4, max_seq_len=256,
                draft_model=None, rejection=False, **sections) -> EngineConfig:
    spec = {"method": method, "num_draft_tokens": k, "use_rejection_sampling": rejection}
    if draft_model is not None:
        spec["draft_model"] = str(draft_model)
    data = {
        "model": {"name": str(model_dir), "dtype": TINY_DTYPE, "device": "cpu",
                  "max_seq_len": max_seq_len, "chat_template": False},
        "scheduler": {"max_batch_size": max_batch_size, "max_num_tokens": 512},
        "speculative": {**spec, **sections.pop("speculative", {})},
    }
    data.update(sections)
    return EngineConfig.from_dict(data)


def write_gloo_config(path, model, *, max_seq_len=256, collective_timeout_s=None):
    """A TOML config for 2 torch.distributed (gloo) ranks with ADP and n-gram drafting, as
    the CLI reads it under torchrun; returns ``path``."""
    timeout = "" if collective_timeout_s is None else \
        f"collective_timeout_s = {collective_timeout_s}\n"
    path.write_text(f"""
[model]
name = "{model}"
device = "cpu"
max_seq_len = {max_seq_len}
chat_template = false

[speculative]
method = "ngram"

[parallel]
world_size = 2
attention_dp = true
{timeout}
[components]
communicator = "torch_distributed"
""")
    return path


async def collect(engine: AsyncEngine, prompt, params, **kw) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(prompt, params, **kw):
        tokens.extend(out.token_ids)
    return tokens


async def serve_staggered(engine: AsyncEngine, reqs) -> list[list[int]]:
    """Each (prompt, params, delay) submitted after its delay, all concurrently; the tokens
    of each, in order."""
    results: dict[int, list[int]] = {}

    async def one(i, prompt, params, delay):
        await anyio.sleep(delay)
        results[i] = await collect(engine, prompt, params, request_id=f"r{i}")

    async with anyio.create_task_group() as tg:
        for i, (prompt, params, delay) in enumerate(reqs):
            tg.start_soon(one, i, prompt, params, delay)
    return [results[i] for i in range(len(reqs))]


PROMPTS = [
    [5, 17, 99, 3, 42],
    [200, 201, 202, 203, 200, 201, 202],
    [7],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
    [300, 5, 300, 5, 300],
]
