"""One rank's iteration handlers: SCHEDULE, SYNC, PICK_GRAPH_KEY, DRAFT, VERIFY, RESCAN.

Read top to bottom, this file is the iteration diagram (docs/architecture.md). What the
handlers lean on lives beside it: the front-door exchange (``_exchange``), the stop rules
and outputs (``_outputs``), the counters (``_stats``), VERIFY's step (``_verify``) and the
warm-up that captures graphs (``_warmup``, on ``graphs``). The step variant (with or
without a drafter, single rank or group) is chosen once here at construction; handlers
never re-decide it per step.
"""

from __future__ import annotations

from typing import Any

import anyio
import attrs
import structlog
import torch

from specloop.graphs import SamplingPath
from specloop.samplers import RejectionResult, SamplingBatch

from ._exchange import OutputExchange
from ._iteration import IterationRecord
from ._outputs import Outputs
from ._request import FinishReason, Request
from ._scheduler import Scheduler
from ._states import IterationState
from ._stats import EngineStats
from ._verify import make_verify_step, verify_inputs
from ._warmup import warm_up_graphs

log = structlog.get_logger(__name__)
S = IterationState

# SYNC's one all-gather row per rank: what the group must agree on.
FACT_TOKENS, FACT_BATCH, FACT_REQUESTS, FACT_ALL_GREEDY = range(4)


