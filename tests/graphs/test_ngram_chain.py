"""n-gram drafting chained on the device (models/drafters/_ngram_device.py): the device's
drafts equal the host drafter's token for token, and an engine whose n-gram steps are
chained gives the outputs (and VERIFY's draft rows) of the unchained and eager engines."""

import os
import random
import types

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specloop.models.drafters._ngram import NgramDrafter
from specloop.models.drafters._ngram_device import chain_step_ops
from specloop.samplers import SamplingParams

from ..engine import planted
from ..interpreted import run_interpreted
from .test_chain import SEEDS, chain_config, one_rank_adaptive, serve


def host_drafts(tokens, k, ngram_min, ngram_max):
    """The host drafter's K drafts after ``tokens`` (built incrementally, as served: its
    table is filled a prefix at a time)."""
    spec = types.SimpleNamespace(num_draft_tokens=k, ngram_min=ngram_min,
                                 ngram_max=ngram_max, adaptive=True)
    drafter = NgramDrafter(types.SimpleNamespace(speculative=spec),
                           types.SimpleNamespace(target_cache=None))
    for cut in range(1, len(tokens), 3):
        drafter.propose_row(0, tokens[:cut], k)
    return drafter.propose_row(0, tokens, k)


def random_case(rng: random.Random, rows: int, width: int = 48):
    """Rows with histories (garbage past each length), VERIFY n's outputs (-1 past the
    bonus) and the expected (drafts, bonus, position); the last row is padding."""
    k1 = rng.randint(1, 5)
    vocab = rng.choice([2, 3, 5, 50])     # small vocabularies: many and multiple matches
    history = torch.randint(0, vocab, (rows + 1, width))
    verified = torch.full((rows + 1, k1), -1, dtype=torch.int64)
    accepted = torch.randint(0, k1, (rows + 1,))
    meta = torch.zeros(4, rows + 1, dtype=torch.int64)
    meta[1, rows] = rows                     # padding: the scratch row, not real
    full = []
    for b in range(rows):
        length = rng.choice([1, 2, 3, rng.randint(1, width - k1 - 2)])
        tokens = history[b, :length].tolist()
        n = int(accepted[b])
        new = [rng.randrange(vocab) for _ in range(n + 1)]
        verified[b, :n + 1] = torch.tensor(new)
        meta[:, b] = torch.tensor([length - 1, b, 1, length])
        full.append(tokens + new)
    verified[rows] = torch.randint(0, vocab, (k1,))
    return history, verified, accepted, meta, full


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), rows=st.integers(1, 4), k=st.integers(0, 5),
       ngram_min=st.integers(1, 3), extra=st.integers(0, 2))
def test_device_drafts_equal_host_drafts(seed, rows, k, ngram_min, extra):
    """K = 0 included (adaptive K chained into K = 0: the bonus token and position only)."""
    rng = random.Random(seed)
    history, verified, accepted, meta, full = random_case(rng, rows)
    ngram_max = ngram_min + extra
    bonus, start_pos = torch.zeros(rows + 1, dtype=torch.int64), torch.zeros(rows + 1,
                                                                             dtype=torch.int64)
    next_meta = torch.full_like(meta, -7)
    drafts = chain_step_ops(history, verified, accepted, meta, k=k, ngram_min=ngram_min,
                            ngram_max=ngram_max, bonus=bonus, start_pos=start_pos,
                            next_meta=next_meta)
    for b, tokens in enumerate(full):
        assert drafts[b].tolist() == host_drafts(tokens, k, ngram_min, ngram_max), b
        assert history[b, :len(tokens)].tolist() == tokens
        assert int(bonus[b]) == tokens[-1] and int(start_pos[b]) == len(tokens) - 1
        # The next step's meta: the host's for these rows once VERIFY n is read back.
        assert next_meta[:, b].tolist() == [len(tokens) - 1, b, 1, len(tokens)]
    assert next_meta[:, rows].tolist() == meta[:, rows].tolist()    # padding: as it was
    # Padding: nothing accepted, position 0, writes only in the scratch row.
    assert int(start_pos[rows]) == 0 and int(bonus[rows]) == int(verified[rows, 0])


