"""The chained step's draft graph writes its VERIFY's next inputs (``tokens``,
``start_pos``) into that VERIFY's own static inputs (graphs/_capture.into_verify_inputs),
and the chain hands VERIFY those very tensors, so its replay copies nothing for them.

On the CPU, with a cache that replays as ``CudaGraphCache`` does (an input is copied only
when its tensor was not handed in last time and is not the static itself: a copy skipped
wrongly would leave VERIFY another step's tokens) and whose outputs are the tensors the
capture-time call returned (a CUDA graph's static outputs, persistent buffers included):
outputs equal the eager engine's token for token, and VERIFY's tokens are never copied
at a chained replay."""

import attrs
import pytest
import torch

from specloop.graphs import CudaGraphCache
from specloop.graphs._cache import inputs_written
from specloop.graphs._capture import into_verify_inputs
from specloop.graphs._cuda import _Captured

from ..engine import planted
from .test_chain import CHAINING_SPECS, chain_config, requests, same_drafts, serve

# VERIFY replays at K > 0 whose tokens and positions were handed in as the static inputs
# themselves (nothing copied), and all VERIFY replays at K > 0.
HANDED = {"static": 0, "all": 0}


class _Replayed:
    """A captured step's stand-in for torch.cuda.CUDAGraph: replay() runs the step on the
    static inputs and writes its results into the capture-time outputs."""

    def __init__(self, step, inputs, outputs):
        self.step, self.inputs, self.outputs = step, inputs, outputs

    def replay(self) -> None:
        for name, made in self.step(self.inputs).items():
            if made is not self.outputs[name]:
                self.outputs[name].copy_(made)


class GraphLikeCache(CudaGraphCache):
    def capture(self, key, step, example) -> None:
        if self.sealed:
            raise RuntimeError("capture after warmup")
        inputs = {name: t.clone() for name, t in example.items()}
        outputs = step(inputs)
        self._graphs[key] = _Captured(_Replayed(step, inputs, outputs), inputs, outputs,
                                      inputs_written(step))

    def replay(self, key, inputs):
        captured = self._graphs[key]
        if inputs is not None and key.stage == "verify" and key.num_draft_tokens:
            HANDED["all"] += 1
            HANDED["static"] += all(inputs[name] is captured.inputs[name]
                                    for name in ("tokens", "start_pos"))
        return super().replay(key, inputs)


def test_draft_step_writes_verify_inputs():
    verify_in = {"tokens": torch.zeros(2, 3, dtype=torch.int64),
                 "start_pos": torch.zeros(2, dtype=torch.int64),
                 "slots": torch.zeros(2, dtype=torch.int64)}

    def draft(inputs):
        return {"token_ids": inputs["x"][:, :2], "tokens": inputs["x"] + 1,
                "start_pos": inputs["x"][:, 0] * 10, "slots": torch.ones(3)}

    step = into_verify_inputs(draft, verify_in)
    out = step({"x": torch.tensor([[1, 2, 3], [4, 5, 6]])})
    assert out["tokens"] is verify_in["tokens"] and out["start_pos"] is verify_in["start_pos"]
    assert verify_in["tokens"].tolist() == [[2, 3, 4], [5, 6, 7]]
    assert verify_in["start_pos"].tolist() == [10, 40]
    # Another shape or dtype than VERIFY's input: left as the step made it (copied at the
    # replay).
    assert out["slots"] is not verify_in["slots"] and verify_in["slots"].tolist() == [0, 0]
    assert out["token_ids"].tolist() == [[1, 2], [4, 5]]
    # No VERIFY input of those names: the step itself.
    assert into_verify_inputs(draft, {"seeds": verify_in["slots"]}) is draft

    # A step that writes them there itself (DraftGraphStep's outputs_into): handed the
    # targets, it returns them, and nothing is copied over what it wrote.
    from specloop.models.drafters._protocol import DraftGraphStep
    seen = []

    def writes(inputs, into):
        seen.append(sorted(into))
        tokens = into.get("tokens", torch.empty(2, 3, dtype=torch.int64))
        torch.add(inputs["x"], 2, out=tokens)
        return {"tokens": tokens, "start_pos": inputs["x"][:, 0] * 100}

    own = DraftGraphStep(writes)({"x": torch.tensor([[1, 2, 3], [4, 5, 6]])})
    assert seen == [[]] and own["tokens"] is not verify_in["tokens"]
    step = into_verify_inputs(DraftGraphStep(writes), verify_in)
    out = step({"x": torch.tensor([[1, 2, 3], [4, 5, 6]])})
    assert seen[-1] == ["slots", "start_pos", "tokens"]
    assert out["tokens"] is verify_in["tokens"] and out["start_pos"] is verify_in["start_pos"]
    assert verify_in["tokens"].tolist() == [[3, 4, 5], [6, 7, 8]]
    assert verify_in["start_pos"].tolist() == [100, 400]    # not written: copied


