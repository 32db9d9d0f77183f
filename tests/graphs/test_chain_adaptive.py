"""DRAFT and VERIFY chained on the device under adaptive K (engine/_chain.py at the next
iteration's K, taken early; engine/_ahead.py for K = 0), on the CPU with replays that
write static outputs as CUDA graphs do: the same K per iteration with and without the
chain gives the same tokens, drafts and verified rows, with K changing between
iterations (K > 0 to another K > 0 chained, K = 0 stretches queued ahead)."""

import pytest
import torch

from specloop.engine import AsyncEngine

from ..engine import planted
from ..engine.conftest import serve_staggered
from ..engine.test_adaptive import cycle_k
from .test_chain import (SEEDS, chain_config, one_rank_adaptive, requests, same_record,
                         unmatched)

# Chained steps at 3 -> 3, 3 -> 2, 2 -> 2, 2 -> 3, 3 -> 1, 1 -> 1, 1 -> 3; K = 0 after
# each kind; K = 0 -> 0 queued ahead.
PATTERN = [3, 3, 2, 2, 3, 1, 1, 3, 0, 0, 2, 0, 1, 3]


async def serve(tiny_dir, loaded, chained, pattern=PATTERN, drop=False, times=None):
    cfg = chain_config(tiny_dir, True, method="eagle3", k=3, rejection=True,
                       speculative={"adaptive": True})
    steps = {"taken": [], "queued": [], "ahead": 0}
    async with AsyncEngine(cfg, model=loaded) as engine:
        worker = engine.worker
        one_rank_adaptive(worker, chained, pattern)
        if times is not None:
            measured = worker.adaptive.measured
            worker.adaptive.measured = lambda s, full=None: (times.append(s), measured(s, full))
        if chained:
            chain, queue, take = worker.chain, worker.chain.queue, worker.chain.take
            if drop:
                # Every chained step dropped (as if a request joined each time), and
                # every other iteration queues none (as when one is about to join).
                chain.matches = lambda rec: bool(setattr(chain, "_chained", None))
                can_queue, calls = chain._can_queue, iter(range(10 ** 6))
                chain._can_queue = lambda rec, *a: next(calls) % 2 == 0 and can_queue(rec, *a)

            def queued(rec, pending, rows, k=None):
                hidden = queue(rec, pending, rows, k)
                steps["queued"].append(None if hidden is None else (rec.k, k))
                return hidden

            def taken():
                pending, rows = take()
                if pending is not None:
                    steps["taken"].append(steps["queued"][-1])
                return pending, rows
            chain.queue, chain.take = queued, taken
        outs = await serve_staggered(engine, [(p, params, 0) for p, params in requests()])
        steps["ahead"] = worker.ahead.taken_steps
    return outs, steps


async def test_chained_under_adaptive_equals_unchained(tiny_dir, tiny_loaded):
    planted.RECORDERS.clear()
    plain, plain_steps = await serve(tiny_dir, tiny_loaded, False)
    chained, steps = await serve(tiny_dir, tiny_loaded, True)
    assert chained == plain
    recorded_plain, recorded_chained = planted.RECORDERS
    dropped = sum(s is not None for s in steps["queued"]) - len(steps["taken"])
    for seed in SEEDS:
        for name in ("drafts", "verified"):
            # Each chained record is the plain run's next or an extra one (a dropped
            # chained step's).
            left, extra = unmatched(getattr(recorded_plain, name).get(seed, []),
                                    getattr(recorded_chained, name).get(seed, []), same_record)
            # A dropped step drafted and verified at most 3 positions per row.
            assert left == 0 and extra <= 3 * dropped, (name, seed, left, extra, dropped)
    # Chained steps were taken at a K change (the next K committed early), at an
    # unchanged K, and K = 0 stretches took their steps ahead.
    taken = steps["taken"]
    assert any(a != b for a, b in taken) and any(a == b for a, b in taken), taken
    assert steps["ahead"] > 0 and plain_steps["ahead"] > 0