@pytest.mark.parametrize(("tokens", "lo", "hi", "expected"), [
    ([1, 5, 2, 1, 6, 1], 1, 1, [6, 1, 1]),    # two earlier matches: the latest
    ([1, 2, 3, 1, 2, 3, 9], 1, 3, [9, 9, 9]),  # none: the last token (never itself)
    ([1, 2, 9, 2, 1, 2], 1, 2, [9, 2, 1]),     # [1, 2] beats the later [2]: longest first
    ([1, 2, 9, 2, 1, 2], 1, 1, [1, 2, 2]),
    ([2, 3, 2], 1, 3, [3, 2, 2]),              # short: runs past the end, last repeated
    ([6], 1, 3, [6, 6, 6]),
])
def test_known_drafts(tokens, lo, hi, expected):
    """Known answers, host and device alike (a drafter taking the first match, or the
    shortest n first, or letting the suffix match itself fails one of these)."""
    assert host_drafts(tokens, 3, lo, hi) == expected
    width = len(tokens) + 6
    history = torch.zeros(2, width, dtype=torch.int64)
    history[0, :len(tokens) - 1] = torch.tensor(tokens[:-1])
    verified = torch.tensor([[tokens[-1], -1], [0, 0]])
    meta = torch.tensor([[len(tokens) - 2, 0], [0, 1], [1, 0], [len(tokens) - 1, 0]])
    zeros = torch.zeros(2, dtype=torch.int64)
    if len(tokens) == 1:    # VERIFY n committed the only token: history starts empty
        meta[0, 0], meta[3, 0] = -1, 0
    drafts = chain_step_ops(history, verified, torch.tensor([0, 0]), meta, k=3,
                            ngram_min=lo, ngram_max=hi, bonus=zeros.clone(),
                            start_pos=zeros.clone())
    assert drafts[0].tolist() == expected


def device_drafter(k, num_slots=3, max_seq_len=64):
    spec = types.SimpleNamespace(num_draft_tokens=k, ngram_min=1, ngram_max=3,
                                 adaptive=False)
    deps = types.SimpleNamespace(target_cache=types.SimpleNamespace(device="cpu"),
                                 num_slots=num_slots, max_seq_len=max_seq_len)
    return NgramDrafter(types.SimpleNamespace(speculative=spec), deps)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), k=st.integers(1, 4))
def test_chained_drafts_equal_host_drafts_as_requests_come_and_go(seed, k):
    """The drafter driven as the engine drives it, at random: requests join (prefill, a
    slot reused) and leave (release); each iteration DRAFT proposes on the host unless it
    takes the step chained in the last one; VERIFY commits 1 .. K + 1 random tokens; a
    step is chained behind it (or not), for the batch padded to a bucket. Every chained
    draft must equal the host drafter's for the tokens VERIFY committed."""
    import asyncio

    rng = random.Random(seed)
    drafter = device_drafter(k)
    tokens: dict[int, list[int]] = {}
    chained: set[int] = set()            # slots whose step chained last iteration is live
    vocab = rng.choice([3, 6, 40])
    step = drafter.graph_step(None, None, advanced=False)
    for _ in range(30):
        for slot in list(tokens):        # leave
            if rng.random() < 0.1 or len(tokens[slot]) > 40:
                drafter.release(slot)
                del tokens[slot]
                chained.discard(slot)
        for slot in range(3):            # join (a freed slot is reused)
            if slot not in tokens and rng.random() < 0.5:
                tokens[slot] = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
                drafter.prefill(slot, tokens[slot][:-1])
        batch = sorted(tokens)
        if not batch:
            continue
        taken = [s for s in batch if s in chained and rng.random() < 0.8]
        if taken and len(taken) < len(batch):
            taken = []                   # a chained step serves its whole batch or none
        if taken:
            drafter.chained_consumed(taken)
        else:
            ctx = types.SimpleNamespace(slot_list=lambda: batch,
                                        token_ids=[tokens[s] for s in batch],
                                        draft_count=lambda d: k)
            asyncio.run(drafter.propose(ctx))
        start = [len(tokens[s]) - 1 for s in batch]
        rows = rng.choice([len(batch), 4])
        new = [[rng.randrange(vocab) for _ in range(rng.randint(1, k + 1))] for _ in batch]
        verified = torch.full((rows, k + 1), -1, dtype=torch.int64)
        accepted = torch.zeros(rows, dtype=torch.int64)
        for i, row in enumerate(new):
            verified[i, :len(row)] = torch.tensor(row)
            accepted[i] = len(row) - 1
        chained = set()
        if rng.random() < 0.7:           # a step chained behind VERIFY
            # ``continued`` when the last step chained for these rows was taken (the
            # drafter itself checks they are the same rows, padding included).
            inputs = drafter.chained_inputs(
                {"token_ids": verified, "num_accepted": accepted}, start, batch,
                types.SimpleNamespace(size=rows), tokens=[tokens[s] for s in batch],
                continued=bool(taken))
            out = step(inputs)
            drafts = out["token_ids"]
            for i, s in enumerate(batch):
                assert drafts[i].tolist() == host_drafts(tokens[s] + new[i], k, 1, 3)
                # VERIFY n+1's inputs: the bonus token, then the drafts; its position; slot
                assert out["tokens"][i].tolist() == [new[i][-1], *drafts[i].tolist()]
                assert int(out["start_pos"][i]) == len(tokens[s]) + len(new[i]) - 1
                assert int(out["slots"][i]) == s
            chained = set(batch)
        for s, row in zip(batch, new):
            tokens[s] += row


