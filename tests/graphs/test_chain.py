"""DRAFT and VERIFY of the next iteration chained on the device (engine/_chain.py), on the
CPU: a graph cache whose replays write static outputs (as CUDA graphs do: the chained
VERIFY overwrites the outputs the host has not handed to the drafter yet) runs the chained
path; outputs must equal the eager engine's token for token, greedy and sampled rows,
requests stopping at different iterations (the chained step is then dropped)."""

import anyio
import pytest
import torch

from specloop.engine import AsyncEngine
from specloop.engine._chain import DeviceChain
from specloop.samplers import SamplingParams

from ..engine import planted
from ..engine.conftest import PROMPTS, serve_staggered
from .test_static_steps import StepReplayCache, config


class StaticOutputCache(StepReplayCache):
    """Replays write into one set of output tensors per key, as a CUDA graph's."""

    def replay(self, key, inputs):
        fresh = super().replay(key, inputs)
        kept = self._graphs[key]
        if not hasattr(kept, "outputs"):
            kept.outputs = {n: t.clone() for n, t in fresh.items()}
        for name, t in fresh.items():
            kept.outputs[name].copy_(t)
        return kept.outputs


def chain_config(tiny_dir, graphs, **spec):
    cfg = config(tiny_dir, graphs, **spec).to_dict()
    if graphs:
        cfg["components"]["graph_cache"] = "tests.graphs.test_chain:StaticOutputCache"
        cfg["components"]["sampler"] = "tests.engine.planted:recording_sampler"
    from specloop.engine import EngineConfig
    return EngineConfig.from_dict(cfg)


SEEDS = range(100, 104)     # padding rows draw with seed 0: not compared


def one_rank_adaptive(worker, chained, pattern):
    """Adaptive K's one-CUDA-rank path on the CPU: VERIFY inline, the next K's step
    queued early, DRAFT + VERIFY chained on the device or not, K held to ``pattern``."""
    from ..engine.test_adaptive import cycle_k
    worker.verify_inline = worker.ahead.at_k0 = True
    worker.chain = DeviceChain(worker=worker) if chained else None
    cycle_k(worker.adaptive, pattern)


def requests():
    stops = tuple(range(40, 90))
    return [(p, SamplingParams(temperature=0.0 if i % 2 else 0.9, top_p=0.9, seed=SEEDS[i],
                               max_tokens=10 + 3 * i, stop_token_ids=stops if i % 3 == 1 else (),
                               ignore_eos=True))
            for i, p in enumerate(PROMPTS[:4])]


async def serve(cfg, loaded, reqs, chained, hold_back=True):
    outs = {}
    flags = []      # each VERIFY event's ``overlapped``

    class Overlaps:
        def on_transition(self, event):
            if event.overlapped is not None:
                flags.append(event.overlapped)
    async with AsyncEngine(cfg, model=loaded, observers=[Overlaps()]) as engine:
        worker = engine.worker
        if chained:     # the chain runs on CUDA only; here it is forced on
            worker.verify_inline = True
            worker.chain = chain = DeviceChain(worker=worker)
        if chained and hold_back:
            # Some steps not queued (as when a request is about to join): every third,
            # and each right after a step taken for fewer requests, which is then read
            # back without a chained copy of its rows.
            can_queue, calls, seen = chain._can_queue, iter(range(10 ** 6)), [0]

            def sometimes(rec, *args):
                subset, seen[0] = chain.subset_steps > seen[0], chain.subset_steps
                return next(calls) % 3 != 2 and not subset and can_queue(rec, *args)
            chain._can_queue = sometimes

        async def one(i, prompt, params):
            outs[i] = [t async for o in engine.generate(prompt, params) for t in o.token_ids]

        async with anyio.create_task_group() as tg:
            for i, (prompt, params) in enumerate(reqs):
                tg.start_soon(one, i, prompt, params)
        chain = worker.chain
        # The stats, and each VERIFY's event, count an iteration as overlapped exactly
        # when it took a queued step.
        taken = worker.ahead.taken_steps + (chain.taken_steps if chain is not None else 0)
        assert engine.stats.num_overlapped_iterations == taken == sum(flags)
        assert len(flags) == engine.stats.num_iterations     # one a VERIFY
    return [outs[i] for i in range(len(reqs))], chain


