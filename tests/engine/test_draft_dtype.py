"""``speculative.draft_dtype``: a draft head computing in another dtype than the target
(bfloat16 on a CPU: half the bytes a draft step reads). Drafts need no exactness, so
greedy still equals greedy without speculation and seeded sampled rows what one rank
emits; the head's own weights, cache and LM-head copy take the dtype while the
embedding and LM head it shares with the target stay the target's; under LM-head TP
every rank, an idle one too, enters the collectives with tensors of one dtype."""

from types import SimpleNamespace

import pytest
import torch

from specloop.engine import AsyncEngine
from specloop.engine._errors import ConfigError
from specloop.models.drafters import _mtp
from specloop.models.drafters._errors import DrafterConfigError

from .conftest import make_config, serve_staggered
from .test_engine import reference_greedy
from .test_tree_engine import TREE, head_file, requests, run, tree_config  # noqa: F401


def _target(device="cpu", dtype=torch.float32):
    return SimpleNamespace(device=torch.device(device), dtype=dtype)


@pytest.mark.parametrize("native, target_dtype, want", [
    (True, torch.float32, torch.bfloat16),      # a CPU with bf16 GEMMs: half the bytes
    (False, torch.float32, torch.float32),      # emulated bf16 would be slower
    (True, torch.float64, torch.float64),       # the tests' reference target keeps its own
])
def test_auto_is_bf16_for_a_float32_target_on_a_cpu_with_bf16_gemms(monkeypatch, native,
                                                                     target_dtype, want):
    monkeypatch.setattr(_mtp, "bf16_packing_available", lambda: native)
    assert _mtp.draft_dtype("auto", _target(dtype=target_dtype)) == want
    assert _mtp.draft_dtype("float32", _target(dtype=target_dtype)) == torch.float32


def test_auto_on_cuda_is_the_targets_dtype_and_another_is_refused():
    assert _mtp.draft_dtype("auto", _target("cuda", torch.bfloat16)) == torch.bfloat16
    assert _mtp.draft_dtype("bfloat16", _target("cuda", torch.bfloat16)) == torch.bfloat16
    with pytest.raises(DrafterConfigError, match="target's bfloat16 on CUDA") as info:
        _mtp.draft_dtype("float32", _target("cuda", torch.bfloat16))
    assert info.value.field == "speculative.draft_dtype"


def test_an_unknown_draft_dtype_is_refused_by_the_config(tiny_dir):
    with pytest.raises(ConfigError, match="bfloat16") as info:
        make_config(tiny_dir, method="eagle3", speculative={"draft_dtype": "int8"})
    assert info.value.field == "speculative.draft_dtype"


@pytest.mark.parametrize("tree, dtype", [(None, "bfloat16"), (TREE, "bfloat16"),
                                         (TREE, "float16"), (None, "float32")])
async def test_a_narrower_head_on_a_float64_target_keeps_greedy_exact(tiny_dir, tiny_loaded,
                                                                      head_file,  # noqa: F811
                                                                      tree, dtype):
    """Chain and tree: outputs equal greedy without speculation, drafts are accepted, and
    only the head's own tensors take the dtype (the shared embedding is the target's
    object)."""
    reqs = [(p, prm, d) for p, prm, d in requests() if prm.is_greedy]
    config = tree_config(tiny_dir, head_file, tree=tree, draft_dtype=dtype)
    want = getattr(torch, dtype)
    embed = tiny_loaded.model.embed_tokens
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        drafter = engine.worker.drafter
        own = drafter.head.own_state()
        assert own and all(t.dtype == want for n, t in own.items() if n != "d2t")
        assert drafter.cache.dtype == drafter.lm.weight.dtype == want
        assert drafter.head.block.embed_tokens is embed and embed.dtype == torch.float64
        outs = await serve_staggered(engine, reqs)
        stats = engine.stats
    for (prompt, params, _), out in zip(reqs, outs):
        assert out == reference_greedy(tiny_loaded, prompt, params.max_tokens)
    assert stats.num_accepted_tokens > 0


@pytest.mark.parametrize("tree", [None, TREE])
async def test_a_bf16_head_under_lm_head_tp_equals_one_rank(tiny_dir, tiny_loaded, head_file,
                                                            tree):  # noqa: F811
    """Two LocalGroup ranks of 2 rows with LM-head TP, greedy and seeded sampled requests
    (rejection sampling: a batch that samples drafts the chain on its own head): rank 0's
    outputs equal one rank's with the same bf16 head, and the group never mismatched —
    LocalGroup checks each collective's dtype, so a rank entering the LM head's
    all_gather with rows of the target's dtype (an idle one's empty rows) fails it."""
    from .test_adp import run_group

    reqs = requests(sampled_every=3)
    one, _, _ = await run(tree_config(tiny_dir, head_file, tree=tree, rejection=True,
                                      draft_dtype="bfloat16"), tiny_loaded, reqs)
    config = make_config(tiny_dir, method="eagle3", k=3, max_batch_size=2, rejection=True,
                         speculative={"draft_weights": str(head_file), "tree": tree,
                                      "draft_dtype": "bfloat16"},
                         parallel={"world_size": 2, "attention_dp": True,
                                   "lm_head_tp_in_adp": True})
    results, _ = await run_group(2, config, tiny_loaded,
                                 lambda engine: serve_staggered(engine, reqs), timeout=30.0)
    assert results[0] == one
