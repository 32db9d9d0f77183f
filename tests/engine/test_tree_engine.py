"""Draft trees through the engine (``speculative.tree``; CPU, the tiny float64 model, an
eagle3 head drafting the target's own next token, so drafts are accepted): greedy equals
greedy without speculation and seeded sampled rows what they emit without it, batches
verified strictly draft the tree and batches on the advanced path (rejection sampling)
its chain, the tree accepts more than its chain alone, and the configurations it cannot
run are refused with a message naming the field."""

import collections

import pytest
import torch
from safetensors.torch import save_file

from specloop.comm import LocalGroup
from specloop.engine import AsyncEngine
from specloop.engine._errors import ConfigError, RequestError
from specloop.samplers import SamplingParams
from specloop.samplers._tree import DraftTree
from specloop.train import TrainableEagle3Head

from .conftest import collect, make_config, serve_staggered
from .test_engine import reference_greedy

# The chain of 3 and siblings at every depth.
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]


@pytest.fixture(scope="module")
def head_file(tiny_loaded, tmp_path_factory):
    model = tiny_loaded.model
    head = TrainableEagle3Head(tiny_loaded.args, model.embed_tokens, model.lm_head_weight,
                               torch.arange(384), 64, (0, 2, 3))
    head.init_from_target(model, seed=5)
    path = tmp_path_factory.mktemp("head") / "h.safetensors"
    save_file({k: v.contiguous() for k, v in head.export_state().items()}, str(path),
              metadata={"method": "eagle3", "feature_layers": "0,2,3"})
    return path


def tree_config(tiny_dir, head_file, tree=TREE, components=None, parallel=None,
                max_seq_len=256, rejection=False, **spec):
    sections = {name: value for name, value in (("components", components),
                                                ("parallel", parallel)) if value}
    return make_config(tiny_dir, method="eagle3", k=3, max_seq_len=max_seq_len,
                       rejection=rejection, speculative={
        "draft_weights": str(head_file), **({"tree": tree} if tree else {}), **spec},
        **sections)


def requests(sampled_every=0):
    out = []
    for i in range(8):
        prompt = [3 + i, 40 + 2 * i, 7, 90 + i, 3 + i, 40 + 2 * i]
        if sampled_every and i % sampled_every == sampled_every - 1:
            params = SamplingParams(temperature=0.9, seed=100 + i, max_tokens=20 + i,
                                    ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=24 + 3 * i, ignore_eos=True)
        out.append((prompt, params, 0.02 * (i % 3)))
    return out


class Drafted:
    """Per VERIFY: (rows, drafts per row as the iteration's event reports them)."""

    def __init__(self):
        self.rows: list[tuple[int, int]] = []

    def on_transition(self, event):
        if event.accepted is not None:
            self.rows.append((len(event.accepted), event.num_draft_tokens))


async def run(config, loaded, reqs):
    drafted = Drafted()
    async with AsyncEngine(config, model=loaded, observers=[drafted]) as engine:
        outs = await serve_staggered(engine, reqs)
        stats = engine.stats
    return outs, stats, drafted


async def test_greedy_with_a_tree_equals_greedy_without(tiny_dir, tiny_loaded, head_file):
    """Greedy requests alone: every iteration drafts the tree (8 nodes)."""
    reqs = requests()
    outs, stats, drafted = await run(tree_config(tiny_dir, head_file), tiny_loaded, reqs)
    for (prompt, params, _), out in zip(reqs, outs):
        assert out == reference_greedy(tiny_loaded, prompt, params.max_tokens)
    assert {k for _, k in drafted.rows} == {len(TREE)}
    assert stats.num_accepted_tokens > 0
    # A tree's drafts per row are counted as its depth (what a path can accept).
    assert sum(stats.drafted_per_position) == stats.num_draft_tokens
    assert len(stats.drafted_per_position) == 3