def calls(records, seed, size):
    """A request's records in call order, ``size`` per draft or VERIFY call."""
    rows = records.get(seed, [])
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def same_record(a, b):
    """Equal positions and values (tensors compared exactly)."""
    (pa, va), (pb, vb) = a, b
    return pa == pb and (torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb)


def same_call(a, b):
    return all(map(same_record, a, b))


def unmatched(plain, chained, same=same_call):
    """Walks the chained run's items (calls, or records with ``same=same_record``): each
    either is the plain run's next (``same``) or is skipped (a dropped chained step's);
    -> the plain run's items left unmatched and the number skipped."""
    i, skipped = 0, 0
    for item in chained:
        if i < len(plain) and same(item, plain[i]):
            i += 1
        else:
            skipped += 1
    return len(plain) - i, skipped


def same_drafts(chain, k):
    """The same draft distributions and drafts at every position the unchained replays
    drafted (a random head's drafts are rarely accepted: outputs alone would not tell),
    from ``planted.RECORDERS`` (the unchained run's, then the chained one's), the
    chained run's dropped steps skipped."""
    plain, with_chain = planted.RECORDERS
    dropped = chain.queued_steps - chain.taken_steps
    for seed in SEEDS:
        for name, size in (("drafts", k), ("verified", 1)):
            left, skipped = unmatched(calls(getattr(plain, name), seed, size),
                                      calls(getattr(with_chain, name), seed, size))
            assert left == 0 and skipped <= dropped, (name, seed, left, skipped, dropped)


# The chaining heads: one with rejection sampling, one without.
CHAINING_SPECS = [
    {"method": "eagle3", "k": 3, "rejection": True},
    {"method": "mtp_eagle", "k": 2},
]


@pytest.mark.parametrize("spec", CHAINING_SPECS)
async def test_chained_equals_eager(tiny_dir, tiny_loaded, spec):
    reqs = requests()
    eager, _ = await serve(chain_config(tiny_dir, False, **spec), tiny_loaded, reqs, False)
    planted.RECORDERS.clear()
    graphs, _ = await serve(chain_config(tiny_dir, True, **spec), tiny_loaded, reqs, False)
    chained, chain = await serve(chain_config(tiny_dir, True, **spec), tiny_loaded, reqs, True)
    assert chained == eager == graphs
    same_drafts(chain, spec["k"])
    # Chained steps were taken, and some dropped (requests stopped or finished).
    assert chain.taken_steps > 0 and chain.queued_steps > chain.taken_steps
    assert chain.subset_steps > 0      # some taken after requests left