KERNEL_CHILD = """
import random, sys, torch
sys.path.insert(0, sys.argv[1])
from tests.graphs.test_ngram_chain import host_drafts, random_case
from specloop.models.drafters._ngram_device import _chain_step_triton
rng = random.Random(7)
for trial in range(12):
    rows, k, lo = rng.randint(1, 3), rng.randint(0, 5), rng.randint(1, 2)
    hi = lo + rng.randint(0, 2)
    history, verified, accepted, meta, full = random_case(rng, rows)
    if trial % 2:   # rows strided, as VERIFY's token ids in its packed [B, K+2]
        verified = torch.cat([verified, verified[:, :1]], 1)[:, :-1]
    bonus, pos = torch.zeros(rows + 1, dtype=torch.int64), torch.zeros(rows + 1, dtype=torch.int64)
    nxt = torch.full_like(meta, -7)
    drafts = _chain_step_triton(history, verified, accepted, meta, k=k, ngram_min=lo,
                                ngram_max=hi, bonus=bonus, start_pos=pos, next_meta=nxt)
    for b, tokens in enumerate(full):
        assert drafts[b].tolist() == host_drafts(tokens, k, lo, hi), (trial, b)
        assert history[b, :len(tokens)].tolist() == tokens
        assert int(bonus[b]) == tokens[-1] and int(pos[b]) == len(tokens) - 1
        assert nxt[:, b].tolist() == [len(tokens) - 1, b, 1, len(tokens)], (trial, b)
    assert nxt[:, rows].tolist() == meta[:, rows].tolist()
print("ok")
"""


@pytest.mark.xdist_group("interpreted")   # one interpreter server (tests/interpreted.py)
@pytest.mark.slow   # a fresh interpreter with Triton's (~5 s CPU)
def test_kernel_equals_host_drafts_interpreted():
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run_interpreted(KERNEL_CHILD, root)


