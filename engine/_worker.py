"""One rank's iteration handlers: SCHEDULE, SYNC, PICK_GRAPH_KEY, DRAFT, VERIFY, RESCAN.

Read top to bottom, this file is the iteration diagram (docs/architecture.md). What the
handlers lean on lives beside it: the front-door exchange (``_exchange``), the stop rules
and outputs (``_outputs``), the counters (``_stats``), VERIFY's step (``_verify``), the
step queued ahead (``_ahead``), DRAFT + VERIFY chained on the device (``_chain``), adaptive
K and its clock (``_adaptive``) and the warm-up that captures graphs (``_warmup``, on
``graphs``). The step variant (with or
without a drafter, single rank or group) is chosen once here at construction; handlers
never re-decide it per step.
"""

from __future__ import annotations

import logging
import operator
import os
import time
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

import anyio
import anyio.lowlevel
import attrs
import structlog
import torch

from specloop.graphs import GraphCache, SamplingPath, Tensors
from specloop.models._grad import inference_mode
from specloop.models._host import int64_tensor
from specloop.samplers import RejectionResult, Sampler, SamplingBatch, SpecMetadata

from ._adaptive import BURN_IN, CLASSED_ROWS, AdaptiveK, IterationClock
from ._ahead import RunAhead
from ._chain import DeviceChain
from ._exchange import OutputExchange
from ._frontdoor import FrontDoorMessage
from ._iteration import Handler, IterationRecord, enabled_for
from ._outputs import Outputs
from ._request import FinishReason, Request
from ._runner import ReadBack
from ._scheduler import Scheduler
from ._states import IterationState
from ._stats import EngineStats, accepted_at_least
from ._errors import ConfigError
from ._verify import make_tree_verify_step, make_verify_step, verify_inputs
from ._warmup import calibrate, warm_up_graphs

if TYPE_CHECKING:
    from specloop.comm import Communicator
    from specloop.graphs import GraphKey
    from specloop.models.drafters import Drafter

    from ._config import EngineConfig
    from ._frontdoor import FrontDoorPort
    from ._runner import ModelRunner

log = structlog.get_logger(__name__)
S = IterationState
# A request's ``greedy`` (a C-level getter: ``all(map(_GREEDY, batch))``).
_GREEDY = operator.attrgetter("greedy")
T = TypeVar("T")
# A queued VERIFY: its outputs (on the device) and the read-back of its packed tokens.
Pending = tuple[Tensors, ReadBack]

# SYNC's one all-gather row per rank: what the group must agree on (with adaptive K, the
# rule's inputs follow: AdaptiveK.facts).
FACT_TOKENS, FACT_BATCH, FACT_REQUESTS, FACT_ALL_GREEDY = range(4)
NUM_FACTS = 4
# Adaptive K's view is logged (``adaptive_k``, info) once in this many choices.
ADAPTIVE_LOG_EVERY = 256