@pytest.mark.parametrize("spec", CHAINING_SPECS)
async def test_chained_verify_takes_the_draft_graphs_writes(tiny_dir, tiny_loaded, spec):
    from specloop.engine import EngineConfig

    reqs = requests()
    eager, _ = await serve(chain_config(tiny_dir, False, **spec), tiny_loaded, reqs, False)
    cfg = chain_config(tiny_dir, True, **spec).to_dict()
    cfg["components"]["graph_cache"] = "tests.graphs.test_chain_into_verify:GraphLikeCache"
    planted.RECORDERS.clear()
    HANDED.update(static=0, all=0)
    plain, _ = await serve(EngineConfig.from_dict(cfg), tiny_loaded, reqs, False)
    assert HANDED["static"] == 0 < HANDED["all"]    # unchained: fresh inputs, copied
    HANDED.update(static=0, all=0)
    chained, chain = await serve(EngineConfig.from_dict(cfg), tiny_loaded, reqs, True)
    assert chained == plain == eager
    same_drafts(chain, spec["k"])
    # Every chained step handed its VERIFY the tensors its draft graph wrote (no copy);
    # the other VERIFYs (unchained iterations) copied theirs.
    assert 0 < HANDED["static"] == chain.queued_steps < HANDED["all"]


async def test_draft_graphs_write_into_their_verify_inputs(tiny_dir, tiny_loaded):
    """After warm-up, each drafting key's draft graph outputs VERIFY's tokens and
    positions as that key's VERIFY static inputs."""
    from specloop.engine import AsyncEngine, EngineConfig

    cfg = chain_config(tiny_dir, True, method="eagle3", k=3, rejection=True).to_dict()
    cfg["components"]["graph_cache"] = "tests.graphs.test_chain_into_verify:GraphLikeCache"
    async with AsyncEngine(EngineConfig.from_dict(cfg), model=tiny_loaded) as engine:
        cache = engine.worker.graph_cache
        keys = [key for key in cache._graphs if key.stage == "verify"
                and key.num_draft_tokens]
        assert keys
        for key in keys:
            drafted = cache._graphs[attrs.evolve(key, stage="draft")].outputs
            for name in ("tokens", "start_pos"):
                assert drafted[name] is cache.static_inputs(key)[name], (key, name)


async def _chain_host_copies(tmp_path, monkeypatch, method, k, batch, iterations,
                             steady=False):
    """``bench/bench_chain_host.py``'s engine on its tiny model, chained as on one CUDA
    rank: -> (requests that ended, copies into the graphs' inputs an iteration by input)."""
    from pathlib import Path

    from specloop.models import load_model
    from specloop.models.testing import write_tiny_checkpoint

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    import bench_chain_host as bench

    path = write_tiny_checkpoint(tmp_path, vocab_size=384, num_layers=2, hidden=64, seed=1)
    loaded = load_model(path, dtype=torch.float32)
    *_, ended, copied = await bench.measure(bench.config(path, method, k, batch), loaded,
                                            batch, iterations, None, steady=steady)
    return ended, copied


async def test_what_a_chained_iteration_copies_under_a_servers_load(tmp_path, monkeypatch):
    """``bench/bench_chain_host.py``'s engine (the chain forced on, a cache whose replays
    copy inputs as ``CudaGraphCache``'s and count the copies) under a server's load at
    batch 8: each iteration without a joiner copies VERIFY n's rows into the draft graph
    (``verified``, ``cu_hidden``; one taking a joiner writes them, and the joiner's, into
    its static inputs: ``DeviceChain._joined_into``) and, at a join, the batch's ``meta``
    and ``slots``; not the sampling columns of an all-greedy batch (new views of the same
    tensors at each join copied all six before), nor VERIFY's tokens and positions (the
    draft graph writes them in VERIFY's own inputs). 13.8 copies an iteration at batch 32
    before the first two changes, 3.4 after, ~2.9 with joiners written in place."""
    from specloop.samplers import SamplingBatch

    ended, copied = await _chain_host_copies(tmp_path, monkeypatch, "eagle3", 3, 8, 120,
                                             steady=True)
    assert ended > 0                                    # requests ended and joined
    assert not set(copied) & {*SamplingBatch.COLUMNS, "tokens", "start_pos"}, copied
    assert 0.5 < copied["verified"] < 0.95 and copied["cu_hidden"] == copied["verified"]
    assert 0 < copied.get("meta", 0) < 1
    assert sum(copied.values()) < 3.5, copied