@pytest.mark.gpu
def test_kernel_equals_host_drafts_on_cuda():
    from specloop.models.drafters._ngram_device import chain_step
    rng = random.Random(11)
    for trial in range(40):
        rows, k, lo = rng.randint(1, 8), rng.randint(0, 5), rng.randint(1, 3)
        hi = lo + rng.randint(0, 2)
        history, verified, accepted, meta, full = (
            t.cuda() if isinstance(t, torch.Tensor) else t for t in random_case(rng, rows))
        if trial % 2:   # rows strided, as VERIFY's token ids in its packed [B, K+2]
            verified = torch.cat([verified, verified[:, :1]], 1)[:, :-1]
        bonus = torch.zeros(rows + 1, dtype=torch.int64, device="cuda")
        pos = torch.zeros_like(bonus)
        nxt = torch.full_like(meta, -7)
        drafts = chain_step(history, verified, accepted, meta, k=k, ngram_min=lo,
                            ngram_max=hi, bonus=bonus, start_pos=pos, next_meta=nxt)
        for b, tokens in enumerate(full):
            assert drafts[b].tolist() == host_drafts(tokens, k, lo, hi), (trial, b)
            assert int(bonus[b]) == tokens[-1] and int(pos[b]) == len(tokens) - 1
            assert nxt[:, b].tolist() == [len(tokens) - 1, b, 1, len(tokens)], (trial, b)
        assert nxt[:, rows].tolist() == meta[:, rows].tolist()


def ngram_config(tiny_dir, graphs, max_batch_size):
    from specloop.engine import EngineConfig
    cfg = chain_config(tiny_dir, graphs, method="ngram", k=3, rejection=True).to_dict()
    cfg["scheduler"]["max_batch_size"] = max_batch_size
    cfg["graphs"] = {"batch_buckets": [b for b in (1, 2, 4, 8) if b <= max_batch_size]}
    return EngineConfig.from_dict(cfg)


