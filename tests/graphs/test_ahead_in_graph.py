"""The step queued ahead with its inputs written inside the graph (no speculation, one GPU
rank's path on the CPU): the captured K = 0 step writes its token and next position into
its own static inputs, and a step queued ahead for an unchanged batch replays with none
(engine/_verify.py ``feeds_itself``, engine/_ahead.py). Replays here behave as CUDA
graphs do: static inputs, static outputs overwritten by the next replay."""

import anyio
import attrs
import pytest
import torch

from specloop.engine import AsyncEngine, EngineConfig
from specloop.engine._runner import ModelRunner
from specloop.engine._verify import ahead_inputs, make_verify_step, verify_inputs
from specloop.graphs import CudaGraphCache, GraphKey, SamplingPath
from specloop.graphs._cache import FeedsItself, inputs_written
from specloop.graphs._cuda import _Captured
from specloop.graphs._capture import graph_template
from specloop.samplers import DefaultSampler, RejectionResult, SamplingParams

from ..engine.conftest import PROMPTS, make_config, serve_staggered
from ..engine.test_adaptive_ahead import StaticOutputs
from ..engine.test_engine import reference_greedy

PAGE = 4        # small pages: steps queued ahead cross page boundaries often

STOPS = tuple(range(40, 80))        # ~10% of the vocabulary: rows end early
PARAMS = [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=STOPS),
          SamplingParams(temperature=0.9, seed=5, max_tokens=33, stop_token_ids=STOPS),
          SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
          SamplingParams(temperature=0.7, seed=9, max_tokens=40, stop_token_ids=STOPS),
          SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=2, max_tokens=40, stop_token_ids=STOPS),
          SamplingParams(temperature=0.0, max_tokens=38, ignore_eos=True)]
# Staggered: requests join while others run (a stretch ends, the next starts).
DELAYS = [0.0, 0.0, 0.0, 0.05, 0.1, 0.1, 0.3]


def config(tiny_dir):
    data = make_config(tiny_dir, max_batch_size=4, max_seq_len=64).to_dict()
    data["model"]["kv_page_size"] = PAGE
    data["components"]["graph_cache"] = "tests.engine.test_adaptive_ahead:StaticOutputs"
    data["graphs"] = {"batch_buckets": [4]}     # a leave keeps the key
    return EngineConfig.from_dict(data)


def check_written_inputs(worker, seen):
    """Before each replay with no inputs: the graph's static inputs equal what
    ``ahead_inputs`` would copy in for this batch (padding rows' positions and slots too);
    ``seen`` gets, per such step, whether a row writes the first position of a page, and
    None per step queued ahead with its inputs copied in."""
    queue_verify, cache = worker._queue_verify, worker.graph_cache

    def checked(rec, inputs=None, *, in_graph=False):
        if in_graph:
            static = cache.static_inputs(rec.key)
            last = cache._graphs[rec.key].outputs["token_ids"]
            want = ahead_inputs(rec.batch, last, range(len(rec.batch)),
                                worker._sampling_batch(rec.batch, rec.key.batch_size),
                                scratch_slot=worker.runner.cache.scratch_slot, device="cpu")
            real = len(rec.batch)       # a padding row's token: its own last one (any)
            assert torch.equal(static["tokens"][:real], want["tokens"][:real])
            for name in ("start_pos", "slots"):     # padding rows stay put
                assert torch.equal(static[name], want[name]), (name, static[name], want[name])
            seen.append(any(r.seq_len % PAGE == 0 for r in rec.batch))
        elif inputs is not None:    # queued ahead with its inputs copied in
            last = worker.ahead._replayed
            seen.append(None if last is None else (last[0] == rec.key, len(last[1]),
                                                   len(rec.batch)))
        return queue_verify(rec, inputs, in_graph=in_graph)
    worker._queue_verify = checked