GRAPH_LIKE = "tests.graphs.test_chain_into_verify:GraphLikeCache"


@pytest.mark.parametrize("max_batch_size", [8, 2])     # 2: requests wait, slots reused
async def test_chained_ngram_takes_the_draft_graphs_writes(tiny_dir, tiny_loaded,
                                                          max_batch_size):
    """n-gram's draft graph also writes VERIFY's ``slots``: the chained engine equals the
    eager one, and every chained step handed VERIFY the draft graph's writes."""
    from specloop.engine import EngineConfig

    from .test_ngram_chain import ngram_config, ngram_requests

    reqs = ngram_requests()
    eager, _ = await serve(ngram_config(tiny_dir, False, max_batch_size), tiny_loaded, reqs,
                           False)
    cfg = ngram_config(tiny_dir, True, max_batch_size).to_dict()
    cfg["components"]["graph_cache"] = GRAPH_LIKE
    HANDED.update(static=0, all=0)
    chained, chain = await serve(EngineConfig.from_dict(cfg), tiny_loaded, reqs, True)
    assert chained == eager
    assert 0 < HANDED["static"] == chain.queued_steps < HANDED["all"]


@pytest.mark.parametrize("rows", [1, 3])
async def test_chained_ngram_through_k0_takes_the_draft_graphs_writes(tiny_dir, tiny_loaded,
                                                                     rows):
    """Adaptive n-gram in and out of K = 0 stretches, where the K = 0 VERIFY graph also
    writes its own next inputs (a step queued ahead right after a chained K = 0 step
    replays it on them): on the cache that replays as ``CudaGraphCache``, the outputs
    equal the unchained engine's, greedy and seeded sampled rows."""
    from specloop.samplers import SamplingParams

    from .test_ngram_chain import adaptive_chain_run, ngram_requests

    pattern = [2, 0, 0, 0, 3, 0, 0, 3, 1, 0, 0]
    params = [SamplingParams(temperature=0.0, max_tokens=60 - 13 * i, ignore_eos=True)
              if i % 2 == 0 else SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i,
                                                max_tokens=60 - 13 * i, ignore_eos=True)
              for i in range(rows)]
    reqs = [([300, 5, 300, 5, 300, 5, 300, 5][i:], params[i]) for i in range(rows)]
    plain, _ = await adaptive_chain_run(tiny_dir, tiny_loaded, reqs, pattern, False,
                                        graph_cache=GRAPH_LIKE)
    chained, chain = await adaptive_chain_run(tiny_dir, tiny_loaded, reqs, pattern, True,
                                              graph_cache=GRAPH_LIKE)
    assert chained == plain and chain.k0_steps >= 3
    assert chain.worker.ahead.after_chain_steps > 0     # K = 0 steps fed by their graph
    more = ngram_requests()
    plain, _ = await adaptive_chain_run(tiny_dir, tiny_loaded, more, pattern + [2, 3], False,
                                        graph_cache=GRAPH_LIKE)
    chained, chain = await adaptive_chain_run(tiny_dir, tiny_loaded, more, pattern + [2, 3],
                                              True, graph_cache=GRAPH_LIKE)
    assert chained == plain and chain.taken_steps >= 5


async def test_what_a_chained_ngram_iteration_copies(tmp_path, monkeypatch):
    """n-gram K = 4 at batch 1 (``bench_chain_host.py --method ngram``): VERIFY n's tokens
    and counts and the step's ``meta`` go into the draft graph; VERIFY's tokens,
    positions and slots are the draft graph's writes (5 copies an iteration and an eager
    concatenation before, 3 now)."""
    _, copied = await _chain_host_copies(tmp_path, monkeypatch, "ngram", 4, 1, 80)
    assert copied == {"verified": 1.0, "accepted": 1.0, "meta": 1.0}, copied