def ngram_requests():
    """Repetitive prompts (n-gram drafts get accepted), greedy and sampled rows, stops."""
    stops = tuple(range(40, 90))
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9, 9], [1, 2, 3, 4, 1, 2, 3],
               [300, 5, 300, 5, 300], [7], [11, 12, 13, 11, 12]]
    return [(p, SamplingParams(temperature=0.0 if i % 2 else 0.9, top_p=0.9,
                               seed=SEEDS[0] + i, max_tokens=12 + 5 * i,
                               stop_token_ids=stops if i % 3 == 1 else (), ignore_eos=True))
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("max_batch_size", [8, 2])     # 2: requests wait, slots reused
async def test_chained_ngram_equals_eager(tiny_dir, tiny_loaded, max_batch_size):
    """Greedy and sampled rows, requests stopping at different iterations (chained steps
    dropped, or taken for fewer rows), requests joining and slots reused: the chained
    engine's outputs equal the eager engine's and the unchained graph engine's, and
    VERIFY saw the same draft rows at every position (a chained step's drafts are the
    device's; the others the host's)."""
    reqs = ngram_requests()
    eager, _ = await serve(ngram_config(tiny_dir, False, max_batch_size), tiny_loaded, reqs,
                           False)
    planted.RECORDERS.clear()
    graphs, _ = await serve(ngram_config(tiny_dir, True, max_batch_size), tiny_loaded, reqs,
                            False)
    chained, chain = await serve(ngram_config(tiny_dir, True, max_batch_size), tiny_loaded,
                                 reqs, True)
    assert chained == eager == graphs
    checked = assert_drafts_are_the_hosts(planted.RECORDERS, reqs, chained)
    assert checked > 2 * sum(len(out) for out in chained) // 3
    assert chain.taken_steps > 0
    if max_batch_size == 2:     # requests ending and joining: where the batch's rows
        # all end at a VERIFY, nothing is chained behind it (it would be dropped)
        assert chain.worker.ahead.ends_skipped > 0
        assert chain.queued_steps >= chain.taken_steps
    else:                       # requests leaving: some taken for fewer rows
        assert chain.subset_steps > 0
    # Drafts were accepted (else equal outputs would say little about the drafts).
    assert chain.worker.stats.num_accepted_tokens > 0


def assert_drafts_are_the_hosts(recorders, reqs, outs):
    """Every VERIFY's draft row (the host's, a chained step's, a dropped one's) is the host
    drafter's for the committed tokens at that length, at that row's K; -> rows checked."""
    checked = 0
    for recorder in recorders:
        for i, (prompt, _) in enumerate(reqs):
            full = prompt + outs[i]
            for length, drafts in recorder.verified.get(SEEDS[0] + i, []):
                if length <= len(full):
                    assert drafts == host_drafts(full[:length], len(drafts), 1, 3), (i, length)
                    checked += 1
    return checked


def reservations_never_shrink(worker, seen):
    """Wrap the runner's ``reserve``: ``seen`` gets, per call, whether every request kept
    at least the pages it held (RESCAN's trim gives pages back, a reservation never)."""
    reserve, pages = worker.runner.reserve, worker.runner.pages

    def checked(requests, extra):
        requests = list(requests)
        before = [len(pages.pages_of(r.batch_slot)) for r in requests]
        reserve(requests, extra)
        seen.append(all(len(pages.pages_of(r.batch_slot)) >= n
                        for r, n in zip(requests, before)))
    worker.runner.reserve = checked


async def adaptive_chain_run(tiny_dir, tiny_loaded, reqs, pattern, chained, reserved=None,
                             graph_cache=None):
    """Serve ``reqs`` with n-gram under adaptive K held to ``pattern`` (one CUDA rank's
    path on the CPU), chained on the device or not; -> (outputs, the chain or None).
    ``reserved``: a list for ``reservations_never_shrink``; ``graph_cache``: another
    cache component than ``chain_config``'s."""
    from specloop.engine import AsyncEngine, EngineConfig

    from ..engine.conftest import serve_staggered

    cfg = chain_config(tiny_dir, True, method="ngram", k=3, rejection=True,
                       speculative={"adaptive": True})
    if graph_cache is not None:
        data = cfg.to_dict()
        data["components"]["graph_cache"] = graph_cache
        cfg = EngineConfig.from_dict(data)
    async with AsyncEngine(cfg, model=tiny_loaded) as engine:
        worker = engine.worker
        one_rank_adaptive(worker, chained, pattern)
        if reserved is not None:
            reservations_never_shrink(worker, reserved)
        outs = await serve_staggered(engine, [(p, params, 0) for p, params in reqs])
        return outs, worker.chain if chained else None


async def test_chained_ngram_under_adaptive_k(tiny_dir, tiny_loaded):
    """Adaptive K (the chain queues the next iteration's K, into and out of K = 0 too;
    K = 0 stretches step ahead without the drafter, so DRAFT skips iterations and the
    device's token rows miss those tokens until the next chained step copies them): the
    same outputs as the same K per iteration unchained, and every VERIFY's drafts are the
    host drafter's at its K."""
    reqs = ngram_requests()
    pattern = [3, 3, 2, 2, 3, 1, 1, 3, 0, 0, 2, 0, 1, 3]
    planted.RECORDERS.clear()
    plain, _ = await adaptive_chain_run(tiny_dir, tiny_loaded, reqs, pattern, False)
    chained, chain = await adaptive_chain_run(tiny_dir, tiny_loaded, reqs, pattern, True)
    assert chained == plain and chain.taken_steps >= 5
    assert chain.k0_steps >= 3      # chained into and out of K = 0
    assert assert_drafts_are_the_hosts(planted.RECORDERS, reqs, chained) > 50


@pytest.mark.parametrize("rows", [1, 3])
async def test_k0_after_a_chained_k0_step_takes_the_inputs_its_graph_wrote(tiny_dir,
                                                                          tiny_loaded,
                                                                          rows):
    """A K = 0 step queued ahead right after a K = 0 step the chain queued replays the
    K = 0 graph on the inputs that replay wrote (``RunAhead.chained_k0``: nothing built on
    the host), and the outputs equal the unchained engine's, greedy and seeded sampled
    alike: one request, and three that end apart (a batch bucket with padding rows, rows
    leaving: those steps take inputs built on the host). No reservation gives pages back
    (the chain's reach is 2K + 1 positions, the step ahead's 1: a reservation that
    resized both ways gave the chain's pages back at each switch into K = 0)."""
    pattern = [2, 0, 0, 0, 3, 0, 0, 3, 1, 0, 0]
    for params in (SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
                   SamplingParams(temperature=0.9, top_p=0.9, seed=SEEDS[0],
                                  max_tokens=60, ignore_eos=True)):
        reqs = [([300, 5, 300, 5, 300, 5, 300, 5][i:], attrs.evolve(
            params, max_tokens=params.max_tokens - 13 * i,
            seed=None if params.seed is None else params.seed + i)) for i in range(rows)]
        plain, _ = await adaptive_chain_run(tiny_dir, tiny_loaded, reqs, pattern, False)
        reserved = []
        chained, chain = await adaptive_chain_run(tiny_dir, tiny_loaded, reqs, pattern,
                                                  True, reserved)
        assert chained == plain
        ahead = chain.worker.ahead
        assert ahead.after_chain_steps >= (8 if rows == 1 else 4), \
            (ahead.after_chain_steps, chain.k0_steps)
        assert reserved and all(reserved)


async def test_switching_out_of_k0_finds_its_pages(tiny_dir, tiny_loaded):
    """Adaptive n-gram switching between K = 0 stretches and chained K = 3 steps: the
    steps queued ahead at K = 0 keep pages as far as a chained step reaches, so neither
    the switch out of K = 0 (the chained step's reservation) nor the one into it (the
    trim) changes the page table: it changes once per page of tokens, and the outputs
    equal the unchained engine's. Each step out of K = 0 writes VERIFY's tokens and
    counts into the draft graph's static inputs (``DeviceChain._into_statics``), which
    n-gram hands to the replay as they are (no padded tensor, nothing for it to copy)."""
    from specloop.engine._chain import DeviceChain
    from specloop.models import _cache
    from specloop.models.drafters._ngram import NgramDrafter

    dirty, written, passed = [], [], []
    sync, into_statics = _cache.PageTable.sync, DeviceChain._into_statics
    chained_inputs = NgramDrafter.chained_inputs

    def counted(self):
        dirty.append(bool(self._dirty))
        return sync(self)

    def seen_written(*args):
        out = into_statics(*args)
        written.append(out is not None)
        return out

    def passed_through(self, verified, start, slots, sampling, into=None, **kw):
        out = chained_inputs(self, verified, start, slots, sampling, into=into, **kw)
        if into is not None and verified["token_ids"] is into["verified"]:
            passed.append(out["verified"] is into["verified"]
                          and out["accepted"] is into["accepted"])
        return out
    pattern = [0, 0, 0, 0, 0, 0, 3, 3]
    tokens = 200
    reqs = [([300, 5, 300, 5, 300, 5, 300, 5],
             SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))]
    plain, _ = await adaptive_chain_run(tiny_dir, tiny_loaded, reqs, pattern, False)
    _cache.PageTable.sync = counted
    DeviceChain._into_statics = staticmethod(seen_written)
    NgramDrafter.chained_inputs = passed_through
    try:
        chained, chain = await adaptive_chain_run(tiny_dir, tiny_loaded, reqs, pattern, True)
    finally:
        _cache.PageTable.sync = sync
        DeviceChain._into_statics = staticmethod(into_statics)
        NgramDrafter.chained_inputs = chained_inputs
    assert chained == plain and chain.k0_steps >= 20
    # One per switch out of K = 0 (``k0_steps`` counts those and the switches into it).
    assert all(written) and len(written) >= chain.k0_steps // 2 - 1, (written, chain.k0_steps)
    assert passed and all(passed) and len(passed) == len(written), passed
    page = chain.worker.runner.pages.page_size
    assert sum(dirty) <= (tokens + 16) // page + 4, (sum(dirty), len(dirty))