class RankWorker:
    def __init__(self, *, config: EngineConfig, runner: ModelRunner, drafter: Drafter | None,
                 sampler: Sampler, comm: Communicator, graph_cache: GraphCache,
                 front: FrontDoorPort | None) -> None:
        self.config = config
        self.runner = runner
        self.drafter = drafter
        self.sampler = sampler
        self.comm = comm
        self.graph_cache = graph_cache
        self.front = front          # FrontDoor on rank 0, None elsewhere
        self.k = config.speculative.k      # the largest K an iteration may draft
        # The most draft rows a VERIFY adds to a request (a draft tree's nodes, else K).
        self.verify_drafts = config.speculative.verify_drafts
        # Set at warm-up when speculative.adaptive: the per-iteration choice of K.
        self.adaptive: AdaptiveK | None = None
        # The classes of the rows of the iteration adaptive K committed to early (one GPU
        # rank: ``RunAhead._adaptive_next``), which its SYNC records as its own.
        self.committed_classes: dict[Request, int] = {}
        self.clock = IterationClock()       # adaptive K's (keeps no time without it)
        self.scheduler = Scheduler(config.scheduler.max_batch_size,
                                   config.scheduler.max_num_tokens)
        self._limiter = anyio.CapacityLimiter(1)
        # Prefill on the event loop's thread, not a worker thread's (``_admit``).
        self.prefill_inline = prefill_inline(runner.device)
        self.stats = EngineStats()
        self._sampling_cache: dict[int | None, tuple[tuple[Request, ...], SamplingBatch]] = {}
        self.group_sync = config.group_sync_greedy_flag
        self.exchange = OutputExchange(config=config, comm=comm, front=front,
                                       scheduler=self.scheduler)
        self.outputs = Outputs(config=config, scheduler=self.scheduler, runner=runner,
                               drafter=drafter, stats=self.stats,
                               deliver=self.exchange.deliver,
                               deliver_many=self.exchange.deliver_many,
                               # One rank whose front door takes rows (a ProcessEngine's
                               # core): RESCAN's outputs go there as rows, past the
                               # exchange, which hands a single rank's on unchanged.
                               deliver_rows=front.deliver_rows
                               if front is not None and comm.world_size == 1 else None)
        self.draft_step = self._draft_with_drafter if self.k else self._no_draft
        multi = comm.world_size > 1
        self.schedule = self._schedule_group if multi else self._schedule_local
        self.sync = self._sync_group if multi else self._sync_local
        # A group's message applies at the next iteration (see _schedule_group).
        self._carried = FrontDoorMessage()
        self._joined = False    # requests held back by the last SCHEDULE joined this one
        # Drafters whose DRAFT runs collectives (LM-head TP) are called on idle ranks too.
        self.draft_when_idle = drafter is not None and drafter.needs_empty_calls
        # None where the drafter keeps the protocol's default (n-gram): nothing is handed
        # over, and a chained step keeps no copy of VERIFY's rows for it.
        from specloop.models.drafters import Drafter as Protocol  # noqa: PLC0415
        self.on_verified = drafter.on_verified if drafter is not None and \
            getattr(type(drafter), "on_verified", None) is not Protocol.on_verified else None
        self.verify_inline = runner.device.type == "cuda"
        # No speculation on a GPU: each VERIFY also queues the next iteration's step
        # (engine/_ahead.py); the GPU then works while the host runs an iteration. In a
        # group too when SCHEDULE's exchange runs on the host (else it would wait behind
        # that step on the device): the step holds no collective without a drafter.
        # Adaptive K on one GPU rank (set at warm-up): K = 0 stretches queue ahead too.
        self.ahead = RunAhead(worker=self, always=self.verify_inline and self.k == 0 and (
            not multi or self.exchange.on_host))
        # Speculation on a GPU: each VERIFY also queues the next iteration's DRAFT and
        # VERIFY, chained on the device (engine/_chain.py); under adaptive K for a drafter
        # drafting any K (its draft graphs are per K), at the next K, taken early (one
        # rank). In a group where the step holds no collective (a drafter with LM-head TP
        # drafts on idle ranks too: ``draft_when_idle``), the exchange runs on the host,
        # and K is fixed: the next iteration takes the step when SYNC agreed on its key
        # (``matches``).
        # ``speculative.tree``: batches off the advanced path draft and verify it
        # (PICK_GRAPH_KEY), from graphs where captured (their keys: the tree's node count
        # as K), and the chained step of a tree iteration drafts the tree again.
        self.tree = config.speculative.draft_tree
        self.tree_max_batch = config.speculative.tree_max_batch
        if self.tree is not None:
            self._check_tree(drafter)
        local_step = not multi or (self.exchange.on_host and not self.draft_when_idle
                                   and not config.speculative.adaptive)
        self.chain = DeviceChain(worker=self) if (
            self.verify_inline and self.k and local_step and drafter is not None
            and drafter.can_chain
            and (drafter.variable_k or not config.speculative.adaptive)) else None

    def _check_tree(self, drafter: Drafter | None) -> None:
        """``speculative.tree`` needs a drafter that drafts trees."""
        if drafter is None or not drafter.drafts_trees:
            raise ConfigError("speculative.tree",
                              [list(p) for p in self.config.speculative.tree or ()],
                              f"the drafter ({type(drafter).__name__}) drafts chains only",
                              "draft trees need an mtp_eagle or eagle3 head without LM-head "
                              "TP")

    def handlers(self) -> dict[IterationState, Handler]:  # schedule/sync: set in __init__
        return {S.SCHEDULE: self.schedule, S.SYNC: self.sync,
                S.PICK_GRAPH_KEY: self.pick_graph_key, S.DRAFT: self.draft,
                S.VERIFY: self.verify, S.RESCAN: self.rescan}

    async def run_sync(self, fn: Callable[[], T]) -> T:
        return await anyio.to_thread.run_sync(fn, limiter=self._limiter)

    def warmup_graphs(self) -> None:
        """Capture every VERIFY (and DRAFT) variant this engine can run, before serving;
        with adaptive K, time them for its cost table."""
        verify, draft = warm_up_graphs(
            config=self.config, runner=self.runner, sampler=self.sampler,
            drafter=self.drafter, comm=self.comm, graph_cache=self.graph_cache)
        spec = self.config.speculative
        if spec.adaptive and self.k:
            cost = calibrate(config=self.config, runner=self.runner, drafter=self.drafter,
                             graph_cache=self.graph_cache, verify=verify, draft=draft)
            cost.admissions_in_overhead = spec.adaptive_admissions == "per_iteration"
            classes = self.drafter.num_draft_classes if self.drafter is not None else 0
            self.adaptive = AdaptiveK(spec.k_values, cost, classes, burn_in=BURN_IN,
                                      tail=True, tree=self.tree is not None,
                                      settling=spec.adaptive_settling)
            self.clock = IterationClock(self.adaptive, device=self.runner.device)
            self.ahead.at_k0 = self.verify_inline and self.comm.world_size == 1

    async def agree_costs(self) -> None:
        """Before the first iteration: every rank takes the slowest rank's warm-up time
        for each (bucket, K), so all hold the same cost table (one collective, once)."""
        if self.adaptive is None or self.comm.world_size == 1:
            return
        cost = self.adaptive.cost
        keys = sorted(cost.device)
        gathered = await self.comm.all_gather(cost.as_tensor(keys).to(self.runner.device))
        agreed = gathered.cpu().reshape(self.comm.world_size, -1).max(dim=0).values
        cost.device = {key: int(v) / 1e7 for key, v in zip(keys, agreed.tolist())}

    # SCHEDULE ---------------------------------------------------------------------------
    async def _schedule_local(self, rec: IterationRecord) -> IterationState:
        self.clock.tick()
        if self._joined and self.adaptive is not None:
            # Its step was queued behind the joiners' prefill (the prefilling iteration's
            # was queued before it): it waited for that on the device, at any K.
            self.adaptive.disturb()
        idle = self.scheduler.num_requests == 0
        message = await self.exchange()
        if idle:    # it waited for work
            self.clock.exclude(time.perf_counter() - self.clock.started)
        rec.shutdown = message.shutdown
        self._apply(message)
        admitted = await self._admit()
        self._joined = bool(self.ahead.joining)     # the last SCHEDULE's newcomers join
        # Newcomers may join at the next iteration (a step queued ahead is taken now).
        rec.batch = self.ahead.schedule(self.scheduler.running, admitted)
        return S.SYNC

    async def _schedule_group(self, rec: IterationRecord) -> IterationState:
        """The batch is fixed before the exchange, so SYNC's facts ride its one
        all-gather (one collective per iteration, not two): the requests and cancels
        it brings apply at the start of the next iteration."""
        self.clock.tick()
        self._apply(self._carried)
        admitted = await self._admit()
        # Newcomers join at the next iteration when a step queued ahead or chained for
        # the others is on the device (``RunAhead.schedule``), as on one rank.
        rec.batch = self.ahead.schedule(self.scheduler.running, admitted)
        if self.ahead.always:
            # Inline host exchange: rank 0 posts its row first; the consumers woken by
            # the last RESCAN and the other ranks' outputs (``defer``) wait for VERIFY,
            # which runs them once the next step is queued (issue 12: rank 0 was late).
            self._carried = await self.exchange(self._facts(rec),
                                                defer=bool(rec.batch))
        else:
            # Consumers woken by the last RESCAN run now, not while the collective's
            # thread waits for the GIL (on rank 0 they are every rank's consumers).
            await anyio.lowlevel.checkpoint()
            self._carried = await self.exchange(self._facts(rec))
        if self.adaptive is not None:   # waiting for the last rank: not this rank's time
            self.clock.exclude(self.exchange.times.recent[-1][0] / 1e6)
        rec.shutdown = self._carried.shutdown
        return S.SYNC

    def _apply(self, message: FrontDoorMessage) -> None:
        if message.max_running is not None:     # before this SCHEDULE admits anyone
            self.scheduler.max_running = message.max_running
        for rank, new in message.assignments:
            if rank == self.comm.rank:
                self.scheduler.add(Request.from_new(new))
        for request_id in message.cancels:
            request = self.scheduler.find(request_id)
            if request is not None:
                self.outputs.finish(request, FinishReason.CANCELLED, ())

    async def _admit(self) -> list[Request]:
        admitted = self.scheduler.admit()
        if admitted:
            mark = self.clock.prefill_started()
            prefill = self.clock.on_device(lambda: self._prefill(admitted))
            if self.prefill_inline:
                prefill()
            else:
                await self.run_sync(prefill)
            self.clock.prefill_done(mark)
        return admitted

    def _prefill(self, admitted: list[Request]) -> None:
        # The pages the first chained step reserves (its VERIFY's rows and the next
        # catch-up's past the prompt), taken now: the prefill's copy of the page table
        # carries them, not a second copy in the first iteration (80-120 us of the lent
        # H100's host each at admission, bench/probe_ttft_gpu.py).
        chain = self.chain
        hidden = self.runner.prefill_many(
            admitted, headroom=chain.keep_ahead - 1 if chain is not None else 0)
        if self.drafter is not None:
            self.drafter.prefill_many([r.batch_slot for r in admitted],
                                      [r.token_ids[:-1] for r in admitted], hidden)

    # SYNC -------------------------------------------------------------------------------
    async def _sync_local(self, rec: IterationRecord) -> IterationState:
        # Nothing to agree on: no tensors on the hot path. The flag from the batch's
        # sampling rows (built once per batch, PICK_GRAPH_KEY's too), the record's flags
        # rebuilt only when it changes (an attrs evolve is ~4 us; most iterations keep it).
        greedy = self._all_greedy(rec.batch)
        if rec.spec.is_all_greedy_sample != greedy:
            rec.spec = rec.spec.evolve(is_all_greedy_sample=greedy)
        self.exchange.loads = [self.scheduler.num_requests]
        rec.padded_batch_size = len(rec.batch)
        adaptive = self.adaptive
        if adaptive is not None and rec.batch:
            rec.tree_agreed = self.tree_fits(rec.padded_batch_size, rec.spec)
            if adaptive.committed:  # taken early (RunAhead._adaptive_next), with its classes
                committed = self.committed_classes
                rec.draft_classes = None if not committed else \
                    [committed.get(r, adaptive.classes) for r in rec.batch]
                rec.num_draft_tokens = adaptive.choose_committed(rec.padded_batch_size)
            else:
                rec.draft_classes = self.draft_classes(rec.batch)
                rec.num_draft_tokens = adaptive.choose(
                    [adaptive.facts(rec.draft_classes, self.tail_rows(rec.batch))],
                    rec.padded_batch_size, tree=rec.tree_agreed)
            self.clock.timed = True
            self._log_adaptive()
        # Held for one iteration only (an empty one included: its rows may not come back).
        self.committed_classes = {}
        return S.PICK_GRAPH_KEY if rec.padded_batch_size else S.DONE

    def draft_classes(self, batch: list[Request]) -> list[int] | None:
        """Adaptive K's draft classes of ``batch``'s rows from their committed tokens
        (``Drafter.draft_classes``); None when the drafter has none, unclassed past
        CLASSED_ROWS rows."""
        adaptive, drafter = self.adaptive, self.drafter
        if adaptive is None or drafter is None or not adaptive.classes:
            return None
        if len(batch) > CLASSED_ROWS:
            return adaptive.unclassed(len(batch))
        classes = drafter.draft_classes([r.batch_slot for r in batch],
                                        [r.token_ids for r in batch])
        n = adaptive.classes
        if len(classes) != len(batch) or not all(0 <= c < n for c in classes):
            raise ValueError(f"{type(drafter).__name__}.draft_classes gave {classes} for "
                             f"{len(batch)} rows; want one class in 0 .. {n - 1} a row "
                             f"(its num_draft_classes is {n})")
        return classes

    def _log_adaptive(self) -> None:
        """Every ADAPTIVE_LOG_EVERY choices, the rule's view (``AdaptiveK.summary``) as an
        ``adaptive_k`` info event: what a server's operator (or a bench, through the
        engine core's log) reads to see why K is what it is. Filtered out, it costs a
        modulo an iteration."""
        adaptive = self.adaptive
        if adaptive is None or adaptive.choices % ADAPTIVE_LOG_EVERY:
            return
        bound = log.bind()
        if enabled_for(bound, logging.INFO):
            bound.info("adaptive_k", rank=self.comm.rank, **adaptive.summary())

    def tail_rows(self, batch: list[Request]) -> int:
        """Adaptive K's tail rows in ``batch`` (``BatchTail.rows``; 0 without a tail)."""
        tail = self.adaptive.tail if self.adaptive is not None else None
        return tail.rows(batch, self.scheduler.admitted) if tail is not None else 0

    def _all_greedy(self, batch: list[Request]) -> bool:
        """Whether every request of ``batch`` samples greedily: one C-level pass over the
        rows' ``greedy`` (~2 µs at batch 128 on this repository's CPU), where building the
        batch's sampling rows first cost ~10-40 µs at each batch change (PICK_GRAPH_KEY
        builds them when it needs them)."""
        return all(map(_GREEDY, batch))

    def _facts(self, rec: IterationRecord) -> list[int]:
        """This rank's row of what the group agrees on (the FACT_* columns; adaptive K's
        with its batch's draft classes, which RESCAN then records under)."""
        batch = rec.batch
        row = [len(batch) * (self.k + 1), len(batch), self.scheduler.num_requests,
               int(self._all_greedy(batch))]
        if self.adaptive is None:
            return row
        rec.draft_classes = self.draft_classes(batch)
        return row + self.adaptive.facts(rec.draft_classes, self.tail_rows(batch))

    async def _sync_group(self, rec: IterationRecord) -> IterationState:
        """Agreement from the facts gathered in SCHEDULE's exchange (no collective)."""
        # Read as Python ints: a tensor op per fact cost ~50 us per iteration (issue 12).
        rows = self.exchange.gathered_rows
        assert rows, "a group's SCHEDULE exchange gathers them"
        greedy = [row[FACT_ALL_GREEDY] for row in rows]
        mine = bool(greedy[self.comm.rank])
        group = all(greedy) if self.group_sync else None
        if (rec.spec.is_all_greedy_sample, rec.spec.group_all_greedy_sample) != (mine, group):
            rec.spec = rec.spec.evolve(is_all_greedy_sample=mine, group_all_greedy_sample=group)
        # Where rank 0 assigns next: each rank's requests, counting those assigned in
        # this exchange (they join at the next iteration; without them rank 0 could
        # sit idle waiting for work while another rank has some to start).
        loads = [row[FACT_REQUESTS] for row in rows]
        for rank, _ in self._carried.assignments:
            loads[rank] += 1
        self.exchange.loads = loads
        rec.padded_batch_size = max(row[FACT_BATCH] for row in rows)
        if self.adaptive is not None and rec.padded_batch_size:
            # From gathered values only: every rank computes the same K (the tree's
            # eligibility on the group's greedy flag, whether or not SYNC agrees the
            # sampling path: the rule reads the tree's acceptance on every rank or none).
            rec.tree_agreed = self.tree is not None and self.tree_fits(
                rec.padded_batch_size, rec.spec.evolve(group_all_greedy_sample=all(greedy)))
            rec.num_draft_tokens = self.adaptive.choose([row[NUM_FACTS:] for row in rows],
                                                        rec.padded_batch_size,
                                                        tree=rec.tree_agreed)
            self.clock.timed = True
            self._log_adaptive()
        return S.PICK_GRAPH_KEY if rec.padded_batch_size else S.DONE

    # PICK_GRAPH_KEY ---------------------------------------------------------------------
    async def pick_graph_key(self, rec: IterationRecord) -> IterationState:
        if rec.num_draft_tokens is None:
            rec.num_draft_tokens = self.k
        # The tree is verified strictly (greedy rows and sampled rows off the advanced
        # path: samplers/_tree.py), and its rows pay at small batches only
        # (speculative.tree_max_batch). From agreed values only (an idle rank too): under
        # LM-head TP every rank then enters the tree's collectives alike. Under adaptive
        # K the tree stands for K = num_draft_tokens where SYNC agreed it may.
        tree = self.tree
        if tree is not None and self.tree_fits(rec.padded_batch_size, rec.spec) and (
                self.adaptive is None or rec.tree_agreed and rec.num_draft_tokens == self.k):
            rec.tree, rec.num_draft_tokens = tree, tree.size
        rec.graph_key, rec.graph_captured = self.graph_cache.pick(
            rec.padded_batch_size, rec.num_draft_tokens, SamplingPath.of(rec.spec),
            rec.spec.all_greedy,
            agreed=self._group_agrees(rec))
        if self.chain is not None and rec.graph_captured:   # its step's bucket, if larger
            rec.graph_key = self.chain.key_for(rec.graph_key, len(rec.batch))
        if rec.batch:
            rec.sampling = self._sampling_batch(rec.batch, None)
        return S.DRAFT

    def tree_fits(self, padded_batch_size: int, spec: SpecMetadata) -> bool:
        """Whether a batch of ``padded_batch_size`` rows on ``spec``'s path may draft the
        tree: one is set, the batch is verified strictly, and it is no larger than
        ``speculative.tree_max_batch``."""
        return self.tree is not None and not spec.wants_advanced_draft_sampling and \
            padded_batch_size <= self.tree_max_batch

    def next_key(self, rec: IterationRecord, batch: list[Request], k: int
                 ) -> tuple[GraphKey, bool, SpecMetadata]:
        """PICK_GRAPH_KEY's (key, captured) for ``batch`` (``rec``'s batch and the
        requests joining it) at K = ``k`` as the next iteration will likely take it, for
        a step queued for that batch now, with ``rec.spec`` carrying that batch's greedy
        flag; and that spec. In a group, the key the group agrees on if no other rank's
        batch changes: the padded batch of this iteration's SYNC or this batch's, the
        larger, and the group's greedy flag with the joiners' (AND); another rank's
        change makes the next iteration's key differ, which drops the step then."""
        greedy = self._all_greedy(batch)
        spec, padded, agreed = rec.spec, len(batch), True
        if self.comm.world_size > 1:
            group = spec.group_all_greedy_sample
            if group is not None and group and not greedy:
                spec = spec.evolve(group_all_greedy_sample=False)
            padded = max(padded, rec.padded_batch_size)
            agreed = self._group_agrees(rec) and (group is not None or greedy ==
                                                  spec.is_all_greedy_sample)
        if spec.is_all_greedy_sample != greedy:
            spec = spec.evolve(is_all_greedy_sample=greedy)
        key, captured = self.graph_cache.pick(padded, k, SamplingPath.of(spec),
                                              spec.all_greedy, agreed=agreed)
        return key, captured, spec

    def _sampling_batch(self, batch: list[Request], pad_to: int | None) -> SamplingBatch:
        """Per-row sampling tensors, rebuilt only when the batch's requests change (most
        iterations run the same batch as the one before); one cache per padding, padding
        to the batch's own size being none (the same rows: built once, not twice). The
        unpadded rows are the real rows of the smallest padding in use that holds them
        (views: at a batch change SYNC asks first, the graphs' padding then finds its
        rows built)."""
        key = tuple(batch)      # Request compares by identity: a reused id is a new key
        if pad_to == len(batch):
            pad_to = None
        cached = self._sampling_cache.get(pad_to)
        if cached is None or cached[0] != key:
            pads = [p for p in self._sampling_cache if p is not None and p > len(batch)]
            if pad_to is None and batch and pads:
                built = self._sampling_batch(batch, min(pads)).real_rows()
            elif pad_to is None and (greedy := _greedy_rows(self._sampling_cache, batch)):
                # An all-greedy batch as large as the largest padding (no padding larger
                # to view: a server's load at the largest bucket, where a request joins
                # nearly every iteration): the first rows of an all-greedy batch built
                # before (as the padded case below; from_params cost ~4 us a row on this
                # repository's CPU, ~280 us at batch 64, each time one joined).
                built = greedy
            elif pad_to is not None and cached is not None and cached[1].all_greedy \
                    and all(map(_GREEDY, batch)):
                # Two all-greedy batches' columns differ in the seeds alone (every row,
                # padding too, greedy with the sentinel's params), and a greedy row's
                # token does not depend on its seed (argmax; one-hot p on a sampling
                # path): this one keeps the last one's columns, so a batch change builds
                # nothing, copies nothing to the device nor into the graphs' inputs
                # (from_params cost ~1 us a row). Flags as from_params gives; ``host``
                # still describes the columns (``like`` compares against it).
                # (row_flags None: ``host`` is not these rows' own, ``changed`` can't
                # slice it.)
                built = attrs.evolve(cached[1], num_real=len(batch), row_flags=None)
            elif cached is not None and cached[1].row_flags is not None \
                    and (change := _kept_runs(cached[0], batch)) is not None:
                # The last batch less the requests that ended, plus those that joined
                # (the scheduler removes rows anywhere and appends): its rows' host
                # values sliced, only the new rows built (from_params's result, bit
                # for bit; from_params cost ~1 us a row).
                keep, joined = change
                built = cached[1].changed(
                    keep, [r.params for r in joined], [r.seed for r in joined],
                    device=self.runner.device, pad_to=pad_to, like=cached[1])
            else:   # the columns that did not change are the last batch's tensors
                built = SamplingBatch.from_params(
                    [r.params for r in batch], [r.seed for r in batch],
                    device=self.runner.device, pad_to=pad_to,
                    like=None if cached is None else cached[1])
            cached = self._sampling_cache[pad_to] = (key, built)
        return cached[1]

    def _group_agrees(self, rec: IterationRecord) -> bool:
        """Whether every rank derives the same key. With the group sync on, the flag is
        agreed; otherwise each rank's path follows from its flag in the SYNC facts, so all
        ranks see whether they differ, and then all run eagerly."""
        if self.comm.world_size == 1 or rec.spec.group_all_greedy_sample is not None:
            return True
        flags = {row[FACT_ALL_GREEDY] for row in self.exchange.gathered_rows}
        return len(flags) == 1

    # DRAFT ------------------------------------------------------------------------------
    async def draft(self, rec: IterationRecord) -> IterationState:
        # Pages for every position DRAFT and VERIFY will write for a real row, before
        # either runs (a chained step that matches had them reserved when it was queued):
        # this iteration's K where the drafter drafts that many (adaptive K's K = 0 writes
        # VERIFY's one position), else the drafter's own K. A head's draft graph is as
        # wide as its largest K: its padding columns past them land in the scratch page
        # (positions no page holds do), rewritten before any query reads them.
        if not (self.chain is not None and self.chain.matches(rec)):
            k = rec.num_draft_tokens
            variable = self.drafter is None or self.drafter.variable_k
            self.runner.reserve(rec.batch, k if variable and k is not None else self.k)
        await self.draft_step(rec)
        return S.VERIFY

    async def _no_draft(self, rec: IterationRecord) -> None:
        rec.draft_token_ids = None

    async def _draft_with_drafter(self, rec: IterationRecord) -> None:
        from specloop.models.drafters import DraftContext  # noqa: PLC0415

        drafter = self.drafter
        assert drafter is not None, "draft_step drafts only with a drafter (K > 0)"
        if not rec.batch and not self.draft_when_idle:
            return
        if self.chain is not None and self.chain.matched:
            # Queued on the device by the last VERIFY; VERIFY takes it.
            rec.draft_token_ids = rec.draft_probs = None
            return
        k, variable = rec.k, drafter.variable_k
        if not k and variable:      # adaptive K chose not to draft: on every rank alike
            rec.draft_token_ids = rec.draft_probs = None
            return
        device = self.runner.device
        replay = self._draft_replay(rec)
        slots, seq_lens = [r.batch_slot for r in rec.batch], [r.seq_len for r in rec.batch]
        # Both in one copy, without blocking (a blocking host-to-device copy is a sync).
        both = self.runner.to_device(int64_tensor(seq_lens + slots).reshape(2, -1))
        ctx = DraftContext(
            num_draft_tokens=k if variable else None, tree=rec.tree,
            token_ids=[r.token_ids for r in rec.batch], seq_lens=both[0], slots=both[1],
            host_slots=slots, host_seq_lens=seq_lens,
            # An idle rank's call (needs_empty_calls): the empty batch's sampling rows.
            sampling=rec.sampling if rec.sampling is not None
            else self._sampling_batch([], None), spec=rec.spec,
            sampler=self.sampler, comm=self.comm, run_sync=self.run_sync, replay=replay,
            graph_sampling=self._sampling_batch(rec.batch, rec.key.batch_size)
            if replay is not None else None)
        proposal = await drafter.propose(ctx)
        tokens, probs = proposal.token_ids, proposal.probs
        if not variable and k < self.k:     # adaptive K: keep the first k drafts
            tokens, probs = tokens[:, :k], None if probs is None else probs[:, :k]
        if not k:
            tokens, probs = None, None
        rec.draft_token_ids, rec.draft_probs = tokens, probs

    def _draft_replay(self, rec: IterationRecord) -> Callable[[Tensors], Tensors] | None:
        drafter = self.drafter
        assert drafter is not None, "only DRAFT with a drafter replays its graph"
        draft_key = attrs.evolve(rec.key, stage="draft")
        if not drafter.variable_k:     # it drafts all K; its graph is the K key's
            draft_key = attrs.evolve(draft_key, num_draft_tokens=self.k)
        if not rec.graph_captured or not self.graph_cache.has(draft_key):
            return None
        return lambda inputs: self.graph_cache.replay(draft_key, inputs)

    # VERIFY -----------------------------------------------------------------------------
    async def verify(self, rec: IterationRecord) -> IterationState:
        if not rec.batch:
            return S.RESCAN
        if self.verify_inline:
            # On a GPU, queueing VERIFY costs the host little: it is queued from the event
            # loop (a hop into the compute thread and back costs ~0.2 ms per iteration);
            # the consumers run while the GPU works, then the loop waits for the copy.
            # The step queued ahead, or chained, by the last VERIFY, when it is this one's.
            pending, rows = self.ahead.take(rec)
            if pending is None and self.chain is not None:
                pending, rows = self.chain.take()
            taken = rec.overlapped = pending is not None
            self.stats.num_overlapped_iterations += taken
            if pending is None or rows is None:     # both None, or neither
                pending, rows = self._queue_verify(rec), range(len(rec.batch))
            fed, hidden = self.ahead.after_verify(rec, pending, rows, taken)
            self.exchange.hand_over()   # the outputs SCHEDULE held back (rank 0 of a group)
            await anyio.lowlevel.checkpoint()
            rec.result = self._collect_verify(rec, pending, rows, hidden, fed=fed)
            if self.chain is not None:
                self.chain.collected(rec)
        else:
            rec.result = await self.run_sync(lambda: self._verify(rec))
        return S.RESCAN

    def _verify(self, rec: IterationRecord) -> RejectionResult:
        return self._collect_verify(rec, self._queue_verify(rec))

    @inference_mode
    def _queue_verify(self, rec: IterationRecord, inputs: Tensors | None = None, *,
                      in_graph: bool = False) -> Pending:
        """Queue VERIFY and the copy of its tokens and counts into pinned host memory (the
        iteration's one device-to-host read); ``_collect_verify`` waits for it, so
        VERIFY's duration includes its device time and RESCAN reads host memory only.
        ``inputs``: given for a step queued ahead (else built from the batch);
        ``in_graph``: a step queued ahead whose inputs the graph's last replay wrote."""
        batch, key = rec.batch, rec.key
        advanced = rec.spec.wants_advanced_draft_sampling
        if rec.graph_captured:
            if inputs is None and not in_graph:      # a step queued ahead brings its own
                inputs = self._inputs(rec, self._sampling_batch(batch, key.batch_size))
            out = self.graph_cache.replay(key, inputs)
        else:
            step = make_tree_verify_step(
                self.runner, self.sampler, rec.batch_sampling, rec.tree, kv_len=None) \
                if rec.tree is not None else make_verify_step(
                    self.runner, self.sampler, rec.batch_sampling, advanced=advanced,
                    kv_len=None)
            out = step(inputs or self._inputs(rec, rec.batch_sampling))
        pending = out, self.runner.start_read_back(out["packed"][:len(rec.batch)])
        self.ahead.replayed(rec, pending)
        return pending

    @inference_mode
    def _collect_verify(self, rec: IterationRecord, pending: Pending,
                        rows: Sequence[int] | None = None,
                        hidden: torch.Tensor | None = None, *,
                        fed: bool = False) -> RejectionResult:
        """``rows``: which rows of the step are the batch's (a step queued ahead for a
        batch some requests have left since); None: all, in order. ``hidden``: the
        batch's feature rows copied out before a chained step overwrote the outputs.
        ``fed``: the drafter had its rows already (``RunAhead.feed_k0``)."""
        out, read_back = pending
        batch, real = rec.batch, len(rec.batch)
        host = self.runner.finish_read_back(read_back)
        subset = None if rows is None or len(rows) == host.shape[0] else list(rows)
        if subset is not None:
            host = host[subset]
        result = RejectionResult(host[:, :-1], host[:, -1])
        if self.on_verified is not None and not fed:
            if hidden is None:      # the batch's rows of the step (a chained one: fewer)
                hidden = out["hidden"][:real] if subset is None else out["hidden"][subset]
            self.on_verified([r.batch_slot for r in batch], [r.seq_len - 1 for r in batch],
                             hidden, result.num_accepted.tolist())
        return result

    def _inputs(self, rec: IterationRecord, sampling: SamplingBatch) -> Tensors:
        return verify_inputs(rec.batch, rec.draft_token_ids, rec.draft_probs, sampling,
                             k=rec.k, scratch_slot=self.runner.cache.scratch_slot,
                             device=self.runner.device)

    # RESCAN -----------------------------------------------------------------------------
    async def rescan(self, rec: IterationRecord) -> IterationState:
        if rec.result is not None:
            accepted = rec.result.num_accepted.tolist()
            k = rec.k
            rec.finished = self.outputs.commit(rec.batch, rec.result.token_ids.tolist(),
                                               accepted)
            # A tree's drafts per row: its depth (a path accepts at most that many).
            drafted = k if rec.tree is None else rec.tree.depth
            # Counted once for the stats and adaptive K (~10 us at 256 rows apiece).
            at_least = accepted_at_least(accepted, drafted)
            self.stats.record_iteration(len(rec.batch), drafted, sum(at_least),
                                        at_least=at_least)
            adaptive = self.adaptive
            if adaptive is not None and rec.tree is not None:
                adaptive.record(drafted, accepted, tree=True, at_least=at_least)
            elif adaptive is not None:
                tail = adaptive.tail
                adaptive.record(k, accepted, rec.draft_classes,
                                tail.accepted(rec.batch, accepted) if tail is not None else None,
                                at_least=at_least)
        return S.DONE

    def cancel_all(self) -> None:
        self.outputs.cancel_all()