async def test_sampled_rows_draft_the_tree_and_emit_what_they_would_without_speculation(
        tiny_dir, tiny_loaded, head_file):
    """Sampled requests among greedy ones, verified strictly (no rejection sampling):
    every iteration drafts the tree, and every output equals the chain-only engine's and
    the engine's without speculation, the seeded sampled ones too (a row's token at a
    position is the target's draw there with the same uniform, whichever node it
    follows: samplers/_tree.py)."""
    reqs = requests(sampled_every=3)
    tree_outs, stats, drafted = await run(tree_config(tiny_dir, head_file), tiny_loaded,
                                          reqs)
    chain_outs, _, _ = await run(tree_config(tiny_dir, head_file, tree=None), tiny_loaded,
                                 reqs)
    plain_outs, _, _ = await run(make_config(tiny_dir), tiny_loaded, reqs)
    assert tree_outs == chain_outs == plain_outs
    assert {k for _, k in drafted.rows} == {len(TREE)}
    assert stats.num_accepted_tokens > 0


async def test_with_rejection_sampling_a_batch_that_samples_drafts_the_chain(
        tiny_dir, tiny_loaded, head_file):
    """With rejection sampling on, a batch with a sampled row is on the advanced path: it
    drafts (sampling) and verifies the chain of 3 as without a tree; all-greedy batches
    the tree. Every output equals the chain-only engine's (a sampled request is in
    advanced batches only, so its drafts and draws are the chain engine's)."""
    reqs = requests(sampled_every=3)
    tree_outs, _, drafted = await run(tree_config(tiny_dir, head_file, rejection=True),
                                      tiny_loaded, reqs)
    chain_outs, _, _ = await run(tree_config(tiny_dir, head_file, tree=None, rejection=True),
                                 tiny_loaded, reqs)
    assert tree_outs == chain_outs
    kinds = collections.Counter(k for _, k in drafted.rows)
    assert kinds[3] and kinds[len(TREE)], kinds
    # With graphs: the tree's keys are captured for the all-greedy variant only (the
    # other one is on the advanced path), and the outputs do not change.
    from ..graphs.test_static_steps import StepReplayCache

    config = tree_config(tiny_dir, head_file, rejection=True, components={
        "graph_cache": "tests.graphs.test_static_steps:StepReplayCache"})
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        assert await serve_staggered(engine, reqs) == tree_outs
        cache = engine.worker.graph_cache
    assert isinstance(cache, StepReplayCache)
    assert {key.all_greedy for key in cache._graphs
            if key.num_draft_tokens == len(TREE)} == {True}


async def test_the_chain_as_a_tree_drafts_the_chains_tokens(tiny_dir, tiny_loaded, head_file):
    """The tree of first choices (0,), (0, 0), (0, 0, 0) drafts what the chain of 3 drafts
    (the head's top-1 at each depth, over the same ancestors) and so accepts the same at
    every position (a request's drafts do not depend on its batch neighbours: float64,
    rows apart)."""
    reqs = requests()
    chain_tree = [[0], [0, 0], [0, 0, 0]]
    _, tree_stats, _ = await run(tree_config(tiny_dir, head_file, tree=chain_tree),
                                 tiny_loaded, reqs)
    _, chain_stats, _ = await run(tree_config(tiny_dir, head_file, tree=None), tiny_loaded,
                                  reqs)
    assert tree_stats.num_accepted_tokens == chain_stats.num_accepted_tokens > 0
    assert tree_stats.accepted_per_position == chain_stats.accepted_per_position
    assert tree_stats.num_verify_rows == chain_stats.num_verify_rows


async def test_the_tree_accepts_more_than_its_chain(tiny_dir, tiny_loaded, head_file):
    """The tree holds the chain of 3 (its first choices): with the same head its requests
    take fewer VERIFY rows for the same greedy tokens."""
    reqs = requests()
    _, tree_stats, _ = await run(tree_config(tiny_dir, head_file), tiny_loaded, reqs)
    _, chain_stats, _ = await run(tree_config(tiny_dir, head_file, tree=None), tiny_loaded,
                                  reqs)
    assert tree_stats.num_accepted_tokens > chain_stats.num_accepted_tokens
    # Fewer VERIFY rows (a request's rows do not depend on when its neighbours arrived).
    assert tree_stats.num_verify_rows < chain_stats.num_verify_rows