async def test_one_rank_records_the_classes_its_k_was_committed_with(tiny_dir, tiny_loaded):
    """One GPU rank's path (forced on the CPU): VERIFY n computes the next iteration's
    rows' draft classes, the rule commits K for it, and that iteration's RESCAN counts its
    acceptance under those classes (not the classes of its own, later tokens)."""
    from specloop.engine import AsyncEngine
    from specloop.engine._chain import DeviceChain

    from ..engine.test_adaptive import switching_cost

    cfg = chain_config(tiny_dir, True, method="ngram", k=3, rejection=True,
                       speculative={"adaptive": True})
    events = []
    async with AsyncEngine(cfg, model=tiny_loaded) as engine:
        w = engine.worker
        w.verify_inline = w.ahead.at_k0 = True
        w.chain = DeviceChain(worker=w)
        adaptive = w.adaptive
        adaptive.cost = switching_cost()
        classes_of, commit, committed = w.draft_classes, adaptive.commit, \
            adaptive.choose_committed
        record = adaptive.record

        def logged_classes(batch):
            out = classes_of(batch)
            events.append(("classes", list(out)))
            return out

        def logged_commit(k):
            events.append(("commit", k))
            commit(k)

        def logged_committed(batch):
            events.append(("committed",))
            return committed(batch)

        def logged_record(k, accepted, classes=None, tail_accepted=None, **options):
            events.append(("record", k, None if classes is None else list(classes)))
            record(k, accepted, classes, tail_accepted, **options)
        w.draft_classes, adaptive.commit = logged_classes, logged_commit
        adaptive.choose_committed, adaptive.record = logged_committed, logged_record
        for prompt, params in ngram_requests()[:3]:
            async for _ in engine.generate(prompt, params):
                pass
    checked, last_commit, new_request = 0, None, []
    unclassed = adaptive.classes
    for i, event in enumerate(events):
        if event[0] == "commit":
            last_commit = events[i - 1][1]        # the classes computed just before it
        if event[0] == "committed":
            recorded = next(e for e in events[i:] if e[0] == "record")
            if recorded[2] != last_commit:
                # The commit was for the last request's next iteration, and a new request
                # came instead (its step is dropped): its row is unclassed, not guessed.
                new_request.append(recorded[2])
            else:
                checked += 1
    assert checked >= 10 and new_request == [[unclassed]] * len(new_request)
    assert len(new_request) <= 2                  # 3 requests one after another


