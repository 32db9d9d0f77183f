"""Requests admitted together share prefill forwards (``ModelRunner.prefill_many``, on by
default on a GPU): equal to one forward per request, token for token."""

import anyio
import pytest
import torch

from specloop.engine import AsyncEngine
from specloop.samplers import SamplingParams

from .conftest import make_config, serve_staggered

# The requests the prefill tests build by hand (a Request reads its params' greediness).
GREEDY = SamplingParams(temperature=0.0)

# Lengths 1 (nothing to prefill), 40 (over the 24- or 32-token budget: alone, in chunks)
# and short ones that share forwards, padded to the longest of their group.
LENGTHS = [5, 1, 9, 40, 3, 12, 7, 2]


@pytest.mark.parametrize("method", ["none", "mtp_eagle"])   # mtp_eagle reads the hidden
@pytest.mark.parametrize("padded", [False, True])
async def test_batched_prefill_equals_one_forward_per_request(tiny_dir, tiny_loaded, method,
                                                              padded):
    """``padded``: rows and width padded to powers of two (``pad_prefill``, the GPU's
    shapes, whose graphs warm-up captures; padding rows are the scratch slot's), and the
    long prompt's chunks forwarded as one-row groups."""
    prompts = [[(11 * i + 7 * j) % 300 + 3 for j in range(n)] for i, n in enumerate(LENGTHS)]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + i, ignore_eos=True) if i % 2
              else SamplingParams(temperature=0.9, seed=i, max_tokens=6 + i, ignore_eos=True)
              for i in range(len(prompts))]

    async def run(batched):
        rows, hidden = [], {}       # forward sizes; the drafter's prefill input by prompt
        config = make_config(tiny_dir, method=method, scheduler={
            "max_batch_size": 6, "max_num_tokens": 32 if padded else 24})
        async with AsyncEngine(config, model=tiny_loaded) as engine:
            runner = engine.worker.runner
            runner.batch_prefill = batched
            runner.pad_prefill = batched and padded
            forward_rows = runner._prefill_rows
            runner._prefill_rows = lambda group, *rest: (rows.append(len(group))
                                                         or forward_rows(group, *rest))
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
    chunks = 2 if padded else 0     # the long prompt's, when they go through _prefill_rows
    assert none == [] and max(rows) >= 2 and sum(rows) == len(LENGTHS) - 2 + chunks


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
        requests = [Request(f"r{i}", (), GREEDY, 0, [(13 * i + j) % 380 + 1 for j in range(n)],
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


@pytest.mark.gpu
def test_prefill_graphs_replay_what_the_padded_eager_forward_computes(tmp_path):
    """The prefill graphs warm-up captures (one per padded shape) give each request the
    hidden states and prompt K/V that the eager forward at the same padded shape gives,
    bit for bit, long prompts in one-row chunks, a group of 3 rows on the 4-row graph."""
    from specloop.engine._request import Request
    from specloop.engine._runner import ModelRunner
    from specloop.graphs import CudaGraphCache
    from specloop.models import load_model
    from specloop.models.testing import write_tiny_checkpoint

    loaded = load_model(write_tiny_checkpoint(tmp_path / "m", vocab_size=384, num_layers=2,
                                              hidden=64, seed=1),
                        dtype=torch.bfloat16, device="cuda")
    # Budget 64: [5, 17, 12] share a 4 x 16 forward (a padding row), 200 runs in one-row
    # chunks (64, 64, 64, 7: widths 64 and 16), 40 alone at 64, 9 alone at 16; 1: nothing.
    lengths = [5, 200, 17, 1, 12, 40, 9]

    def run(graphs):
        runner = ModelRunner(loaded, num_slots=8, max_seq_len=256, max_prefill_tokens=64)
        runner.feature_layers = (0, 1)
        cache = capture_prefill(runner, CudaGraphCache(buckets=(1,))) if graphs else None
        requests = [Request(f"r{i}", (), GREEDY, 0, [(13 * i + j) % 380 + 1 for j in range(n)],
                            slot=7 - i) for i, n in enumerate(lengths)]
        hidden = runner.prefill_many(requests)
        return hidden, prompt_kv(runner, requests), cache

    (h1, kv1, _), (h2, kv2, cache) = run(False), run(True)
    replayed = {(key.batch_size, key.tokens): n for key, n in cache.replay_counts().items()
                if n}
    assert replayed == {(4, 16): 1, (1, 64): 4, (1, 16): 2}
    for a, b, ka, kb in zip(h1, h2, kv1, kv2):
        assert torch.equal(a, b) and torch.equal(ka, kb)


def test_head_prefill_at_padded_shapes_writes_what_one_forward_per_prompt_does(
        tiny_dir, tiny_loaded):
    """The MTP head's prefill grouped by the padded shapes its graphs are captured at
    (``prefill_graphs`` on a GPU; set by hand here, run eagerly at those shapes: padding
    rows on the scratch slot, widths rounded up) writes the same head K/V at every prompt
    position as one forward per prompt (float64)."""
    from specloop.models._prefill import prefill_shapes

    # Budget 64, by width: [2, 3, 5] on the 4 x 16 shape (a padding row), 21 at 1 x 32,
    # 40 at 1 x 64, 70 wider than the widest shape (eager, unpadded); 1: nothing to feed.
    lengths = [5, 1, 3, 2, 21, 40, 70]
    slots = list(range(len(lengths)))

    def run(shapes):
        engine = AsyncEngine(make_config(tiny_dir, method="mtp_eagle", max_batch_size=8),
                             model=tiny_loaded)
        engine._build()
        runner, drafter = engine.worker.runner, engine.worker.drafter
        drafter.batch_prefill = bool(shapes)
        drafter._prefill_shapes = frozenset(shapes)
        gen = torch.Generator().manual_seed(0)
        ids = [[(7 * s + j) % 300 + 3 for j in range(n)] for s, n in zip(slots, lengths)]
        hidden = [torch.randn(n, drafter.head.feature_size, generator=gen,
                              dtype=torch.float64) for n in lengths]
        for s, n in zip(slots, lengths):
            runner.pages.resize(s, n + 1)
        drafter.prefill_many(slots, ids, hidden)
        return kv_at(runner.pages, drafter.cache, [(s, n - 1) for s, n in zip(slots, lengths)])

    for a, b in zip(run(()), run(prefill_shapes(8, 64))):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-12)


async def test_inline_prefill_runs_on_the_loops_thread_and_equals_the_threads(
        tiny_dir, tiny_loaded):
    """``Worker.prefill_inline`` (a GPU's default: launches that hold the GIL, where a
    worker thread's two hops cost ~0.5 ms a prefill): the prefill runs on the event loop's
    thread, a worker thread's otherwise; staggered requests (admitted while others run)
    get the same tokens either way."""
    import threading   # noqa: PLC0415

    prompts = [[(13 * i + 5 * j) % 300 + 3 for j in range(n)] for i, n in enumerate(LENGTHS)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=5 + i,
                             ignore_eos=True) for i in range(len(prompts))]

    async def run(inline):
        threads = set()
        async with AsyncEngine(make_config(tiny_dir, method="ngram"),
                               model=tiny_loaded) as engine:
            worker = engine.worker
            assert worker.prefill_inline is False       # the CPU's default
            worker.prefill_inline = inline
            prefill = worker._prefill
            worker._prefill = lambda admitted: (threads.add(threading.get_ident()),
                                                prefill(admitted))
            out = await serve_staggered(engine, [(p, q, 0.01 * (i % 3)) for i, (p, q) in
                                                 enumerate(zip(prompts, params))])
        return out, threads

    (want, threaded), (got, inline) = await run(False), await run(True)
    assert got == want
    assert inline == {threading.get_ident()} and threading.get_ident() not in threaded