class RankWorker:
    def __init__(self, *, config, runner, drafter, sampler, comm, graph_cache,
                 front) -> None:
        self.config = config
        self.runner = runner
        self.drafter = drafter
        self.sampler = sampler
        self.comm = comm
        self.graph_cache = graph_cache
        self.front = front          # FrontDoor on rank 0, None elsewhere
        self.k = config.speculative.k
        self.scheduler = Scheduler(config.scheduler.max_batch_size,
                                   config.scheduler.max_num_tokens)
        self._limiter = anyio.CapacityLimiter(1)
        self.stats = EngineStats()
        self._sampling_cache: dict[int | None, tuple] = {}
        self.group_sync = config.group_sync_greedy_flag
        self.exchange = OutputExchange(config=config, comm=comm, front=front,
                                       scheduler=self.scheduler, device=runner.device)
        self.outputs = Outputs(config=config, scheduler=self.scheduler, runner=runner,
                               drafter=drafter, stats=self.stats,
                               deliver=self.exchange.deliver)
        self.draft_step = self._draft_with_drafter if self.k else self._no_draft
        # Drafters whose DRAFT runs collectives (LM-head TP) are called on idle ranks too.
        self.draft_when_idle = getattr(drafter, "needs_empty_calls", False)
        self.on_verified = getattr(drafter, "on_verified", None)

    def handlers(self) -> dict[IterationState, Any]:
        return {S.SCHEDULE: self.schedule, S.SYNC: self.sync,
                S.PICK_GRAPH_KEY: self.pick_graph_key, S.DRAFT: self.draft,
                S.VERIFY: self.verify, S.RESCAN: self.rescan}

    async def run_sync(self, fn):
        return await anyio.to_thread.run_sync(fn, limiter=self._limiter)

    def warmup_graphs(self) -> None:
        """Capture every VERIFY (and DRAFT) variant this engine can run, before serving."""
        warm_up_graphs(config=self.config, runner=self.runner, sampler=self.sampler,
                       drafter=self.drafter, comm=self.comm, graph_cache=self.graph_cache)

    # SCHEDULE ---------------------------------------------------------------------------
    async def schedule(self, rec: IterationRecord) -> IterationState:
        message = await self.exchange()
        rec.shutdown = message.shutdown
        for rank, new in message.assignments:
            if rank == self.comm.rank:
                self.scheduler.add(Request.from_new(new))
        for request_id in message.cancels:
            request = self.scheduler.find(request_id)
            if request is not None:
                self.outputs.finish(request, FinishReason.CANCELLED, ())
        admitted = self.scheduler.admit()
        if admitted:
            await self.run_sync(lambda: self._prefill(admitted))
        rec.batch = list(self.scheduler.running)
        return S.SYNC

    def _prefill(self, admitted: list[Request]) -> None:
        for request in admitted:
            hidden = self.runner.prefill(request)
            if self.drafter is not None:
                self.drafter.prefill(request.slot, request.token_ids[:-1], hidden)

    # SYNC -------------------------------------------------------------------------------
    async def sync(self, rec: IterationRecord) -> IterationState:
        local_greedy = all(r.params.is_greedy for r in rec.batch)
        rec.spec = rec.spec.evolve(is_all_greedy_sample=local_greedy)
        if self.comm.world_size == 1:  # nothing to agree on: no tensors on the hot path
            self.exchange.loads = [self.scheduler.num_requests]
            rec.padded_batch_size = len(rec.batch)
            return S.PICK_GRAPH_KEY if rec.padded_batch_size else S.DONE
        facts = torch.tensor([[len(rec.batch) * (self.k + 1), len(rec.batch),
                               self.scheduler.num_requests, int(local_greedy)]])
        if self.comm.world_size > 1:
            # The one collective of SYNC; whether it runs depends on config alone. On the
            # model's device, so NCCL carries it on GPUs; read back once on the host.
            device = self.runner.device
            facts = (await self.comm.all_gather(facts[0].to(device))).cpu()
            if self.group_sync:
                rec.spec = rec.spec.evolve(
                    group_all_greedy_sample=bool(facts[:, FACT_ALL_GREEDY].all()))
        rec.group_facts = facts
        self.exchange.loads = facts[:, FACT_REQUESTS].tolist()
        rec.padded_batch_size = int(facts[:, FACT_BATCH].max())
        return S.PICK_GRAPH_KEY if rec.padded_batch_size else S.DONE

    # PICK_GRAPH_KEY ---------------------------------------------------------------------
    async def pick_graph_key(self, rec: IterationRecord) -> IterationState:
        rec.graph_key, rec.graph_captured = self.graph_cache.pick(
            rec.padded_batch_size, self.k, SamplingPath.of(rec.spec), rec.spec.all_greedy,
            agreed=self._group_agrees(rec))
        if rec.batch:
            rec.sampling = self._sampling_batch(rec.batch, None)
        return S.DRAFT

    def _sampling_batch(self, batch: list[Request], pad_to: int | None) -> SamplingBatch:
        """Per-row sampling tensors, rebuilt only when the batch's requests change (most
        iterations run the same batch as the one before); one cache per padding."""
        key = tuple(batch)      # Request compares by identity: a reused id is a new key
        cached = self._sampling_cache.get(pad_to)
        if cached is None or cached[0] != key:
            cached = self._sampling_cache[pad_to] = (key, SamplingBatch.from_params(
                [r.params for r in batch], [r.seed for r in batch],
                device=self.runner.device, pad_to=pad_to))
        return cached[1]

    def _group_agrees(self, rec: IterationRecord) -> bool:
        """Whether every rank derives the same key. With the group sync on, the flag is
        agreed; otherwise each rank's path follows from its flag in the SYNC facts, so all
        ranks see whether they differ, and then all run eagerly."""
        if self.comm.world_size == 1 or rec.spec.group_all_greedy_sample is not None:
            return True
        flags = rec.group_facts[:, FACT_ALL_GREEDY]
        return bool((flags == flags[0]).all())

    # DRAFT ------------------------------------------------------------------------------
    async def draft(self, rec: IterationRecord) -> IterationState:
        # Pages for every position DRAFT and VERIFY will write, before either runs.
        self.runner.reserve(rec.batch, self.k)
        await self.draft_step(rec)
        return S.VERIFY

    async def _no_draft(self, rec: IterationRecord) -> None:
        rec.draft_token_ids = None

    async def _draft_with_drafter(self, rec: IterationRecord) -> None:
        from specloop.models.drafters import DraftContext  # noqa: PLC0415

        if not rec.batch and not self.draft_when_idle:
            return
        device = self.runner.device
        replay = self._draft_replay(rec)
        slots, seq_lens = [r.slot for r in rec.batch], [r.seq_len for r in rec.batch]
        # Host tensors copied without blocking: a blocking host-to-device copy is a sync.
        ctx = DraftContext(
            token_ids=[r.token_ids for r in rec.batch],
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(device, non_blocking=True),
            slots=torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
            host_slots=slots, host_seq_lens=seq_lens,
            sampling=rec.sampling, spec=rec.spec, sampler=self.sampler, comm=self.comm,
            run_sync=self.run_sync, replay=replay,
            graph_sampling=self._sampling_batch(rec.batch, rec.graph_key.batch_size)
            if replay is not None else None)
        proposal = await self.drafter.propose(ctx)
        rec.draft_token_ids, rec.draft_probs = proposal.token_ids, proposal.probs

    def _draft_replay(self, rec: IterationRecord):
        draft_key = attrs.evolve(rec.graph_key, stage="draft")
        if not rec.graph_captured or not self.graph_cache.has(draft_key):
            return None
        return lambda inputs: self.graph_cache.replay(draft_key, inputs)

    # VERIFY -----------------------------------------------------------------------------
    async def verify(self, rec: IterationRecord) -> IterationState:
        if rec.batch:
            rec.result = await self.run_sync(lambda: self._verify(rec))
        return S.RESCAN

    @torch.inference_mode()
    def _verify(self, rec: IterationRecord) -> RejectionResult:
        """Queue VERIFY, then read its tokens and counts back in one device-to-host copy
        (into a pinned buffer); the wait for the GPU happens here, so VERIFY's duration
        includes its device time and RESCAN reads host memory only."""
        batch, key, real = rec.batch, rec.graph_key, len(rec.batch)
        advanced = rec.spec.wants_advanced_draft_sampling
        if rec.graph_captured:
            inputs = self._inputs(rec, self._sampling_batch(batch, key.batch_size))
            out = self.graph_cache.replay(key, inputs)
        else:
            step = make_verify_step(self.runner, self.sampler, rec.sampling,
                                    advanced=advanced, kv_len=None)
            out = step(self._inputs(rec, rec.sampling))
        host = self.runner.read_back(out["packed"][:real])
        result = RejectionResult(host[:, :-1], host[:, -1])
        if self.on_verified is not None:
            self.on_verified([r.slot for r in batch], [r.seq_len - 1 for r in batch],
                             out["hidden"][:real], result.num_accepted.tolist())
        return result

    def _inputs(self, rec: IterationRecord, sampling: SamplingBatch):
        return verify_inputs(rec.batch, rec.draft_token_ids, rec.draft_probs, sampling,
                             k=self.k, scratch_slot=self.runner.cache.scratch_slot,
                             device=self.runner.device)

    # RESCAN -----------------------------------------------------------------------------
    async def rescan(self, rec: IterationRecord) -> IterationState:
        if rec.result is not None:
            tokens = rec.result.token_ids.tolist()
            accepted = rec.result.num_accepted.tolist()
            for request, row, n in zip(rec.batch, tokens, accepted):
                self.outputs.append(request, row[:n + 1], n)
            self.stats.record_iteration(len(rec.batch), self.k, sum(accepted))
        rec.finished = [r for r in rec.batch if r.finished]
        return S.DONE

    def cancel_all(self) -> None:
        self.outputs.cancel_all()