@pytest.mark.gpu
# Under adaptive K the chained and unchained runs verify a position at different K (a
# dropped chained step shifts the cycle), and bf16 logits depend on the VERIFY shape (GEMM
# tiling): only float64 makes their outputs comparable token for token.
@pytest.mark.parametrize(("dtype", "adaptive"), [(torch.float64, False),
                                                 (torch.bfloat16, False),
                                                 (torch.float64, True)])
async def test_chained_ngram_on_cuda(tiny_dir, dtype, adaptive):
    """Real CUDA graphs and the Triton draft kernel (chained by default on one GPU, also
    under adaptive K, K cycled): the outputs of the same graphs run unchained, and
    (float64) of the eager engine."""
    from specloop.engine import AsyncEngine
    from specloop.models import load_model

    from ..engine.conftest import serve_staggered
    from .test_cuda_graphs import cfg

    loaded = load_model(tiny_dir, dtype=dtype, device="cuda")
    reqs = [(p, params, 0.002 * i) for i, (p, params) in enumerate(ngram_requests())]

    async def go(graphs, chained):
        config = cfg(tiny_dir, graphs, method="ngram", k=3, rejection=True,
                     speculative={"adaptive": adaptive})
        async with AsyncEngine(config, model=loaded) as engine:
            worker = engine.worker
            if not chained:
                worker.chain = None
            if adaptive:
                from ..engine.test_adaptive import cycle_k
                cycle_k(worker.adaptive, [3, 3, 2, 0, 1, 3, 3])
            outs = await serve_staggered(engine, reqs)
            taken = worker.chain.taken_steps if worker.chain is not None else 0
            accepted = worker.stats.num_accepted_tokens
        return outs, taken, accepted

    # Where two runs' K differ at a position (adaptive K: which chained steps drop
    # depends on the arrival timing), a sampled row's draws differ too (another draft,
    # another exact sample): then only the greedy rows must match token for token.
    rows = [i for i, (_, params, _) in enumerate(reqs)
            if params.temperature == 0 or not adaptive]
    unchained, _, _ = await go(True, False)
    chained, taken, accepted = await go(True, True)
    assert taken > 0 and accepted > 0
    assert [chained[i] for i in rows] == [unchained[i] for i in rows]
    if dtype == torch.float64:
        eager, _, _ = await go(False, False)
        assert [chained[i] for i in rows] == [eager[i] for i in rows]