def test_prefill_inline_on_a_gpu_unless_the_environment_says(monkeypatch):
    from specloop.engine._worker import prefill_inline  # noqa: PLC0415

    monkeypatch.delenv("SPECLOOP_PREFILL_INLINE", raising=False)
    assert prefill_inline(torch.device("cuda")) and not prefill_inline(torch.device("cpu"))
    monkeypatch.setenv("SPECLOOP_PREFILL_INLINE", "0")
    assert not prefill_inline(torch.device("cuda"))
    monkeypatch.setenv("SPECLOOP_PREFILL_INLINE", "1")
    assert prefill_inline(torch.device("cpu"))


def capture_prefill(runner, cache):
    """``runner``'s prefill graphs captured in ``cache``, which its prefill then replays."""
    with torch.inference_mode():
        for key, step, example in runner.prefill_graphs():
            cache.capture(key, step, example)
    runner.prefill_cache = cache
    return cache


def kv_at(pages, cache, rows) -> list[torch.Tensor]:
    """``cache``'s K/V of each (slot, n) of ``rows`` at the slot's first n positions
    through the page table ``pages``, [2, layers, n, ...]."""
    kv = []
    for slot, n in rows:
        at = torch.tensor(pages.pages_of(slot), device=cache.k.device)
        kv.append(torch.stack([cache.k[:, at], cache.v[:, at]]).flatten(2, 3)[:, :, :n])
    return kv


def prompt_kv(runner, requests) -> list[torch.Tensor]:
    """Each request's target K/V at its prompt's positions but the last (what prefill
    writes)."""
    return kv_at(runner.pages, runner.cache, [(r.slot, r.seq_len - 1) for r in requests])


def handed_cache(handed: list[bool]) -> type:
    """A cache that replays as ``CudaGraphCache`` does on the CPU (test_chain_into_verify's)
    and appends to ``handed``, at each replay, whether every input handed in was the
    graph's static input itself (nothing to copy)."""
    from ..graphs.test_chain_into_verify import GraphLikeCache

    class Handed(GraphLikeCache):
        def replay(self, key, inputs):
            statics = self._graphs[key].inputs
            handed.append(all(inputs[name] is statics[name] for name in statics))
            return super().replay(key, inputs)
    return Handed


