"""Warm-up: the engine's VERIFY and DRAFT steps for each key ``graphs.warm_up`` captures.

``graphs`` decides which keys are captured and seals the cache; this module only builds
the steps, since they need the model runner, the sampler and the drafter.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import anyio.to_thread
import attrs
import torch

from specloop.graphs import GraphCache, GraphKey, SamplingPath, Step, Tensors
from specloop.graphs._cache import captured_inputs
from specloop.graphs._capture import DraftBuilder, capture_variants, graph_template, warm_up
from specloop.models._grad import inference_mode
from specloop.samplers import Sampler, SamplingBatch, SpecMetadata

from ._verify import make_tree_verify_step, make_verify_step, verify_inputs

if TYPE_CHECKING:
    from specloop.comm import Communicator
    from specloop.models.drafters import Drafter

    from ._adaptive import CostTable
    from ._config import EngineConfig
    from ._runner import ModelRunner


class VerifyBuilder(Protocol):
    """graphs' ``VerifyBuilder``, and the attended cache length: the cache's whole length
    by default (static, for capture), None for the positions written (eager)."""

    def __call__(self, key: GraphKey, template: SamplingBatch, has_q: bool,
                 kv_len: int | None = ...) -> tuple[Step, Tensors]: ...


def warm_up_graphs(*, config: EngineConfig, runner: ModelRunner, sampler: Sampler,
                   drafter: Drafter | None, comm: Communicator, graph_cache: GraphCache
                   ) -> tuple[VerifyBuilder, DraftBuilder]:
    """Capture every VERIFY variant this engine can run (and its DRAFT), for each K it
    may run, before serving; -> the step builders (verify, draft), for ``calibrate``."""
    device = runner.device
    point_mass = drafter is None or drafter.point_mass
    # A draft tree's graphs: the keys of its node count off the advanced path (the chain's
    # K is its depth, always smaller: config.py).
    tree = config.speculative.draft_tree

    def is_tree(key: GraphKey) -> bool:
        return tree is not None and key.sampling_path is SamplingPath.GREEDY and \
            key.num_draft_tokens == tree.size

    def verify(key: GraphKey, template: SamplingBatch, has_q: bool,
               kv_len: int | None = runner.cache.max_seq_len) -> tuple[Step, Tensors]:
        k, q = key.num_draft_tokens, None
        if k and has_q:
            q = torch.zeros(0, k, runner.args.vocab_size, device=device)
        example = verify_inputs([], None, q, template, k=k,
                                scratch_slot=runner.cache.scratch_slot, device=device)
        if tree is not None and is_tree(key):
            return make_tree_verify_step(runner, sampler, template, tree,
                                         kv_len=kv_len), example
        # Captured (a static kv_len) at K = 0: the graph writes the inputs of a step queued
        # ahead for the same batch itself (engine/_verify.py, engine/_ahead.py).
        step = make_verify_step(runner, sampler, template,
                                advanced=key.sampling_path is SamplingPath.ADVANCED,
                                kv_len=kv_len, feeds_itself=not k and kv_len is not None)
        return step, example

    def draft(key: GraphKey, template: SamplingBatch) -> tuple[Step, Tensors] | None:
        """The drafter's whole K-step proposal, when it offers a static step for this
        variant (not on the LM-head-TP path, whose collectives stay outside graphs)."""
        from specloop.models.drafters import DraftContext  # noqa: PLC0415

        advanced, k = key.sampling_path is SamplingPath.ADVANCED, key.num_draft_tokens
        if drafter is None or not drafter.can_graph(advanced):
            return None
        if k != drafter.num_draft_tokens and not drafter.variable_k and not is_tree(key):
            return None     # the engine drafts the maximum and keeps the first k
        if not k and not drafter.chains_through_k0:
            # K = 0: the engine does not call the drafter (one chained through K = 0 places
            # the bonus token of a K = 0 step chained behind a drafting VERIFY).
            return None
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        # No rows: graph_inputs reads shapes only (the spec is the key's variant's).
        spec = SpecMetadata(use_rejection_sampling=config.speculative.use_rejection_sampling,
                            is_all_greedy_sample=key.all_greedy)
        ctx = DraftContext(token_ids=[], seq_lens=empty, slots=empty, sampling=template,
                           spec=spec, sampler=sampler, comm=comm,
                           run_sync=anyio.to_thread.run_sync, graph_sampling=template)
        if tree is not None and is_tree(key):
            return drafter.tree_graph_step(sampler, template, tree), drafter.graph_inputs(ctx)
        return (drafter.graph_step(sampler, template, advanced=advanced, num_draft_tokens=k),
                drafter.graph_inputs(ctx))

    ks = config.speculative.k_values
    # Built whether or not the cache captures: the drafter groups its prefill by the
    # same padded shapes either way (eager forwards then compute what graphs would).
    prefill = prefill_graphs(runner, drafter, graph_cache)
    warm_up(graph_cache, max_batch_size=config.scheduler.max_batch_size, num_draft_tokens=ks,
            variants=capture_variants(config.speculative.use_rejection_sampling, point_mass),
            device=device, verify=verify, draft=draft,
            also=lambda: prefill, tree_k=tree.size if tree is not None else 0,
            tree_max_batch=config.speculative.tree_max_batch)
    # Prefill replays what was captured (an eager forward at the same padded shape else).
    runner.prefill_cache = graph_cache
    if drafter is not None and device.type == "cuda":
        drafter.warm_up_eager(config.scheduler.max_batch_size, sampler)
    return verify, draft


def prefill_graphs(runner: ModelRunner, drafter: Drafter | None, graph_cache: GraphCache
                   ) -> list[tuple[GraphKey, Step, Tensors]]:
    """The target's prefill steps at its padded shapes (none where it does not pad), and
    the drafter's at the same shapes (stage "draft-prefill"), which it replays through
    the cache once captured."""
    steps = runner.prefill_graphs()
    if drafter is None or not steps:
        return steps
    shapes = [(key.batch_size, key.tokens) for key, _, _ in steps]
    return steps + [(_draft_prefill_key(shape), step, example)
                    for shape, step, example in drafter.prefill_graphs(
                        shapes, DraftPrefillReplay(graph_cache))]


class DraftPrefillReplay:
    """A drafter's prefill graphs in ``cache`` (stage "draft-prefill"), by padded shape:
    the ``PrefillReplay`` warm-up hands to ``Drafter.prefill_graphs``."""

    def __init__(self, cache: GraphCache) -> None:
        self.cache = cache

    def __call__(self, shape: tuple[int, int], inputs: Tensors) -> Tensors | None:
        key = _draft_prefill_key(shape)
        return self.cache.replay(key, inputs) if self.cache.has(key) else None

    def static_inputs(self, shape: tuple[int, int]) -> Tensors | None:
        return captured_inputs(self.cache, _draft_prefill_key(shape))


def _draft_prefill_key(shape: tuple[int, int]) -> GraphKey:
    from ._runner import prefill_key  # noqa: PLC0415

    return prefill_key(*shape, stage="draft-prefill")


def calibrate(*, config: EngineConfig, runner: ModelRunner, drafter: Drafter | None,
              graph_cache: GraphCache, verify: VerifyBuilder, draft: DraftBuilder,
              reps: int | None = None) -> CostTable:
    """The cost table of adaptive K: VERIFY + DRAFT seconds per (batch bucket, K), timed
    on padding rows (the scratch slot) by replaying the captured graphs of the all-greedy
    variant, or running the steps eagerly where nothing was captured (then only the
    smallest and the largest batch, to keep warm-up short). With a draft tree, K = the
    largest at a bucket whose batches draft the tree is the tree's steps (its graphs are
    captured there; eager: up to ``tree_max_batch``): there the tree stands for it."""
    from ._adaptive import CostTable  # noqa: PLC0415

    device, ks = runner.device, config.speculative.k_values
    max_batch = config.scheduler.max_batch_size
    k_max = max(ks)
    captured = graph_cache.has(GraphKey(max_batch, k_max, SamplingPath.GREEDY, True))
    buckets = sorted({b for b in config.graphs.batch_buckets if b < max_batch} | {max_batch}) \
        if captured else sorted({1, max_batch})
    reps = reps or (5 if device.type == "cuda" else 2)
    tree = config.speculative.draft_tree
    table: dict[tuple[int, int], float] = {}
    for bucket in buckets:
        for k in ks:
            key = GraphKey(bucket, k, SamplingPath.GREEDY, True)
            if tree is not None and k == k_max:
                grown = attrs.evolve(key, num_draft_tokens=tree.size)
                if graph_cache.has(grown) if captured else \
                        bucket <= config.speculative.tree_max_batch:
                    key = grown
            template = graph_template(key, device)
            # Eager: attention over the positions written, not max_seq_len (as served).
            step, example = verify(key, template, False,
                                   **({} if graph_cache.has(key) else {"kv_len": None}))
            seconds = _time(_runner_of(graph_cache, key, step, example), device, reps)
            # The tree drafts its nodes; a drafter without variable K drafts the maximum
            # every iteration.
            dk = key.num_draft_tokens if key.num_draft_tokens != k or drafter is None \
                or drafter.variable_k else k_max
            # (K = 0 runs no draft but a chained step's, and the step queued ahead none.)
            drafted = draft(attrs.evolve(key, num_draft_tokens=dk), template) \
                if drafter is not None and dk else None
            if drafted is not None:
                stage = attrs.evolve(key, num_draft_tokens=dk, stage="draft")
                seconds += _time(_runner_of(graph_cache, stage, *drafted), device, reps)
            # Drafting more never costs less: timing noise must not make it look so.
            table[(bucket, k)] = max([seconds] + [t for (b, _), t in table.items()
                                                  if b == bucket])
    return CostTable(table)


def _runner_of(graph_cache: GraphCache, key: GraphKey, step: Step, example: Tensors
               ) -> Callable[[], Tensors]:
    if graph_cache.has(key):
        return lambda: graph_cache.replay(key, example)
    return lambda: step(example)


@inference_mode
def _time(fn: Callable[[], Tensors], device: torch.device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / reps