async def test_rows_left_run_at_their_own_bucket(tiny_dir, tiny_loaded):
    """Requests ending apart (the batch shrinks 4 -> 1 over buckets 4, 2, 1), the
    chain queued after every VERIFY that can: the step queued after one taken for fewer
    requests runs at the rows' own, smaller bucket (``DeviceChain._own_key``), not at the
    round's first bucket to its end; outputs and drafts are the unchained graphs'."""
    spec = {"method": "eagle3", "k": 3, "rejection": True}
    reqs = requests()
    planted.RECORDERS.clear()
    plain, _ = await serve(chain_config(tiny_dir, True, **spec), tiny_loaded, reqs, False)
    chained, chain = await serve(chain_config(tiny_dir, True, **spec), tiny_loaded, reqs,
                                 True, hold_back=False)
    assert chained == plain
    assert chain.subset_steps > 0 and chain.shrunk_steps > 0
    same_drafts(chain, spec["k"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
async def test_chained_equals_unchained_on_cuda(tiny_dir, dtype):
    """Real CUDA graphs (bf16: the fused Triton path): the chained path (on by default)
    gives the outputs of the same graphs run unchained, and of the eager engine."""
    from specloop.models import load_model

    from .test_cuda_graphs import cfg

    loaded = load_model(tiny_dir, dtype=dtype, device="cuda")
    spec = {"method": "eagle3", "k": 3, "rejection": True}
    reqs = requests()

    async def go(graphs, chained):
        async with AsyncEngine(cfg(tiny_dir, graphs, **spec), model=loaded) as engine:
            worker = engine.worker
            if not chained:
                worker.chain = None

            outs = await serve_staggered(engine, [(p, params, 0) for p, params in reqs])
            taken = worker.chain.taken_steps if worker.chain is not None else 0
        return outs, taken

    eager, _ = await go(False, False)
    unchained, _ = await go(True, False)
    chained, taken = await go(True, True)
    assert taken > 0
    assert chained == unchained
    if dtype == torch.float64:
        assert chained == eager


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["eagle3", "ngram"])
async def test_chained_equals_unchained_under_steady_load_on_cuda(tiny_dir, method):
    """Real CUDA graphs under a server's load (a request submitted as each ends, lengths
    spread, greedy and seeded sampled rows): newcomers held back an iteration while a
    chained step waits, chained steps taken for the rows left; the outputs of the same
    graphs run unchained."""
    import random

    from specloop.models import load_model

    from ..engine.test_ahead_steady import _steady
    from .test_cuda_graphs import cfg

    loaded = load_model(tiny_dir, dtype=torch.float64, device="cuda")
    spec = {"method": method, "k": 3, "rejection": True}
    rng = random.Random(13)
    lengths = [rng.randint(3, 30) for _ in range(20)]

    async def go(chained):
        async with AsyncEngine(cfg(tiny_dir, True, **spec), model=loaded) as engine:
            worker = engine.worker
            if not chained:
                worker.chain = None
            outs = await _steady(engine, lengths, 6)
            pages = worker.runner.pages
            assert pages.num_free == pages.num_pages
            taken = worker.chain.taken_steps if worker.chain is not None else 0
        return outs, taken

    unchained, _ = await go(False)
    chained, taken = await go(True)
    assert taken > 0
    assert chained == unchained


@pytest.mark.parametrize("method", ["eagle3", "mtp_eagle"])
async def test_shared_head_prefill_equals_one_per_prompt(tiny_dir, tiny_loaded, method):
    """The head's prefill forwards shared between prompts admitted together (padded rows,
    as on a GPU) give the draft distributions of one forward per prompt, to rounding, and
    the same outputs."""
    reqs = requests()
    runs = []
    for shared in (False, True):
        planted.RECORDERS.clear()
        cfg = chain_config(tiny_dir, True, method=method, k=2).to_dict()
        from specloop.engine import EngineConfig
        async with AsyncEngine(EngineConfig.from_dict(cfg), model=tiny_loaded) as engine:
            engine.worker.drafter.batch_prefill = shared
            outs = await serve_staggered(engine, [(p, params, 0) for p, params in reqs])
        (recorder,) = planted.RECORDERS
        runs.append((outs, recorder.drafts))
    (plain, plain_drafts), (shared_outs, shared_drafts) = runs
    assert shared_outs == plain
    for seed in SEEDS:
        a, b = plain_drafts[seed], shared_drafts[seed]
        assert [p for p, _ in a] == [p for p, _ in b]
        assert all(torch.allclose(x, y, atol=1e-9) for (_, x), (_, y) in zip(a, b)), seed


@pytest.mark.parametrize("sticky", [True, False])
async def test_chained_step_taken_when_the_rows_left_fit_a_smaller_bucket(
        tiny_dir, tiny_loaded, sticky, monkeypatch):
    """Requests finishing one by one take the batch from the 4-row bucket to 2 and 1:
    PICK_GRAPH_KEY keeps the chained step's larger bucket (``DeviceChain.key_for``), so
    the step the GPU already ran is taken for the rows left, not dropped; outputs equal
    the eager engine's. ``sticky`` False: the key follows the batch, each shrink drops a
    step (what the H200 showed with serving buckets at batch 32)."""
    if not sticky:
        monkeypatch.setattr(DeviceChain, "key_for", lambda self, key, rows: key)
    reqs = [(p, SamplingParams(temperature=0.0, max_tokens=6 + 5 * i, ignore_eos=True))
            for i, p in enumerate(PROMPTS[:4])]
    spec = {"method": "mtp_eagle", "k": 2}
    eager, _ = await serve(chain_config(tiny_dir, False, **spec), tiny_loaded, reqs, False)
    chained, chain = await serve(chain_config(tiny_dir, True, **spec), tiny_loaded, reqs, True)
    assert chained == eager
    dropped = chain.queued_steps - chain.taken_steps
    if sticky:
        assert dropped == 0 and chain.subset_steps >= 2
    else:
        assert dropped >= 2


@pytest.mark.parametrize("spec", [
    {"method": "eagle3", "k": 3, "rejection": True},
    {"method": "mtp_eagle", "k": 2},
    {"method": "ngram", "k": 3},
])
async def test_requests_joining_keep_the_chained_step(tiny_dir, tiny_loaded, spec):
    """Steady load (a request submitted as each ends, lengths spread, greedy and seeded
    sampled rows): a request admitted while a chained step waits joins one iteration
    later (``RunAhead.schedule``), so the chained step is taken for the batch it was
    queued for (before, it was not queued when a request was about to join), and the
    step chained then takes the newcomers in: the iteration they join runs chained
    (before, it ran unchained) unless one has a one-token prompt; tokens equal the eager
    engine's, no newcomer waits more than one iteration, pages come back."""
    import random

    from ..engine.test_ahead_steady import _steady

    rng = random.Random(11)
    lengths = [rng.randint(3, 20) for _ in range(14)]

    async def go(chained):
        config = chain_config(tiny_dir, chained, **spec)
        async with AsyncEngine(config, model=tiny_loaded) as engine:
            worker = engine.worker
            if chained:     # the chain runs on CUDA only; here it is forced on
                worker.verify_inline = True
                worker.chain = DeviceChain(worker=worker)
            admit, waits, admitted = worker.scheduler.admit, [], {}

            def admitting():
                got = admit()
                admitted.update((id(r), engine.stats.num_iterations) for r in got)
                return got
            worker.scheduler.admit = admitting
            draft = worker.draft

            async def drafting(rec):     # the iteration a request first runs in
                for r in rec.batch:
                    if id(r) in admitted:
                        waits.append(engine.stats.num_iterations - admitted.pop(id(r)))
                return await draft(rec)
            worker.draft = drafting
            verify, last, joined = worker.verify, [[], []], []

            async def verifying(rec):   # whether an iteration newcomers joined ran chained
                state = await verify(rec)
                batch, joining = last
                if joining and list(rec.batch) == batch + joining:
                    joined.append((rec.overlapped, min(len(r.prompt_ids) for r in joining)))
                last[:] = list(rec.batch), list(worker.ahead.joining)
                return state
            worker.verify = verifying
            outs = await _steady(engine, lengths, 4)
            pages = worker.runner.pages
            assert pages.num_free == pages.num_pages
        return outs, worker.chain, waits, joined

    eager, _, _, _ = await go(False)
    chained, chain, waits, joined = await go(True)
    assert chained == eager
    assert set(waits) == {0, 1}, waits
    assert chain.taken_steps > 0.5 * chain.queued_steps > 0
    # (overlapped, the shortest newcomer's prompt): chained unless one has a single token
    assert [o for o, _ in joined] == [n >= 2 for _, n in joined], joined
    assert chain.joined_steps >= 2 and sum(n >= 2 for _, n in joined) >= 2, joined


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["eagle3", "ngram"])
async def test_requests_joining_the_chained_step_on_cuda(tmp_path, method):
    """``test_requests_joining_keep_the_chained_step`` on real CUDA graphs (a tiny bf16
    model; the chain on, and off for the reference): under a server's load newcomers
    join the step chained for them, and every request's tokens (greedy and seeded
    sampled rows) equal the unchained engine's."""
    import random

    from specloop.engine import EngineConfig
    from specloop.models import load_model
    from specloop.models.testing import write_tiny_checkpoint

    from ..engine.test_ahead_steady import _steady

    path = write_tiny_checkpoint(tmp_path / "t", vocab_size=384, num_layers=2, hidden=64,
                                 seed=1)
    loaded = load_model(path, dtype=torch.bfloat16, device="cuda")
    spec = {"method": method, "num_draft_tokens": 3}
    if method == "eagle3":
        spec["use_rejection_sampling"] = True
    config = EngineConfig.from_dict({
        "model": {"name": str(path), "dtype": "bfloat16", "device": "cuda",
                  "max_seq_len": 512, "chat_template": False, "kv_page_size": 16},
        "scheduler": {"max_batch_size": 4}, "speculative": spec,
        "components": {"graph_cache": "cuda"}, "graphs": {"batch_buckets": [1, 2, 4]}})
    rng = random.Random(3)
    lengths = [rng.randint(8, 40) for _ in range(16)]
    outs, chain = {}, None
    for chained in (False, True):
        async with AsyncEngine(config, model=loaded) as engine:
            worker = engine.worker
            assert worker.chain is not None
            if not chained:
                worker.chain = None
            outs[chained] = await _steady(engine, lengths, 4)
            chain = worker.chain
    assert outs[True] == outs[False]
    assert chain.taken_steps >= 20 and chain.joined_steps >= 3, (
        chain.queued_steps, chain.taken_steps, chain.joined_steps)