def test_graphed_prefill_writes_its_inputs_into_the_graphs_static_inputs(tiny_loaded):
    """A captured prefill shape's inputs go from the runner's staging ring straight into
    the graph's static inputs (handed to the replay, which copies nothing), one ring
    buffer a forward, the ring taken round more than once: hidden states and prompt K/V
    equal the eager padded forward's (on the CPU, a cache that replays as
    ``CudaGraphCache`` does)."""
    from specloop.engine._request import Request
    from specloop.engine._runner import ModelRunner

    handed: list[bool] = []
    Handed = handed_cache(handed)

    # One-row forwards (16 and 64 wide, the 200-token prompt in chunks), then a group.
    alone = [5, 17, 40, 9, 12, 3, 200, 30, 2]
    grouped = [6, 11, 4]

    def run(graphs):
        runner = ModelRunner(tiny_loaded, num_slots=16, max_seq_len=256,
                             max_prefill_tokens=64)
        runner.batch_prefill = runner.pad_prefill = True
        if graphs:
            capture_prefill(runner, Handed(buckets=(1,)))
        requests = [Request(f"r{i}", (), GREEDY, 0,
                            [(13 * i + j) % 300 + 1 for j in range(n)], slot=i)
                    for i, n in enumerate(alone + grouped)]
        hidden = [h for r in requests[:len(alone)] for h in runner.prefill_many([r])]
        hidden += runner.prefill_many(requests[len(alone):])
        return hidden, prompt_kv(runner, requests)

    (h1, kv1), (h2, kv2) = run(False), run(True)
    # 8 one-row forwards, the long prompt's 4 chunks and the group's one: past the ring's
    # 8 buffers.
    assert handed == [True] * 13
    for a, b, ka, kb in zip(h1, h2, kv1, kv2):
        assert a.shape == b.shape and torch.equal(a, b) and torch.equal(ka, kb)


def test_head_prefill_graphs_take_their_inputs_in_place(tiny_dir, tiny_loaded):
    """The MTP head's prefill at captured shapes (``DraftPrefillReplay``, warm-up's): its
    slots, tokens and feature rows are written into the graph's static inputs and handed
    to the replay (which copies nothing); the stale padding a shape's last, longer prompt
    left there changes nothing: head K/V at every prompt position equal one eager forward
    per prompt. On the CPU, a cache that replays as ``CudaGraphCache`` does (the head's
    graphs are captured on a GPU only: its fused kernels)."""
    from specloop.engine._runner import prefill_key
    from specloop.engine._warmup import DraftPrefillReplay
    from specloop.models._prefill import prefill_shapes

    handed: list[bool] = []
    Handed = handed_cache(handed)

    # Alone, one after another: 14 then 9 on the 1 x 16 shape (9's padding is 14's stale
    # rows), 40 then 21 on 1 x 64 and 1 x 32; then [2, 3, 5] together on 4 x 16.
    alone, together = [14, 9, 40, 21], [5, 3, 2]
    lengths = alone + together

    def run(graphs):
        engine = AsyncEngine(make_config(tiny_dir, method="mtp_eagle", max_batch_size=8),
                             model=tiny_loaded)
        engine._build()
        runner, drafter = engine.worker.runner, engine.worker.drafter
        if graphs:
            cache = Handed(buckets=(1,))
            drafter.batch_prefill = True
            shapes = prefill_shapes(8, 64)
            drafter._prefill_shapes = frozenset(shapes)
            drafter._prefill_replay = DraftPrefillReplay(cache)
            size = drafter.head.feature_size
            with torch.inference_mode():
                for rows, width in shapes:
                    cache.capture(prefill_key(rows, width, stage="draft-prefill"),
                                  drafter._prefill_step,
                                  {"tokens": torch.zeros(rows, width, dtype=torch.int64),
                                   "features": torch.zeros(rows, width, size,
                                                           dtype=drafter.cache.dtype),
                                   "slots": torch.full((rows,), drafter.scratch)})
        gen = torch.Generator().manual_seed(0)
        slots = list(range(len(lengths)))
        ids = [[(7 * s + j) % 300 + 3 for j in range(n)] for s, n in zip(slots, lengths)]
        hidden = [torch.randn(n, drafter.head.feature_size, generator=gen,
                              dtype=torch.float64) for n in lengths]
        for s, n in zip(slots, lengths):
            runner.pages.resize(s, n + 1)
        for s in range(len(alone)):
            drafter.prefill_many([s], [ids[s]], [hidden[s]])
        rest = slots[len(alone):]
        drafter.prefill_many(rest, [ids[s] for s in rest], [hidden[s] for s in rest])
        return kv_at(runner.pages, drafter.cache, [(s, n - 1) for s, n in zip(slots, lengths)])

    want, got = run(False), run(True)
    assert handed == [True] * 5
    for a, b in zip(want, got):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-12)