async def serve(tiny_dir, loaded, *, inline, in_graph=True, reqs=None):
    seen = []
    async with AsyncEngine(config(tiny_dir), model=loaded) as engine:
        worker = engine.worker
        worker.verify_inline = worker.ahead.always = inline      # one CUDA rank's path
        worker.ahead.in_graph = in_graph
        check_written_inputs(worker, seen)
        if reqs is None:
            reqs = [(PROMPTS[i % len(PROMPTS)], p, d)
                    for i, (p, d) in enumerate(zip(PARAMS, DELAYS))]
        outs = await serve_staggered(engine, reqs)
        for _ in range(50):
            if worker.scheduler.num_requests == 0:
                break
            await anyio.sleep(0.01)
        pages = worker.runner.pages
        assert pages.num_free == pages.num_pages        # nothing leaked
        counts = (worker.ahead.taken_steps, worker.ahead.in_graph_steps)
    return outs, counts, seen


async def test_in_graph_inputs_equal_copied_inputs(tiny_dir, tiny_loaded):
    """Token for token: steps queued ahead with the inputs the graph wrote == with the
    inputs copied in == reading back before the next step; greedy and seeded sampled rows,
    requests joining and leaving mid-stretch (rows of the middle too), page boundaries
    crossed by the steps written in the graph, whose inputs equal the copied ones."""
    thread, _, _ = await serve(tiny_dir, tiny_loaded, inline=False)
    copied, (taken_c, in_graph_c), _ = await serve(tiny_dir, tiny_loaded, inline=True,
                                                   in_graph=False)
    written, (taken, in_graph), seen = await serve(tiny_dir, tiny_loaded, inline=True)
    assert written == copied == thread
    assert in_graph_c == 0 and taken_c >= 20
    # Most steps queued ahead were written in the graph; some (after a leave) were not.
    written_in_graph = [s for s in seen if isinstance(s, bool)]
    assert in_graph == len(written_in_graph) >= 20 and taken >= 20, (taken, in_graph)
    # Steps queued ahead after a leave, their inputs copied in (the same key: the
    # graph's inputs hold the leaver's row; test_first_row_leaves_mid_stretch for sure).
    assert any(s is not None and not isinstance(s, bool) for s in seen), seen
    assert any(written_in_graph) and not all(written_in_graph)  # page boundaries crossed
    for prompt, p, out in zip(PROMPTS * 2, PARAMS, written):
        if p.is_greedy:
            assert out == reference_greedy(tiny_loaded, prompt, p.max_tokens)