async def test_prefill_takes_the_first_chained_steps_pages(tiny_dir, tiny_loaded):
    """With the chain on, a request's prefill takes the pages its first chained step
    reserves (``keep_ahead - 1`` positions past the prompt), so that the first
    iteration's reservations grow no slot's pages (on a GPU each growth is a copy of the
    page table, 80-120 us of the host at admission); requests one at a time, prompts
    ending anywhere in a page, outputs as without the chain."""
    from ..engine.conftest import collect

    spec = {"method": "eagle3", "k": 3}
    reqs = [([(5 * i + j) % 300 + 3 for j in range(n)],
             SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
            for i, n in enumerate([3, 14, 15, 16, 17, 30, 33])]

    async def run(chained):
        grew, outs, phase = [], [], [None]

        class FirstRescan:
            def on_transition(self, event):
                if event.state.value.upper() == "RESCAN":
                    phase[0] = None
        async with AsyncEngine(chain_config(tiny_dir, True, **spec), model=tiny_loaded,
                               observers=[FirstRescan()]) as engine:
            worker = engine.worker
            pages = worker.runner.pages
            if chained:
                worker.verify_inline = True
                worker.chain = DeviceChain(worker=worker)
            resize = pages.resize

            def watched(slot, length):
                before = len(pages.pages_of(slot))
                resize(slot, length)
                if phase[0] == "first" and len(pages.pages_of(slot)) > before:
                    grew.append((slot, length))
            pages.resize = watched
            prefill = worker._prefill

            def marked(admitted):
                prefill(admitted)
                phase[0] = "first"
                if chained:
                    want = [-(-(r.seq_len + worker.chain.keep_ahead - 1) // pages.page_size)
                            for r in admitted]
                    assert [len(pages.pages_of(r.batch_slot)) for r in admitted] == want
            worker._prefill = marked
            for prompt, params in reqs:
                outs.append(await collect(engine, prompt, params))
        return outs, grew

    (plain, _), (chained, grew) = await run(False), await run(True)
    assert chained == plain and grew == []
