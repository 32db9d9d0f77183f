"""AsyncEngine: the embeddable front of specloop, on anyio."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Sequence

import anyio
import anyio.lowlevel
import structlog
import torch

from specloop.comm import pin_loop_thread
from specloop.samplers import SpecMetadata

from ._compile_watch import warming as compiles_of_warm_up
from ._compile_watch import watch as watch_compiles
from ._components import (build_communicator, build_drafter, build_graph_cache,
                          build_observers, build_sampler)
from ._config import EngineConfig
from ._errors import ConfigError, EngineClosedError
from ._front import FrontEnd
from ._frontdoor_state import FrontDoor
from ._iteration import IterationMachine, IterationRecord
from ._request import FinishReason
from ._runner import DTYPES, ModelRunner, resolve_device
from ._states import IterationObserver
from ._stats import EngineStats
from ._worker import RankWorker

if TYPE_CHECKING:
    from specloop.comm import Communicator
    from specloop.models import LoadedModel, Tokenizer

    from ._exchange import OutputExchange
    from ._frontdoor import FrontDoorPort

log = structlog.get_logger(__name__)


class AsyncEngine(FrontEnd):
    """``async with AsyncEngine(config) as engine: async for out in engine.generate(...)``.

    Multi-rank: every rank builds an engine with its communicator; rank 0 is the front
    door (``generate``, ``cancel``), the others ``await engine.wait_closed()``.
    """

    def __init__(self, config: EngineConfig, *, communicator: Communicator | None = None,
                 observers: Sequence[IterationObserver] = (), model: LoadedModel | None = None,
                 front_door: FrontDoorPort | None = None) -> None:
        """``front_door``: the one rank 0 serves instead of its own (a ``ProcessEngine``'s
        core serves its pipe to the parent process; requests then come from there)."""
        self.config = config
        # A communicator the engine built is the engine's to close; an injected one is not.
        self._owns_comm = communicator is None
        self.comm = _bounded(communicator if communicator is not None
                             else build_communicator(config), config)
        if self.comm.world_size != config.parallel.world_size:
            raise ConfigError("parallel.world_size", config.parallel.world_size,
                              f"the communicator has {self.comm.world_size} ranks",
                              "make them agree (torchrun --nproc-per-node, LocalGroup size)")
        self.observers = tuple(observers)
        self._model = model
        self.front: FrontDoorPort | None = None
        if self.comm.rank == 0:
            self.front = front_door if front_door is not None else FrontDoor()
        self.worker: RankWorker | None = None
        self.tokenizer: Tokenizer | None = None       # both set in __aenter__ (_build)
        self._exchange: OutputExchange | None = None  # the worker's (set in _build too)
        self._done = anyio.Event()
        # Stops watching Triton's compiles (set once warm-up is done, in _build).
        self._unwatch_compiles: Callable[[], None] = lambda: None
        self._init_front_end()

    # lifecycle (FrontEnd's __aenter__ / __aexit__) ---------------------------------------
    async def _start(self) -> str:
        await anyio.to_thread.run_sync(self._build)
        device_type: str = self._built.runner.device.type
        # The loop thread on a core of its own, now that the build's threads exist.
        pin_loop_thread(self.config.parallel.pin_host_cores, device_type)
        return device_type

    def _tasks(self) -> Sequence[Callable[[], Coroutine[Any, Any, None]]]:
        return (self._loop,)

    async def _release(self) -> None:
        self._unwatch_compiles()
        await self._close_comm()

    def _close_front(self) -> None:
        if self.front is not None:
            self.front.close()

    async def _close_comm(self) -> None:
        if self._owns_comm:
            # Process groups left to interpreter exit can abort the process (gloo).
            await anyio.to_thread.run_sync(self.comm.close)

    def _build(self) -> None:
        from specloop.models import load_model  # noqa: PLC0415
        from specloop.models.drafters import DrafterDeps  # noqa: PLC0415

        cfg = self.config
        device = resolve_device(cfg.model.device, self.comm.rank)
        if device.type == "cuda":
            # Streams and graph captures use the current device: make it this rank's.
            torch.cuda.set_device(device)
        loaded = self._model or load_model(cfg.model.name, dtype=DTYPES[cfg.model.dtype],
                                           device=device)
        self.tokenizer = loaded.tokenizer
        runner = ModelRunner(loaded, num_slots=cfg.scheduler.max_batch_size,
                             max_seq_len=cfg.model.max_seq_len,
                             max_prefill_tokens=cfg.scheduler.max_num_tokens,
                             page_size=cfg.model.kv_page_size)
        deps = DrafterDeps(loaded, runner.cache, cfg.scheduler.max_batch_size,
                           cfg.model.max_seq_len)
        drafter = build_drafter(cfg, deps)
        runner.feature_layers = () if drafter is None else tuple(drafter.feature_layers)
        self.worker = RankWorker(
            config=cfg, runner=runner, drafter=drafter,
            sampler=build_sampler(cfg), comm=self.comm, graph_cache=build_graph_cache(cfg),
            front=self.front)
        with compiles_of_warm_up():
            self.worker.warmup_graphs()
        self._unwatch_compiles = watch_compiles(self._compiled(self.worker.stats))
        self._exchange = self.worker.exchange   # the loop's end hands over what it held
        # components.observers first, then those passed in.
        self.observers = (*build_observers(cfg), *self.observers)
        log.info("engine_built", rank=self.comm.rank, model=cfg.model.name,
                 device=str(device), method=cfg.speculative.method, k=cfg.speculative.k)

    def _compiled(self, stats: EngineStats) -> Callable[[str, str], None]:
        """What a Triton compile while serving does (engine/_compile_watch.py): a warning
        event, and a count in the stats."""
        rank = self.comm.rank

        def compiled(kernel: str, specialisation: str) -> None:
            stats.kernels_compiled_while_serving += 1
            log.warning("kernel_compiled_while_serving", rank=rank, kernel=kernel,
                        specialisation=specialisation[:300],
                        count=stats.kernels_compiled_while_serving)
        return compiled

    async def _loop(self) -> None:
        worker, exchange = self._built, self._exchange
        assert exchange is not None, "set in _build, with the worker"
        machine = IterationMachine(worker.handlers(), rank=self.comm.rank,
                                   num_draft_tokens=worker.k, observers=self.observers)
        spec = SpecMetadata(use_rejection_sampling=self.config.speculative.use_rejection_sampling)
        iteration = 0
        try:
            await worker.agree_costs()      # adaptive K under ADP: one table for all ranks
            while True:
                record = await machine.run(IterationRecord(iteration, spec))
                spec, iteration = record.spec, iteration + 1
                if record.shutdown:
                    break
        except anyio.get_cancelled_exc_class():
            raise           # cancelled from outside: not a failure; streams end CANCELLED
        except BaseException as exc:
            self._failure = exc
            log.error("engine_failed", rank=self.comm.rank, error=repr(exc))
            if self.front is not None:
                self.front.close_all(FinishReason.ERROR, f"engine failed: {exc!r}")
                # Raising cancels the `async with` body: first let the consumers waiting
                # on a stream take its error, so they end with EngineClosedError.
                with anyio.CancelScope(shield=True):
                    for _ in range(3):
                        await anyio.lowlevel.checkpoint()
            raise
        finally:
            worker.cancel_all()
            exchange.hand_over()    # outputs rank 0 still held (after a deferred exchange)
            if self.front is not None:
                self.front.close_all(FinishReason.CANCELLED)
            self._done.set()

    async def wait_closed(self) -> None:
        """Until the group shuts down (rank 0 leaving its ``async with``)."""
        await self._done.wait()

    # the front door's hooks (FrontEnd) ------------------------------------------------
    @property
    def _front_door(self) -> FrontDoor:
        """Rank 0's front door; other ranks have none to take requests with."""
        if not isinstance(self.front, FrontDoor):
            raise EngineClosedError(f"rank {self.comm.rank} is not the front door; use rank 0"
                                    if self.front is None else
                                    "this engine serves another process's front door")
        return self.front

    @property
    def _built(self) -> RankWorker:
        """The worker; the request paths get here after _check_front, so it is built."""
        assert self.worker is not None, "the engine is built in `async with` (__aenter__)"
        return self.worker

    @property
    def _tokenizer(self) -> Tokenizer:
        assert self.tokenizer is not None, "the engine is built in `async with` (__aenter__)"
        return self.tokenizer

    @property
    def _verify_drafts(self) -> int:
        return self._built.verify_drafts

    @property
    def _vocab_size(self) -> int:
        return self._built.runner.args.vocab_size

    def _check_front(self) -> None:
        front = self._front_door
        if self.worker is None or self._done.is_set() or front.closing:
            raise EngineClosedError("engine is not running (use `async with AsyncEngine(...)`)"
                                    if self._failure is None else
                                    f"engine failed: {self._failure!r}")

    # introspection ----------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        return self._built.stats

    async def fetch_stats(self) -> EngineStats:
        """A copy of ``stats``: ``ProcessEngine.fetch_stats``' call, so that a server or a
        bench reads either engine's counters the same way."""
        return copy.deepcopy(self.stats)

    @property
    def num_free_slots(self) -> int:
        return self._built.scheduler.slots.num_free




def _bounded(comm: Communicator, config: EngineConfig) -> Communicator:
    """The communicator with every collective wait capped at parallel.collective_timeout_s
    (one that cannot bound its waits, ``timeout_s`` None, is used as it is)."""
    try:
        bounded = comm.bounded(config.parallel.collective_timeout_s)
    except ValueError as exc:
        raise ConfigError("parallel.collective_timeout_s", config.parallel.collective_timeout_s,
                          str(exc), "make the two agree") from exc
    if bounded.timeout_s is None:
        log.warning("communicator_unbounded", communicator=type(comm).__name__)
    return bounded