async def test_first_row_leaves_mid_stretch(tiny_dir, tiny_loaded):
    """Three greedy rows start together; the first stops on a token of its own (not by
    length, so a step is already queued ahead for all three): the rows left run under the
    same key with their inputs copied in, and every token equals reading back first."""
    ref = reference_greedy(tiny_loaded, PROMPTS[0], 30)
    at = next(i for i in range(8, 30) if ref.index(ref[i]) == i)
    greedy = [SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(ref[at],))] + \
        [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 2
    reqs = [(PROMPTS[i], p, 0.0) for i, p in enumerate(greedy)]
    thread, _, _ = await serve(tiny_dir, tiny_loaded, inline=False, reqs=reqs)
    written, _, seen = await serve(tiny_dir, tiny_loaded, inline=True, reqs=reqs)
    assert written == thread and written[0] == ref[:at + 1]
    assert (True, 3, 2) in seen and sum(s is True or s is False for s in seen) >= 10, seen


def test_replay_without_inputs_needs_a_step_that_feeds_itself(tiny_dir, tiny_loaded):
    """Only the K = 0 graphs write their next inputs: replaying another key without
    inputs is refused, as it is on the CUDA graph cache."""
    runner = ModelRunner(tiny_loaded, num_slots=2, max_seq_len=32, max_prefill_tokens=32)
    cache = StaticOutputs(buckets=[2])
    for k in (0, 2):
        key = GraphKey(2, k, SamplingPath.GREEDY, True)
        template = graph_template(key, "cpu")
        step = make_verify_step(runner, DefaultSampler(), template, advanced=False, kv_len=32,
                                feeds_itself=not k)
        assert inputs_written(step) == (("tokens", "start_pos") if not k else ())
        cache.capture(key, step, verify_inputs([], None, None, template, k=k,
                                               scratch_slot=runner.cache.scratch_slot,
                                               device="cpu"))
    cache.replay(GraphKey(2, 0, SamplingPath.GREEDY, True), None)
    with pytest.raises(RuntimeError, match="does not write its next inputs"):
        cache.replay(GraphKey(2, 2, SamplingPath.GREEDY, True), None)


def test_verify_step_packs_a_samplers_views_without_a_copy(tiny_loaded):
    """A sampler whose token_ids and num_accepted are views of one [B, K+2] tensor (what
    strict_verify's CUDA kernels return) gives the step's ``packed`` as that tensor; two
    separate tensors (the torch path) are concatenated."""
    runner = ModelRunner(tiny_loaded, num_slots=2, max_seq_len=32, max_prefill_tokens=32)

    @attrs.frozen
    class Packing(DefaultSampler):
        def verify(self, *args, **kw):
            r = DefaultSampler.verify(self, *args, **kw)
            packed = torch.cat([r.token_ids, r.num_accepted[:, None]], 1)
            return RejectionResult(token_ids=packed[:, :-1], num_accepted=packed[:, -1])

    key = GraphKey(2, 2, SamplingPath.GREEDY, True)
    template = graph_template(key, "cpu")
    inputs = verify_inputs([], None, None, template, k=2,
                           scratch_slot=runner.cache.scratch_slot, device="cpu")
    outs = [make_verify_step(runner, s, template, advanced=False, kv_len=32)(inputs)
            for s in (DefaultSampler(), Packing())]
    for out in outs:
        assert torch.equal(out["packed"], torch.cat([out["token_ids"],
                                                     out["num_accepted"][:, None]], 1))
    assert torch.equal(outs[0]["packed"], outs[1]["packed"])
    assert outs[1]["packed"].data_ptr() == outs[1]["token_ids"].data_ptr()
    assert outs[0]["packed"].data_ptr() != outs[0]["token_ids"].data_ptr()


class _StepAsGraph:
    """Stands in for a captured torch.cuda.CUDAGraph on the CPU: ``replay`` runs the step
    on the static inputs and writes the static outputs."""

    def __init__(self, step, inputs):
        self.step, self.inputs = step, inputs
        self.outputs = {n: t.clone() for n, t in step({n: t.clone() for n, t in
                                                        inputs.items()}).items()}

    def replay(self):
        for name, t in self.step(self.inputs).items():
            self.outputs[name].copy_(t)


def test_cuda_cache_copies_again_what_the_graph_wrote():
    """CudaGraphCache skips copying an input that is the very tensor it copied last time,
    except those the graph writes itself: replaying the same inputs twice runs the same
    step twice; ``replay(key, None)`` runs on what the graph wrote."""
    def fn(inputs):
        out = {"next": inputs["tokens"] * 2 + inputs["scale"]}
        inputs["tokens"].copy_(out["next"])
        return out
    step = FeedsItself(fn, ("tokens",))
    key = GraphKey(2, 0, SamplingPath.GREEDY, True)
    static = {name: torch.zeros(2, dtype=torch.int64) for name in ("tokens", "scale")}
    graph = _StepAsGraph(step, static)
    cache = CudaGraphCache(buckets=[2])
    cache._graphs[key] = _Captured(graph, static, graph.outputs, inputs_written(step))
    assert cache.feeds_itself(key)
    assert not cache.feeds_itself(GraphKey(2, 1, SamplingPath.GREEDY))
    inputs = {"tokens": torch.tensor([1, 2]), "scale": torch.tensor([10, 20])}
    assert cache.replay(key, inputs)["next"].tolist() == [12, 24]
    assert cache.replay(key, inputs)["next"].tolist() == [12, 24]      # copied again
    assert cache.replay(key, None)["next"].tolist() == [34, 68]         # what it wrote
    assert cache.replay(key, inputs)["next"].tolist() == [12, 24]