@pytest.mark.parametrize("drop", [False, True])
async def test_dropped_chained_steps_are_not_timed(tiny_dir, tiny_loaded, drop):
    """K = 3 throughout: chained steps taken make timed iterations; when every chained
    step is dropped (the device ran it besides the iteration's own step), no iteration is
    timed: each either dropped one or is the first of a stretch (the next one queued)."""
    times = []
    outs, steps = await serve(tiny_dir, tiny_loaded, True, pattern=[3], drop=drop,
                              times=times)
    assert sum(s is not None for s in steps["queued"]) >= 8
    if drop:
        assert times == [] and steps["taken"] == []
    else:
        assert len(times) >= len(steps["taken"]) >= 10, (len(times), steps["taken"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tree", [(torch.float64, False), (torch.bfloat16, False),
                                         (torch.float64, True), (torch.bfloat16, True)])
async def test_chained_under_adaptive_on_cuda(tiny_dir, dtype, tree):
    """Real CUDA graphs (bf16: the fused Triton path), the chain on by default under
    adaptive K: the same tokens as the same K per iteration unchained, and chained steps
    taken at K changes; with a draft tree standing for K = 3 (strict verification: every
    batch may draft it), the tree's steps chained too."""
    from specloop.models import load_model

    from .test_cuda_graphs import TREE, cfg

    loaded = load_model(tiny_dir, dtype=dtype, device="cuda")
    spec = {"adaptive": True, **(TREE["speculative"] if tree else {})}
    config = cfg(tiny_dir, True, method="eagle3", k=3, rejection=not tree, speculative=spec)

    async def go(chained):
        async with AsyncEngine(config, model=loaded) as engine:
            worker = engine.worker
            assert worker.chain is not None and worker.ahead.at_k0
            if not chained:
                worker.chain = None
            cycle_k(worker.adaptive, PATTERN)
            outs = await serve_staggered(engine, [(p, params, 0) for p, params in requests()])
            return outs, (worker.chain.taken_steps if chained else 0), worker.ahead.taken_steps

    plain, _, _ = await go(False)
    chained, taken, ahead = await go(True)
    assert chained == plain
    assert taken >= 5 and ahead > 0, (taken, ahead)



# Every move between K = 0 .. 3 (0 -> 1, 1 -> 1, 2 -> 0, ...), as a K cycle.
EVERY_MOVE = [3, 0, 0, 1, 1, 2, 2, 3, 3, 1, 3, 2, 0, 2, 1, 0, 3, 0]
PROBE_LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33]


def ragged_config(path, device):
    from specloop.engine import EngineConfig
    cuda = device == "cuda"
    return EngineConfig.from_dict({
        "model": {"name": str(path), "dtype": "bfloat16" if cuda else "float32",
                  "device": device, "max_seq_len": 1024, "chat_template": False},
        "scheduler": {"max_batch_size": 4},
        "speculative": {"method": "eagle3", "num_draft_tokens": 3, "adaptive": True},
        "components": {"graph_cache": "cuda" if cuda else
                       "tests.graphs.test_chain:StaticOutputCache"},
        "graphs": {"batch_buckets": [1, 2, 4]}})


async def ragged_rounds(engine, lengths, sampled, tokens=90) -> dict:
    """Three rounds of four requests at once, prompts of ``lengths`` (alternate halves, one
    token longer each round), ``tokens`` each, odd requests sampled (seeded) when
    ``sampled``; -> {request: tokens}."""
    import anyio

    from specloop.samplers import SamplingParams
    outs = {}

    async def one(i, n):
        params = SamplingParams(temperature=0.8 if sampled and i % 2 else 0.0, seed=i,
                                max_tokens=tokens, ignore_eos=True)
        prompt = [5 + (j * 7 + i) % 300 for j in range(n)]
        outs[i] = [t async for o in engine.generate(prompt, params, request_id=f"r{i}")
                   for t in o.token_ids]
    for r in range(3):
        async with anyio.create_task_group() as tg:
            for i, n in enumerate(lengths[r % 2::2]):
                tg.start_soon(one, 10 * r + i, n + r)
    assert len(outs) == 12 and all(len(v) == tokens for v in outs.values())
    return outs


