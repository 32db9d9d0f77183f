"""One rank's iteration handlers: SCHEDULE, SYNC, PICK_GRAPH_KEY, DRAFT, VERIFY, RESCAN.

The step variant (with or without a drafter, single rank or group) is chosen once here at
construction; handlers never re-decide it per step.
"""

from __future__ import annotations

from typing import Any

import anyio
import attrs
import structlog
import torch

from specloop.graphs import SamplingPath
from specloop.samplers import RejectionResult, SamplingBatch

from ._frontdoor import FrontDoorMessage, RankReport, assign_least_loaded
from ._iteration import IterationRecord
from ._request import FinishReason, Request, RequestOutput
from ._scheduler import Scheduler
from ._states import IterationState
from ._wire import decode_outputs, encode_outputs
from ._verify import capture_variants, graph_template, make_verify_step, verify_inputs

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
        self.max_seq_len = config.model.max_seq_len
        self.scheduler = Scheduler(config.scheduler.max_batch_size,
                                   config.scheduler.max_num_tokens)
        self.eos_token_ids = frozenset(runner.loaded.tokenizer.eos_token_ids)
        self._limiter = anyio.CapacityLimiter(1)
        self._pending_outputs: list[tuple[int, RequestOutput]] = []
        self._loads = [0] * comm.world_size
        self.stats = EngineStats()
        self._sampling_cache: dict[int | None, tuple] = {}
        self.group_sync = config.group_sync_greedy_flag
        multi = comm.world_size > 1
        self.exchange = self._exchange_group if multi else self._exchange_local
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
                self._finish(request, FinishReason.CANCELLED, ())
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

    async def _exchange_local(self) -> FrontDoorMessage:
        if self.scheduler.num_requests == 0:
            await self.front.wait_for_work(timeout=None)
        return self.front.take_message(lambda new: tuple((0, r) for r in new))

    async def _exchange_group(self) -> FrontDoorMessage:
        """One tensor all-gather: each serving rank's outputs as a fixed-size block, and
        a flag; only when some rank raised it (rank 0 has requests, cancels or shutdown
        to send; an output block overflowed) does a pickled object exchange follow. The
        flags are gathered first, so every rank agrees on whether it happens."""
        message, pending = FrontDoorMessage(), self._pending_outputs
        self._pending_outputs = []
        if self.front is not None:
            if self.scheduler.num_requests == 0 and sum(self._loads) == 0:
                await self.front.wait_for_work(timeout=self.config.scheduler.idle_wait_s)
            message = self.front.take_message(
                lambda new: assign_least_loaded(new, self._loads))
        rows = self.scheduler.slots.num_slots
        block = encode_outputs(pending, rows, self.k)
        flag = (message != FrontDoorMessage()) or block is None
        if block is None:
            block = encode_outputs((), rows, self.k)
        header = torch.cat([torch.tensor([int(flag)]), block]).to(self.runner.device)
        gathered = (await self.comm.all_gather(header)).cpu()      # [world, 1 + rows*width]
        if self.front is not None:
            for flat in gathered[1:, 1:]:
                self.front.deliver(decode_outputs(flat, self.k, self.front.request_id))
        if bool(gathered[:, 0].any()):
            overflow = () if not pending or not gathered[self.comm.rank, 0] else pending
            reports = await self.comm.all_gather_object(
                message if self.front is not None else
                RankReport(tuple(out for _, out in overflow)))
            if self.front is not None:
                for report in reports[1:]:
                    self.front.deliver(report.outputs)
            message = reports[0]
        return message

    # SYNC -------------------------------------------------------------------------------
    async def sync(self, rec: IterationRecord) -> IterationState:
        local_greedy = all(r.params.is_greedy for r in rec.batch)
        rec.spec = rec.spec.evolve(is_all_greedy_sample=local_greedy)
        if self.comm.world_size == 1:  # nothing to agree on: no tensors on the hot path
            self._loads = [self.scheduler.num_requests]
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
        self._loads = facts[:, FACT_REQUESTS].tolist()
        rec.padded_batch_size = int(facts[:, FACT_BATCH].max())
        return S.PICK_GRAPH_KEY if rec.padded_batch_size else S.DONE

    # PICK_GRAPH_KEY ---------------------------------------------------------------------
    async def pick_graph_key(self, rec: IterationRecord) -> IterationState:
        rec.graph_key = self.graph_cache.pick(
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
        replay = self._draft_replay(rec.graph_key)
        slots = [r.slot for r in rec.batch]
        # Host tensors copied without blocking: a blocking host-to-device copy is a sync.
        ctx = DraftContext(
            token_ids=[r.token_ids for r in rec.batch],
            seq_lens=torch.tensor([r.seq_len for r in rec.batch], dtype=torch.int64).to(
                device, non_blocking=True),
            slots=torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
            host_slots=slots,
            sampling=rec.sampling, spec=rec.spec, sampler=self.sampler, comm=self.comm,
            run_sync=self.run_sync, replay=replay,
            graph_sampling=self._sampling_batch(rec.batch, rec.graph_key.batch_size)
            if replay is not None else None)
        proposal = await self.drafter.propose(ctx)
        rec.draft_token_ids, rec.draft_probs = proposal.token_ids, proposal.probs

    def _draft_replay(self, key):
        draft_key = attrs.evolve(key, stage="draft", captured=False)
        if not key.captured or not self.graph_cache.has(draft_key):
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
        if key.captured:
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

    def warmup_graphs(self) -> None:
        """Capture every VERIFY variant this engine can run, before serving."""
        point_mass = getattr(self.drafter, "point_mass", self.drafter is None)
        variants = capture_variants(self.config.speculative.use_rejection_sampling,
                                    point_mass)
        has_q = {(path, greedy): q for path, greedy, q in variants}
        keys = self.graph_cache.keys_to_capture(
            self.config.scheduler.max_batch_size, self.k, list(has_q))
        device, v = self.runner.device, self.runner.args.vocab_size
        for key in keys:
            template = graph_template(key, key.batch_size, device)
            q = None
            if self.k and has_q[(key.sampling_path, key.all_greedy)]:
                q = torch.zeros(0, self.k, v, device=device)
            example = verify_inputs([], None, q, template, k=self.k,
                                    scratch_slot=self.runner.cache.scratch_slot,
                                    device=device)
            step = make_verify_step(self.runner, self.sampler, template,
                                    advanced=key.sampling_path is SamplingPath.ADVANCED,
                                    kv_len=self.runner.cache.max_seq_len)
            with torch.inference_mode():
                self.graph_cache.capture(key, step, example)
                self._capture_draft(key, template)
        if hasattr(self.graph_cache, "seal"):
            self.graph_cache.seal()

    def _capture_draft(self, key, template: SamplingBatch) -> None:
        """The drafter's whole K-step proposal, when it offers a static step for this
        variant (not on the LM-head-TP path, whose collectives stay outside graphs)."""
        from specloop.models.drafters import DraftContext  # noqa: PLC0415

        advanced = key.sampling_path is SamplingPath.ADVANCED
        drafter = self.drafter
        if not self.k or not hasattr(drafter, "graph_step") or not drafter.can_graph(advanced):
            return
        empty = torch.zeros(0, dtype=torch.int64, device=self.runner.device)
        ctx = DraftContext(token_ids=[], seq_lens=empty, slots=empty, sampling=template,
                           spec=None, sampler=self.sampler, comm=self.comm, run_sync=None,
                           graph_sampling=template)
        self.graph_cache.capture(attrs.evolve(key, stage="draft"),
                                 drafter.graph_step(self.sampler, template, advanced=advanced),
                                 drafter.graph_inputs(ctx))

    # RESCAN -----------------------------------------------------------------------------
    async def rescan(self, rec: IterationRecord) -> IterationState:
        if rec.result is not None:
            tokens = rec.result.token_ids.tolist()
            accepted = rec.result.num_accepted.tolist()
            for request, row, n in zip(rec.batch, tokens, accepted):
                self._append(request, row[:n + 1], n)
            self.stats.record_iteration(len(rec.batch), self.k, sum(accepted))
        rec.finished = [r for r in rec.batch if r.finished]
        remaining = self.scheduler.running
        # The local flag for whoever reads before the next SYNC; the group override stays.
        rec.spec = rec.spec.evolve(
            is_all_greedy_sample=all(r.params.is_greedy for r in remaining))
        return S.DONE

    def _append(self, request: Request, new_tokens: list[int], num_accepted: int) -> None:
        request.num_iterations += 1
        request.num_drafted += self.k
        request.num_accepted += num_accepted
        emitted = []
        reason = None
        for token in new_tokens:
            request.token_ids.append(token)
            emitted.append(token)
            reason = self._stop_reason(request, token)
            if reason is not None:
                break
        request.num_cached = request.seq_len - 1
        self.stats.num_generated_tokens += len(emitted)
        self.runner.trim(request)
        if reason is not None:
            self._finish(request, reason, emitted)
        else:
            self._emit(request, emitted)

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if request.num_generated >= params.max_tokens:
            return FinishReason.LENGTH
        # The next VERIFY writes positions up to L - 1 + K: it must stay in the cache.
        if request.seq_len + self.k >= self.max_seq_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason, emitted) -> None:
        slot = request.slot
        self.scheduler.finish(request, reason)
        if slot is not None:
            self.runner.release(slot)
        if slot is not None and self.drafter is not None:
            self.drafter.release(slot)
        self._emit(request, emitted, finished=True)

    def _emit(self, request: Request, tokens, finished: bool = False) -> None:
        if not tokens and not finished:
            return
        # Token ids only: text is decoded by the consumer (generate), off this hot path.
        output = RequestOutput(request.request_id, tuple(tokens), "", finished,
                               request.finish_reason if finished else None)
        if self.front is not None:
            self.front.deliver((output,))
        else:
            self._pending_outputs.append((request.handle, output))

    def cancel_all(self) -> None:
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            self._finish(request, FinishReason.CANCELLED, ())


class EngineStats:
    """Speculation counters: AL = 1 + accepted / verify rows (vLLM's definition)."""

    def __init__(self) -> None:
        self.num_iterations = 0
        self.num_verify_rows = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_generated_tokens = 0

    def record_iteration(self, rows: int, k: int, accepted: int) -> None:
        self.num_iterations += 1
        self.num_verify_rows += rows
        self.num_draft_tokens += rows * k
        self.num_accepted_tokens += accepted

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / max(1, self.num_verify_rows)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(1, self.num_draft_tokens)

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in vars(self).items())
        return (f"EngineStats({counts}, mean_acceptance_length="
                f"{self.mean_acceptance_length:.3f}, acceptance_rate={self.acceptance_rate:.3f})")