def _greedy_rows(cache: dict[int | None, tuple[tuple[Request, ...], SamplingBatch]],
                 batch: list[Request]) -> SamplingBatch | None:
    """Sampling rows for ``batch`` from an all-greedy batch in ``cache`` (``_sampling_batch``'s)
    at least as large (its first rows, views), when every request of ``batch`` is greedy;
    else None."""
    n = len(batch)
    sources = [built for _, built in cache.values()
               if built.all_greedy and built.size >= n and built.host is not None]
    if not sources or not all(map(_GREEDY, batch)):
        return None
    # (row_flags None: the source's host values are not these rows' own seeds)
    return attrs.evolve(min(sources, key=lambda b: b.size).first_rows(n), row_flags=None)


def _kept_runs(last: tuple[Request, ...], batch: list[Request]
               ) -> tuple[list[tuple[int, int]], list[Request]] | None:
    """``batch`` as ``last``'s rows ``[a, b)`` for each ``(a, b)`` of the runs (in order)
    followed by the requests that joined: the longest head of ``batch`` found in order
    in ``last`` (requests that ended leave gaps; the scheduler appends those joining).
    None when that keeps fewer rows than it builds, or in so many pieces that slicing
    them costs about what building the rows does (a reordered batch): from_params then."""
    runs: list[tuple[int, int]] = []
    j, n, start = 0, len(batch), -1
    for i, r in enumerate(last):
        if j < n and batch[j] is r:
            if start < 0:
                start = i
            j += 1
            if j == n:      # the rest of ``last`` ended
                runs.append((start, i + 1))
                start = -1
                break
        elif start >= 0:
            runs.append((start, i))
            start = -1
    if start >= 0:
        runs.append((start, len(last)))
    if j == 0 or 2 * j < n or len(runs) > 4 + n // 4:
        return None
    return runs, batch[j:]


def prefill_inline(device: torch.device) -> bool:
    """Whether SCHEDULE runs the prefill on the event loop's thread. On the CPU a worker
    thread's: the forward computes for milliseconds with the GIL released (torch's ops
    release it), so the loop serves the other requests' consumers meanwhile. On a GPU
    the forward is kernel launches (graph replays) that hold the GIL: a thread lets
    nothing else run, and its two hops cost ~0.2-0.3 ms each on the lent H100's host
    (bench/probe_ttft_gpu.py). ``SPECLOOP_PREFILL_INLINE`` (1 or 0) sets it for an A/B."""
    env = os.environ.get("SPECLOOP_PREFILL_INLINE")
    if env:
        return env == "1"
    return bool(device.type == "cuda")