async def test_every_move_with_ragged_prompts(tmp_path):
    """The scenario of the GPU test below on the CPU (the chain forced on, replays as CUDA
    graphs): every move of K, prompts of one token up to tile and page boundaries, greedy
    and sampled rows; chained equals unchained."""
    from specloop.models import load_model
    from specloop.models.testing import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "t", vocab_size=384, num_layers=2, hidden=64,
                                 seed=1)
    loaded = load_model(path, dtype=torch.float32)
    outs = {}
    for chained in (False, True):
        async with AsyncEngine(ragged_config(path, "cpu"), model=loaded) as engine:
            one_rank_adaptive(engine.worker, chained, EVERY_MOVE)
            outs[chained] = await ragged_rounds(engine, PROBE_LENGTHS, True, tokens=40)
            if chained:
                assert engine.worker.chain.taken_steps >= 20
    assert outs[True] == outs[False]


@pytest.mark.gpu
@pytest.mark.parametrize("lengths,sampled", [
    (PROBE_LENGTHS, True),                      # the probe's case
    ([3, 4, 15, 16, 17, 31, 32, 33], True),     # no one- or two-token prompts
    (PROBE_LENGTHS, False),                     # all greedy
])
async def test_every_move_with_ragged_prompts_on_cuda(tmp_path, lengths, sampled):
    """Adaptive eagle3 on real CUDA graphs (bf16, the chain on) held to a cycle through
    every move of K, ``ragged_rounds``: every request gets all its tokens, and the chained
    engine's equal the unchained one's. (2026-12-02: the first case crashed on an H200 with
    an embedding lookup past the vocabulary -- the draft argmax kernel's INT64_MAX for a
    row of NaN logits, tests/models/test_draft_kernels.py; passes since that fix.)"""
    from specloop.models import load_model
    from specloop.models.testing import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "t", vocab_size=384, num_layers=2, hidden=64,
                                 seed=1)
    loaded = load_model(path, dtype=torch.bfloat16, device="cuda")
    outs = {}
    for chained in (False, True):
        async with AsyncEngine(ragged_config(path, "cuda"), model=loaded) as engine:
            worker = engine.worker
            assert worker.chain is not None and worker.ahead.at_k0
            if not chained:
                worker.chain = None
            cycle_k(worker.adaptive, EVERY_MOVE)
            outs[chained] = await ragged_rounds(engine, lengths, sampled)
    assert outs[True] == outs[False]


# K = 0 stretches of many lengths between drafting iterations: the catch-up after each
# runs eagerly over the rows the stretch piled up (up to the pending buffer's depth).
STRETCHES = [k for n in (1, 2, 4, 5, 6, 8, 9, 15, 16, 17, 24, 31, 32, 33, 36, 40)
             for k in [3, 3] + [0] * n]


@pytest.mark.gpu
@pytest.mark.parametrize("before", [False, True])
def test_no_triton_compile_after_warm_up(before):
    """Adaptive eagle3 on CUDA graphs through K = 0 stretches of 1 to 40 iterations,
    ragged prompts, greedy and sampled rows (bench/probe_compiles_gpu.py, in a process of
    its own: Triton's in-process caches outlive an engine): no Triton kernel compiles a
    specialisation after warm-up. Each compile stalls serving (~0.5 s a kernel; 1.97 s for
    one eager DRAFT on the H200, 2026-12-02): the eager catch-up after a stretch ran at a
    width of its own each time, and nothing warmed the eager path up. Its twin (the code
    before, ``--before``) must compile some, or this test could not see a stall."""
    import json
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "bench/probe_compiles_gpu.py", "eagle3",
                          "--pattern", "stretches", "--tokens", "120"]
                         + (["--before"] if before else []),
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if before:
        assert result["new"] > 0, run.stdout[-2000:]
    else:
        assert result["new"] == 0, run.stdout[-3000:]
    # The engine's own watch (engine/_compile_watch.py) counted the same compiles: none,
    # or the twin's stalls, each a kernel_compiled_while_serving warning.
    assert result["engine_counted"] == result["new"], run.stdout[-2000:]