async def test_a_tree_leaves_room_in_the_cache_for_its_nodes(tiny_dir, tiny_loaded,
                                                              head_file):
    """A VERIFY writes all 8 nodes past a request's length: a prompt must leave room for
    them (not just the chain's 3), and a request ends by length before they would pass
    max_seq_len, its tokens greedy decoding's."""
    config = tree_config(tiny_dir, head_file, max_seq_len=64)
    prompt = [(7 * i + 3) % 384 for i in range(40)]
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        with pytest.raises(RequestError, match="with 8 draft tokens allows at most 55"):
            await collect(engine, [5] * 56, SamplingParams(temperature=0.0, max_tokens=1))
        out = await collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=100,
                                                           ignore_eos=True))
    assert len(prompt) + len(out) == 64 - len(TREE)
    assert out == reference_greedy(tiny_loaded, prompt, len(out))


async def test_a_tree_in_a_process_engine(tiny_dir, tiny_loaded, head_file):
    """The engine core in its own process runs the tree (greedy: greedy decoding's tokens)
    and its front door checks a prompt's room for the tree's nodes (the core's
    ``verify_drafts``)."""
    import anyio

    from specloop.engine import ProcessEngine

    config = tree_config(tiny_dir, head_file, max_seq_len=64)
    prompt = [(5 * i + 2) % 384 for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    async with ProcessEngine(config) as engine:
        with anyio.fail_after(120):
            assert await collect(engine, prompt, params) == \
                reference_greedy(tiny_loaded, prompt, 20)
            with pytest.raises(RequestError, match="with 8 draft tokens"):
                await collect(engine, [5] * 56, params)


@pytest.mark.parametrize("spec, field, words", [
    ({"tree": [[0], [0, 0]]}, "speculative.tree", "set num_draft_tokens = 2"),
    ({"tree": [[0], [1, 0]]}, "speculative.tree", "no parent"),
])
def test_a_tree_the_engine_cannot_run_is_refused_by_the_config(tiny_dir, head_file, spec,
                                                              field, words):
    with pytest.raises(ConfigError, match=words) as info:
        tree_config(tiny_dir, head_file, **spec)
    assert info.value.field == field


@pytest.mark.parametrize("world, rejection, lm_head_tp", [
    (2, False, False), (3, False, False), (2, True, False),
    (2, False, True), (3, False, True), (2, True, True)])
async def test_a_tree_under_adp_equals_one_rank(tiny_dir, tiny_loaded, head_file, world,
                                                rejection, lm_head_tp):
    """Attention data parallelism (LocalGroup ranks, 2 rows a rank), greedy and seeded
    sampled requests: rank 0's outputs equal one rank's with the tree, every rank served
    some and drafted trees. Without LM-head TP each rank drafts and verifies its own
    batch's tree and nothing of it is collective (with rejection sampling a rank whose
    batch samples drafts the chain while another drafts the tree): the group ran one
    tensor collective an iteration, in SCHEDULE only. With LM-head TP every rank, an idle
    one too, enters each depth's two collectives (the rows' hidden states, then the top
    ranks across the vocabulary shards: ``distributed_topk``) in DRAFT and nowhere else,
    as many on every rank (a rank that missed one would hang the group)."""
    from specloop.comm import CollectiveCounter

    from .test_adp import LabelByState, run_group

    reqs = requests(sampled_every=3)
    one, _, _ = await run(tree_config(tiny_dir, head_file, rejection=rejection),
                          tiny_loaded, reqs)
    config = make_config(tiny_dir, method="eagle3", k=3, max_batch_size=2,
                         rejection=rejection, speculative={
                             "draft_weights": str(head_file), "tree": TREE},
                         parallel={"world_size": world, "attention_dp": True,
                                   "lm_head_tp_in_adp": lm_head_tp})
    counters, iterations, trees = {}, collections.Counter(), collections.Counter()

    def wrap(comm):
        counters[comm.rank] = CollectiveCounter(comm)
        return counters[comm.rank]

    class Count(LabelByState):
        def __init__(self, comm):
            super().__init__(counters[comm.rank])

        def on_transition(self, event):
            super().on_transition(event)
            iterations[event.rank] += event.state.value == "SYNC"
            trees[event.rank] += event.accepted is not None and \
                event.num_draft_tokens == len(TREE)

    results, _ = await run_group(world, config, tiny_loaded,
                                 lambda engine: serve_staggered(engine, reqs), wrap=wrap,
                                 observers=lambda comm: [Count(comm)], timeout=30.0)
    assert results[0] == one
    assert all(n > 0 for n in results[1:])
    assert all(trees[rank] > 0 for rank in range(world)), trees
    for rank, counter in counters.items():
        assert counter.count("all_gather_bytes", label="SCHEDULE") == iterations[rank] > 0
        quiet = ("SYNC", "PICK_GRAPH_KEY", "VERIFY", "RESCAN") if lm_head_tp else \
            ("SYNC", "PICK_GRAPH_KEY", "DRAFT", "VERIFY", "RESCAN")
        for state in quiet:
            assert counter.count(label=state) == 0, counter.by_label()
    if lm_head_tp:
        drafts = {rank: counter.count(label="DRAFT") for rank, counter in counters.items()}
        assert len(set(drafts.values())) == 1 and drafts[0] > 0, drafts


def small_batches_draft():
    """A fixed cost table: a draft costs 0.1 % of an iteration at batches 1 and 2, three
    iterations' worth at 4."""
    from specloop.engine._adaptive import CostTable

    per_draft = {1: 0.001, 2: 0.001, 4: 3.0}
    return CostTable({(b, k): 1.0 + per_draft[b] * k for b in per_draft for k in range(4)},
                     learn=False)


class Chosen:
    """Per PICK_GRAPH_KEY: (iteration, K as VERIFY runs it: a tree's node count)."""

    def __init__(self):
        self.ks: list[tuple[int, int]] = []

    def on_transition(self, event):
        if event.state.value == "PICK_GRAPH_KEY":
            self.ks.append((event.iteration, event.num_draft_tokens))


@pytest.mark.parametrize("graphs", [False, True])
async def test_adaptive_k_drafts_the_tree_for_its_largest_k(tiny_dir, tiny_loaded,
                                                           head_file, graphs):
    """Adaptive K with a tree (a fixed cost table: drafting nearly free at batches 1 and
    2, dear at 4):
    where the rule picks K = 3 on a batch that may draft the tree, the iteration drafts
    the tree (8 nodes), and its acceptance goes to the tree's own counts; K = 0 at large
    batches; greedy outputs equal greedy decoding's, sampled ones the engine's without
    speculation. With graphs (the step-replay cache): the same outputs, and warm-up's
    table timed the tree's graphs for K = 3 where they were captured (buckets 1, 2: their
    replays before serving; no timing compared, warm-up's times are noise-bound)."""
    reqs = requests(sampled_every=3)
    plain, _, _ = await run(make_config(tiny_dir, max_batch_size=4), tiny_loaded, reqs)
    components = {"graph_cache": "tests.graphs.test_static_steps:StepReplayCache"} \
        if graphs else None
    config = tree_config(tiny_dir, head_file, components=components, adaptive=True,
                         tree_max_batch=2)
    chosen = Chosen()
    async with AsyncEngine(config, model=tiny_loaded, observers=[chosen]) as engine:
        adaptive = engine.worker.adaptive
        # The tree's graphs replayed by warm-up's timing (``calibrate``), per stage.
        timed = {(key.stage, key.batch_size) for key, graph in
                 getattr(engine.worker.graph_cache, "_graphs", {}).items()
                 if key.num_draft_tokens == len(TREE) and graph.replays}
        adaptive.cost = small_batches_draft()
        outs = await serve_staggered(engine, reqs)
    assert outs == plain
    ks = collections.Counter(k for _, k in chosen.ks)
    assert ks[len(TREE)] and ks[0], ks
    assert sum(adaptive._tree_reached) > 0 and sum(adaptive._tree_accepted) > 0
    assert adaptive.chosen[3] >= ks[len(TREE)]
    if graphs:
        assert timed == {(stage, b) for stage in ("verify", "draft") for b in (1, 2)}, timed


async def test_adaptive_k_with_a_tree_under_lm_head_tp_runs_one_k_per_iteration(
        tiny_dir, tiny_loaded, head_file):
    """Two LocalGroup ranks, LM-head TP, rejection sampling on: every rank runs the same
    K at every iteration (the tree where the group agrees a batch may draft it, the
    tree's collectives on every rank), and rank 0's outputs equal one rank's."""
    reqs = requests(sampled_every=3)
    one, _, _ = await run(tree_config(tiny_dir, head_file, rejection=True), tiny_loaded,
                          reqs)
    config = make_config(tiny_dir, method="eagle3", k=3, max_batch_size=2, rejection=True,
                         speculative={"draft_weights": str(head_file), "tree": TREE,
                                      "adaptive": True},
                         parallel={"world_size": 2, "attention_dp": True,
                                   "lm_head_tp_in_adp": True})
    group = LocalGroup(2, timeout=30.0)

    async def rank_main(comm):
        chosen = Chosen()
        async with AsyncEngine(config, communicator=comm, model=tiny_loaded,
                               observers=[chosen]) as engine:
            engine.worker.adaptive.cost = small_batches_draft()
            outs = await serve_staggered(engine, reqs) if comm.rank == 0 else \
                await engine.wait_closed()
        return outs, dict(chosen.ks)

    (outs, ks0), (_, ks1) = await group.run(rank_main)
    assert outs == one
    common = ks0.keys() & ks1.keys()
    assert len(common) >= 10 and all(ks0[i] == ks1[i] for i in common)
    # The tree where every row was greedy, chains where a rank's batch sampled.
    assert len(TREE) in ks0.values() and {2, 3} & set(ks0.values()), ks0


async def test_the_tree_from_graphs_equals_the_eager_tree(tiny_dir, tiny_loaded, head_file):
    """The tree's DRAFT and VERIFY captured at its keys (K = its 8 nodes, the all-greedy
    variant and the one with sampled rows; a cache that keeps the step functions and runs
    them on its static inputs, as a CUDA graph's replay, at rows padded to buckets of 1,
    2, 4, 8): every output equals the eager tree's, and the tree's graphs served every
    iteration, those with sampled rows too."""
    from ..graphs.test_static_steps import StepReplayCache

    reqs = requests(sampled_every=3)
    eager_outs, eager_stats, _ = await run(tree_config(tiny_dir, head_file), tiny_loaded, reqs)
    config = tree_config(tiny_dir, head_file,
                         components={"graph_cache":
                                     "tests.graphs.test_static_steps:StepReplayCache"})
    drafted = Drafted()
    async with AsyncEngine(config, model=tiny_loaded, observers=[drafted]) as engine:
        outs = await serve_staggered(engine, reqs)
        cache = engine.worker.graph_cache
        stats = engine.stats
    assert isinstance(cache, StepReplayCache)
    assert outs == eager_outs
    assert stats.num_accepted_tokens == eager_stats.num_accepted_tokens
    tree_keys = [key for key in cache._graphs if key.num_draft_tokens == len(TREE)]
    assert {(key.stage, key.all_greedy) for key in tree_keys} == {
        (stage, greedy) for stage in ("verify", "draft") for greedy in (True, False)}
    tree_iterations = sum(1 for _, k in drafted.rows if k == len(TREE))
    assert tree_iterations > 0
    for stage in ("draft", "verify"):
        assert sum(cache._graphs[key].replays for key in tree_keys
                   if key.stage == stage) == tree_iterations, stage


async def test_the_tree_chained_on_the_device_equals_the_eager_tree(tiny_dir, tiny_loaded,
                                                                    head_file):
    """A tree iteration's next DRAFT and VERIFY queued behind it from VERIFY's outputs
    (engine/_chain.py, forced on the CPU with a cache whose replays write static outputs,
    as CUDA graphs do): the tree's outputs bit for bit, and the chain took tree steps."""
    from specloop.engine._chain import DeviceChain

    reqs = requests(sampled_every=3)
    eager_outs, _, _ = await run(tree_config(tiny_dir, head_file), tiny_loaded, reqs)
    config = tree_config(tiny_dir, head_file,
                         components={"graph_cache": "tests.graphs.test_chain:StaticOutputCache"})
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        worker = engine.worker
        worker.verify_inline = True     # the chain runs on CUDA only; forced on here
        worker.chain = chain = DeviceChain(worker=worker)
        queued, queue = [], chain.queue

        def recording(rec, pending, rows, k=None):
            hidden = queue(rec, pending, rows, k)
            if chain._queued is not None:
                queued.append((rec.tree is not None, chain._queued.key.num_draft_tokens))
            return hidden
        chain.queue = recording
        outs = await serve_staggered(engine, reqs)
        cache = worker.graph_cache
    assert outs == eager_outs
    assert chain.taken_steps > 0
    # Behind a tree iteration the chain queued the tree (K = its nodes), else the chain.
    assert {k for tree, k in queued if tree} == {len(TREE)}
    assert {k for tree, k in queued if not tree} <= {3}
    tree_verify = [key for key in cache._graphs
                   if key.num_draft_tokens == len(TREE) and key.stage == "verify"]
    assert sum(cache._graphs[key].replays for key in tree_verify) > 0


async def test_a_batch_above_tree_max_batch_drafts_the_chain(tiny_dir, tiny_loaded,
                                                              head_file):
    """``tree_max_batch = 2``: all-greedy iterations of 3 or 4 rows draft the chain, of 1
    or 2 the tree; outputs unchanged; with graphs (buckets 1, 2, 4, 8) the tree's keys
    are captured at buckets 1 and 2 only."""
    from ..graphs.test_static_steps import StepReplayCache

    reqs = requests()
    eager_outs, _, _ = await run(tree_config(tiny_dir, head_file), tiny_loaded, reqs)
    for graphs in (False, True):
        components = {"graph_cache": "tests.graphs.test_static_steps:StepReplayCache"} \
            if graphs else None
        config = tree_config(tiny_dir, head_file, components=components, tree_max_batch=2)
        drafted = Drafted()
        async with AsyncEngine(config, model=tiny_loaded, observers=[drafted]) as engine:
            outs = await serve_staggered(engine, reqs)
            cache = engine.worker.graph_cache
        assert outs == eager_outs
        by_rows = {rows: {k for r, k in drafted.rows if r == rows} for rows, _ in drafted.rows}
        assert all(ks == {len(TREE)} for rows, ks in by_rows.items() if rows <= 2), by_rows
        assert all(ks == {3} for rows, ks in by_rows.items() if rows > 2), by_rows
        assert any(rows > 2 for rows in by_rows) and any(rows <= 2 for rows in by_rows)
        if graphs:
            assert isinstance(cache, StepReplayCache)
            assert {key.batch_size for key in cache._graphs
                    if key.num_draft_tokens == len(TREE)} == {1, 2}


async def test_a_drafter_without_trees_is_refused_at_start(tiny_dir, tiny_loaded):
    config = make_config(tiny_dir, method="ngram", k=3, speculative={"tree": TREE})
    with pytest.raises(ConfigError, match="drafts chains only"):
        async with AsyncEngine(config, model=tiny_loaded):
            pass


def test_the_tree_in_config_is_the_samplers_tree(tiny_dir, head_file):
    tree = tree_config(tiny_dir, head_file).speculative.draft_tree
    assert tree == DraftTree([tuple(p) for p in TREE])
    assert tree.size == 8 and tree.depth == 3