async def test_warm_up_eager_writes_only_the_scratch_slot(tmp_path):
    """``warm_up_eager`` (run at warm-up on a GPU; here on the CPU, where the engine does
    not call it) drafts at every row count up to the batch (each of the skinny GEMMs' row
    ranges) and then at powers of two, at each eager catch-up width, and leaves every real
    slot's state as it was: the head's K/V outside the scratch page, the pending rows and
    their counts."""
    from specloop.models import load_model
    from specloop.models.testing import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "t", vocab_size=384, num_layers=2, hidden=64,
                                 seed=1)
    loaded = load_model(path, dtype=torch.float32)
    async with AsyncEngine(ragged_config(path, "cpu"), model=loaded) as engine:
        await ragged_rounds(engine, PROBE_LENGTHS, True, tokens=8)   # real slots' state
        drafter = engine.worker.drafter
        cache, pending = drafter.cache, drafter.pending
        # Every slot holds pages, as while requests are served (a finished one maps to
        # the scratch page), with values of their own.
        for slot in range(drafter.scratch):
            cache.pages.resize(slot, 64)
        cache.pages.sync()
        real = slice(0, cache.pages.scratch_page)
        cache.k[:, real].normal_()
        cache.v[:, real].normal_()
        before = (cache.k[:, real].clone(), cache.v[:, real].clone(),
                  pending.buffer[:drafter.scratch].clone(),
                  pending.counts(range(drafter.scratch)), pending.starts(range(drafter.scratch)))
        shapes = []
        steps = drafter._draft_steps

        def spy(inputs, **kw):
            shapes.append(tuple(inputs["cu_tokens"].shape))
            return steps(inputs, **kw)
        drafter._draft_steps = spy
        drafter.warm_up_eager(3, engine.worker.sampler)
        after = (cache.k[:, real], cache.v[:, real], pending.buffer[:drafter.scratch],
                 pending.counts(range(drafter.scratch)), pending.starts(range(drafter.scratch)))
    widths = sorted({1, pending.depth})            # the CPU's: the longest row's
    assert shapes == [(rows, w) for rows in (1, 2, 3, 4) for w in widths]
    assert all(torch.equal(a, b) for a, b in zip(before[:3], after[:3]))
    assert before[3:] == after[3:]


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
async def test_requests_joining_the_chained_step_under_adaptive(tiny_dir, tiny_loaded,
                                                                method):
    """A server's load under adaptive K held to ``PATTERN``: requests admitted while a
    chained step waits join the step chained at the next K (n-gram: into and out of K = 0
    too); tokens equal the unchained engine's, and the chain took newcomers in. Greedy
    rows: arrivals fall on other iterations in the two runs, so the cycle's K of a given
    step differs between them, and a sampled row's tokens depend on the K it was
    drafted at (its distribution does not); fixed K's sampled rows:
    tests/graphs/test_chain.py, ``test_requests_joining_keep_the_chained_step``."""
    import random

    from specloop.samplers import SamplingParams

    from ..engine.test_ahead_steady import _steady

    def greedy(max_tokens, i):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    rng = random.Random(5)
    lengths = [rng.randint(3, 20) for _ in range(14)]
    outs, chain = {}, None
    for chained in (False, True):
        cfg = chain_config(tiny_dir, True, method=method, k=3, rejection=True,
                           speculative={"adaptive": True})
        async with AsyncEngine(cfg, model=tiny_loaded) as engine:
            one_rank_adaptive(engine.worker, chained, PATTERN)
            outs[chained] = await _steady(engine, lengths, 4, params=greedy)
            pages = engine.worker.runner.pages
            assert pages.num_free == pages.num_pages
            chain = engine.worker.chain
    assert outs[True] == outs[False]
    assert chain is not None and chain.joined_steps >= 2 and chain.taken_steps >= 10, (
        chain.joined_steps, chain.taken_steps)


async def test_narrower_verify_rows_go_into_the_draft_graphs_statics(tiny_dir, tiny_loaded,
                                                                      monkeypatch):
    """Under adaptive K a VERIFY that drafted fewer than the largest K hands its tokens,
    counts and feature rows to the next chained draft in the draft graph's own static
    inputs (``DeviceChain._into_statics``: no padded tensors, nothing for the replay to
    copy; their padding columns hold what the last replay left): every such step of the
    head went that way, and the tokens equal the unchained engine's."""
    from specloop.engine._chain import DeviceChain
    into_statics, written = DeviceChain._into_statics, []

    def seen(packed, features, into, width, hidden):
        out = into_statics(packed, features, into, width, hidden)
        written.append((hidden, out is not None))
        return out
    plain, _ = await serve(tiny_dir, tiny_loaded, False)
    monkeypatch.setattr(DeviceChain, "_into_statics", staticmethod(seen))
    chained, _ = await serve(tiny_dir, tiny_loaded, True)
    assert chained == plain
    assert len(written) >= 5 and written == [(True, True)] * len(written), written


async def test_chained_under_adaptive_with_a_tree_equals_unchained(tiny_dir, tiny_loaded):
    """A draft tree under adaptive K (its K = 3 stands for the tree; strict verification,
    so sampled rows draft it too): chained steps queued at the tree's K (its 7 nodes) and
    taken, and every token equals the unchained run's."""
    tree = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    cfg = chain_config(tiny_dir, True, method="eagle3", k=3,
                       speculative={"adaptive": True, "tree": tree})
    reqs = [(p, params, 0) for p, params in requests()]

    async def run(chained):
        queued = []
        async with AsyncEngine(cfg, model=tiny_loaded) as engine:
            worker = engine.worker
            one_rank_adaptive(worker, chained, [3, 3, 2, 3, 0, 3, 3, 1, 3])
            taken = []
            if chained:
                chain = worker.chain
                queue, take = chain.queue, chain.take

                def recording(rec, pending, rows, k=None):
                    hidden = queue(rec, pending, rows, k)
                    queued.append((rec.k, k, hidden is not None))
                    return hidden

                def taking():
                    pending, rows = take()
                    if pending is not None:
                        taken.append(queued[-1][1])
                    return pending, rows
                chain.queue, chain.take = recording, taking
            outs = await serve_staggered(engine, reqs)
        return outs, queued, taken

    plain, _, _ = await run(False)
    chained, queued, taken = await run(True)
    assert chained == plain
    # Chained tree steps and chain steps were taken by the iterations they were for.
    assert len(tree) in taken and {1, 2} & set(taken), taken
    # Tree to tree, tree to a chain and a chain to the tree were queued.
    kinds = {(a, b) for a, b, ok in queued if ok}
    assert (len(tree), len(tree)) in kinds, kinds
    assert any(a == len(tree) and b in (1, 2) for a, b in kinds), kinds
    assert any(a in (1, 2) and b == len(tree) for a, b in kinds), kinds


async def test_joined_rows_go_into_the_draft_graphs_statics(tiny_dir, tiny_loaded,
                                                           monkeypatch):
    """A chained step that takes joiners under adaptive K writes the batch's rows (fewer
    token columns than the draft graph's where VERIFY drafted fewer), the joiners' and the
    padding rows straight into the draft graph's static inputs (``_joined_into``: no
    padded tensors to concatenate, nothing for the replay to copy); the tokens equal the
    unchained engine's."""
    import random

    from specloop.engine._chain import DeviceChain
    from specloop.samplers import SamplingParams

    from ..engine.test_ahead_steady import _steady

    joined_into, written = DeviceChain._joined_into, []

    def seen(self, out, joining, first, into, padded):
        got = joined_into(self, out, joining, first, into, padded)
        written.append((out["packed"].shape[1] - 1, got is not None))
        return got
    monkeypatch.setattr(DeviceChain, "_joined_into", seen)

    def greedy(max_tokens, i):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    rng = random.Random(5)
    lengths = [rng.randint(3, 20) for _ in range(14)]
    outs = {}
    for chained in (False, True):
        cfg = chain_config(tiny_dir, True, method="eagle3", k=3, rejection=True,
                           speculative={"adaptive": True})
        async with AsyncEngine(cfg, model=tiny_loaded) as engine:
            one_rank_adaptive(engine.worker, chained, PATTERN)
            outs[chained] = await _steady(engine, lengths, 4, params=greedy)
    assert outs[True] == outs[False]
    assert written and all(ok for _, ok in written), written
    # Narrower VERIFYs among them (K = 1, 2: 2, 3 token columns against the graph's 4).
    assert {n for n, _ in written} & {2, 3}, written


@pytest.mark.parametrize("k_n", [3, 1])
@pytest.mark.parametrize("rows", [[0, 1, 2], [0, 2, 3]])    # in order; a request left
def test_joined_into_writes_what_the_padded_rows_hold(k_n, rows):
    """``_joined_into`` against the tensors ``_joined_rows`` builds without statics (the
    path before it): the same batch rows in the columns a draft reads (VERIFY n's K_n + 1
    tokens and the count; the columns past them are left as the last replay wrote them),
    the same joiner and padding rows whole, the same feature rows (joiners' first row the
    drafter's, zero elsewhere)."""
    from types import SimpleNamespace

    from specloop.engine._chain import DeviceChain

    k, padded, features_dim = 3, 8, 5
    width = k + 1
    gen = torch.Generator().manual_seed(0)
    first = torch.randn(2, features_dim, generator=gen)
    chain = DeviceChain.__new__(DeviceChain)
    chain.k = k
    chain.drafter = SimpleNamespace(joining_rows=lambda slots: first)
    joining = [SimpleNamespace(token_ids=[7, 8, 9], batch_slot=5),
               SimpleNamespace(token_ids=[4, 11], batch_slot=6)]
    # VERIFY n at K_n, its bucket's 4 rows: tokens then the count.
    packed = torch.randint(0, 50, (4, k_n + 2), generator=gen)
    packed[:, -1] = torch.randint(0, k_n + 1, (4,), generator=gen)
    verified = {"packed": packed, "hidden": torch.randn(4, k_n + 1, features_dim, generator=gen),
                "token_ids": packed[:, :-1], "num_accepted": packed[:, -1]}
    before = chain._joined_rows(verified, rows, joining, padded, True, None)
    statics = {"verified": torch.full((padded, width + 1), -7),
               "cu_hidden": torch.full((padded, width, features_dim), 3.0)}
    after = chain._joined_rows(verified, rows, joining, padded, True, statics)
    assert after["packed"] is statics["verified"] and after["hidden"] is statics["cu_hidden"]
    real, n = len(rows), k_n + 1
    assert torch.equal(after["packed"][:real, :n], before["packed"][:real, :n])
    assert torch.equal(after["num_accepted"], before["num_accepted"])
    assert torch.equal(after["packed"][real:], before["packed"][real:])
    assert torch.equal(after["hidden"][:real, :n], before["hidden"][:real, :n])
    assert torch.equal(after["hidden"][real:], before["hidden"][real:])
    assert torch.equal(after["hidden"][real:real + 2, 0], first)
    # Past VERIFY n's columns the batch's rows keep what was there (no draft reads them).
    if n < width:
        assert (after["packed"][:real, n:width] == -7).all()
