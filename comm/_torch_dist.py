"""torch.distributed behind the Communicator protocol: gloo on CPU, NCCL on CUDA."""
from __future__ import annotations

import contextlib
import datetime
import gc
import os
import pickle
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import attrs
import structlog
import torch
import torch.distributed as dist

from . import _shm
from ._call import CollectiveCall
from ._errors import CollectiveMismatchError, CollectiveTimeoutError, CommError
from ._protocol import Communicator, ReduceOp, check_reduce_op, check_src, check_subgroup, check_tensor
from ._torchrun_env import TorchrunEnv

log = structlog.get_logger(__name__)

_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# all_gather_single is the newer name (torch 2.13); the GPU machines run 2.11.
_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Inline waits: poll back-to-back this long, then at this interval (asyncio's timer
# resolution is ~1 ms anyway).
_SPIN_S, _POLL_S = 0.005, 0.001
# all_gather_object through shared memory (``shared_memory``): each rank's pickle padded to
# a power of two of at least _OBJECT_MIN bytes (a handful of sizes, each set up once);
# past _OBJECT_MAX every rank goes over gloo (they all see the same lengths).
_OBJECT_MIN, _OBJECT_MAX = 256, 1 << 20
_PEER_LOST = ("connection closed", "connection reset", "broken pipe", "connection refused")


class _Family:
    """State shared by a world communicator and its subgroups."""

    def __init__(self, device: torch.device, timeout: datetime.timedelta, owns_world: bool) -> None:
        self.device = device
        self.timeout = timeout
        self.owns_world = owns_world
        # One collective at a time per process, in call order (anyio locks are FIFO):
        # NCCL and gloo both need every rank to issue group ops in the same order.
        self.lock = _fast_lock()


class TorchDistributedCommunicator(Communicator):
    """One process's rank in a torch.distributed group.

    Tensors go over the backend group (NCCL when the device is CUDA, else gloo); host
    objects, barriers, checked-mode signatures and the all-gather of host (CPU) tensors
    over a gloo group, or, with ``shared_memory``, host tensors' and objects' all-gathers
    through shared memory. Blocking calls run
    in a worker thread so the event loop keeps serving; with ``inline`` set (opt-in),
    tensor collectives are issued on the loop and polled instead, bounded by
    ``timeout_s``. With `checked=True` every
    collective is preceded by an exchange of (seq, op, fingerprint of shape, dtype,
    group, arguments); a difference raises CollectiveMismatchError on every rank.
    """

    def __init__(self, *, family: _Family, group: Any, object_group: Any, ranks: Sequence[int],
                 name: str = "world", checked: bool = False) -> None:
        self._family = family
        self._group = group
        self._object_group = object_group
        self._ranks = tuple(ranks)
        self._name = name
        self._checked = checked
        self._seq = 0
        self._me = dist.get_rank()
        # Tensor collectives issued on the event loop's thread and waited for there
        # (`_run_inline`) rather than in a worker thread, where NCCL's calls only enqueue
        # (a thread hop per collective cost ~0.2-0.5 ms, issue 12). Opt-in until measured
        # on NCCL (bench/adp_run.py --inline-collectives); tested over gloo. Checked mode
        # always keeps the thread.
        self.inline = False
        # Host tensors' all_gather, and all_gather_object, through files in shared
        # memory when every rank runs on this host (``_shm``), not gloo (~0.5 ms a call;
        # objects past _OBJECT_MAX, broadcasts and barriers still go over gloo); every
        # rank of the group must set it alike (the first call of each size sets the file
        # up, collectively).
        # Not with ``checked``. On by default on CUDA ranks, whose hosts have cores for
        # the polling ranks (2 H200s: see docs/performance-history.md, "ADP on 2 × H200");
        # off on the CPU, where ranks polling compete with the compute for cores (gloo
        # sleeps in a syscall).
        self.shared_memory = family.device.type == "cuda"
        self._shared: dict[int, _shm.SharedGather | None] = {}

    # all_gather takes host tensors on any device (over gloo): the engine's SCHEDULE
    # exchange then never touches the device (issue 12).
    host_tensors = True

    @classmethod
    def from_env(cls, *, device: str | torch.device | None = None, checked: bool = False,
                 timeout: float = 300.0) -> TorchDistributedCommunicator:
        """Join the world torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
        MASTER_PORT); blocks until every rank joined. `device` defaults to
        cuda:LOCAL_RANK when CUDA is available, else cpu. `timeout` (seconds) bounds
        every collective where the backend allows (gloo; NCCL's watchdog aborts)."""
        env = TorchrunEnv.read()
        dev = _pick_device(device, env.local_rank)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        span = datetime.timedelta(seconds=timeout)
        owns = not dist.is_initialized()
        if owns:
            dist.init_process_group(backend, init_method="env://", rank=env.rank,
                                    world_size=env.world_size, timeout=span)
        ranks = tuple(range(dist.get_world_size()))
        # Under gloo the world group carries objects too; NCCL cannot, so add a gloo group.
        objects = dist.group.WORLD if backend == "gloo" else dist.new_group(list(ranks), backend="gloo", timeout=span)
        log.info("torch_distributed_joined", rank=env.rank, world_size=env.world_size, backend=backend,
                 device=str(dev), checked=checked)
        return cls(family=_Family(dev, span, owns), group=dist.group.WORLD, object_group=objects,
                   ranks=ranks, checked=checked)

    @property
    def rank(self) -> int:
        return self._ranks.index(self._me)

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    @property
    def name(self) -> str:
        return self._name

    @property
    def device(self) -> torch.device:
        return self._family.device

    @property
    def timeout_s(self) -> float:
        """The process groups' timeout: the longest one collective waits for a peer."""
        return self._family.timeout.total_seconds()

    def bounded(self, seconds: float) -> TorchDistributedCommunicator:
        """Self when its groups already time out within `seconds`; a group's timeout is
        fixed when it is created, so a longer one cannot be shortened here."""
        if self.timeout_s <= seconds:
            return self
        raise ValueError(f"this torch.distributed communicator waits up to {self.timeout_s:g} s "
                         f"per collective, longer than {seconds:g} s; join with "
                         f"TorchDistributedCommunicator.from_env(timeout={seconds:g})")

    async def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host (CPU) tensor goes over the gloo group whatever the device: no copy to
        the device and back, and no wait behind work queued there (``host_tensors``).
        On a CUDA communicator it is always issued inline (2 H200s, SCHEDULE's exchange:
        0.53 ms median after the last rank arrived, against 0.88 ms through the thread)."""
        check_tensor(tensor)
        if self.shared_memory and not self._checked and tensor.device.type == "cpu":
            rows = await self._shared_call(_shm.tensor_bytes(tensor), lambda seq: (
                CollectiveCall.for_tensor("all_gather", self._name, seq, tensor)))
            if rows is not None:
                return _shm.tensor_from(rows, self.world_size, tensor)
        group = self._group_for(tensor)
        host = tensor.device.type == "cpu" and self.device.type == "cuda"
        if (self.inline or host) and not self._checked:
            return await self._run_inline(CollectiveCall.for_tensor(
                "all_gather", self._name, self._seq, tensor),
                lambda: self._all_gather_async(tensor, group))
        return await self._run(CollectiveCall.for_tensor, ("all_gather", tensor), self._all_gather,
                               tensor, group)

    async def all_gather_object(self, obj: Any) -> list[Any]:
        """Over gloo, or with ``shared_memory`` (not ``checked``) as two shared-memory
        gathers, the pickles' lengths then the pickles (SCHEDULE's flagged exchange: two
        gloo all-gathers cost ~1 ms on 2 H200s)."""
        if self.shared_memory and not self._checked:
            with anyio.CancelScope(shield=True):    # both gathers or neither, as gloo's
                shared = await self._shared_objects(obj)
            if shared is not None:
                return shared
        return await self._gloo_all_gather_object(obj)

    async def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Through shared memory where every rank is on this host (``shared_memory``, not
        ``checked``): no torch op on the way. Else a host uint8 tensor's ``all_gather``
        (gloo; checked in ``checked`` mode)."""
        if self.shared_memory and not self._checked:
            rows = await self._shared_call(data, lambda seq: CollectiveCall(
                "all_gather_bytes", self._name, seq, (len(data),), "uint8"))
            if rows is not None:
                n = len(data)
                return [rows[r * n:(r + 1) * n] for r in range(self.world_size)]
        row = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
            torch.empty(0, dtype=torch.uint8)
        return [r.tobytes() for r in (await self.all_gather(row)).numpy()]

    async def _gloo_all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = await self._run(CollectiveCall, ("all_gather_object",),
                                              self._all_gather_object, obj)
        return gathered

    async def _shared_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` through shared memory; None (before any exchange of the
        pickles) when the ranks are not on one host or a pickle is past ``_OBJECT_MAX``."""
        data = pickle.dumps(obj)
        def call(seq: int) -> CollectiveCall:
            return CollectiveCall("all_gather_object", self._name, seq)

        lengths = await self._shared_call(len(data).to_bytes(8, "little"), call)
        if lengths is None:
            return None
        sizes = [int.from_bytes(lengths[8 * r:8 * r + 8], "little")
                 for r in range(self.world_size)]
        cap = max(_OBJECT_MIN, 1 << (max(sizes) - 1).bit_length())
        if cap > _OBJECT_MAX:
            return None
        rows = await self._shared_call(data + bytes(cap - len(data)), call)
        assert rows is not None, "this host's ranks gathered the lengths through it"
        return [pickle.loads(rows[r * cap:r * cap + n]) for r, n in enumerate(sizes)]

    async def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        self._check_device(check_tensor(tensor))
        check_reduce_op(op)
        call_args = ("all_reduce", tensor, f"op={op}")
        if self.inline and not self._checked:
            return await self._run_inline(CollectiveCall.for_tensor(
                "all_reduce", self._name, self._seq, tensor, f"op={op}"),
                lambda: self._all_reduce_async(tensor, op))
        return await self._run(CollectiveCall.for_tensor, call_args, self._all_reduce, tensor, op)

    async def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        check_src(src, self.world_size)
        return await self._run(_object_call, ("broadcast_object", f"src={src}"), self._broadcast_object, obj, src)

    async def barrier(self) -> None:
        await self._run(CollectiveCall, ("barrier",), dist.barrier, group=self._object_group)

    async def subgroup(self, ranks: Sequence[int], name: str) -> TorchDistributedCommunicator:
        """Members only call this, in the same order on each (torch names groups by
        the count each process created, so create subgroups at startup, symmetrically)."""
        members = check_subgroup(ranks, name, self._ranks, self._me)
        async with self._family.lock:
            group, objects = await anyio.to_thread.run_sync(self._new_groups, members, name)
        return TorchDistributedCommunicator(family=self._family, group=group, object_group=objects,
                                            ranks=members, name=name, checked=self._checked)

    def close(self) -> None:
        """Destroy the process groups if from_env created them; the object is unusable after."""
        for shared in self._shared.values():
            if shared is not None:
                shared.close()
        self._shared.clear()
        if self._family.owns_world and dist.is_initialized():
            dist.destroy_process_group()
            # Drop our references too: a process group freed at interpreter exit can take
            # its gloo threads down mid-flight ("terminate called ...", SIGABRT).
            self._group = self._object_group = None
            gc.collect()
            log.info("torch_distributed_closed", rank=self._me)

    async def _run(self, make_call: Callable[..., CollectiveCall], call_args: tuple[Any, ...], fn: Callable[..., Any],
                   *args: Any, **kwargs: Any) -> Any:
        async with self._family.lock:
            # Numbered inside the lock so the sequence follows execution order.
            op, *rest = call_args
            call = make_call(op, self._name, self._seq, *rest)
            self._seq += 1
            return await anyio.to_thread.run_sync(self._blocking, call, fn, args, kwargs)

    async def _run_inline(self, call: CollectiveCall,
                          start: Callable[[], tuple[Any, torch.Tensor]]) -> torch.Tensor:
        """Issue the collective here (``start`` -> (work, result)), then poll it, letting
        other tasks run, until it completed or ``timeout_s`` passed. Once issued it is seen
        through, like the thread path (a cancel waits for it): every rank must finish it
        or the group's order breaks. ``call`` was numbered before the lock: renumbered
        inside it, so the sequence follows execution order."""
        async with self._family.lock:
            call = attrs.evolve(call, seq=self._seq)
            self._seq += 1
            with anyio.CancelScope(shield=True):
                try:
                    with self._device_context():
                        work, result = start()
                    await self._wait(work, call)
                except CommError:
                    raise
                except RuntimeError as exc:
                    raise _translate(exc, call) from exc
            return result

    async def _shared_gather(self, nbytes: int) -> _shm.SharedGather | None:
        """The shared-memory all-gather for tensors of ``nbytes``, set up at its first
        use by every rank together; None when the ranks are not all on this host."""
        if nbytes in self._shared:
            return self._shared[nbytes]
        hosts = await self._gloo_all_gather_object(socket.gethostname())
        if len(set(hosts)) > 1 or not _shm.supported():
            self._shared[nbytes] = None
            return None
        path = await self.broadcast_object(
            _shm.create_file(self.world_size, nbytes) if self.rank == 0 else None, src=0)
        shared = _shm.SharedGather(path, self.rank, self.world_size, nbytes)
        await self.barrier()        # every rank has mapped it: the name can go
        if self.rank == 0:
            os.unlink(path)
        self._shared[nbytes] = shared
        return shared

    async def _shared_call(self, row: bytes, call: Callable[[int], CollectiveCall]
                           ) -> bytes | None:
        """Every rank's ``row`` through shared memory (``SharedGather.result``); None when
        the ranks are not all on this host. A length is set up (collectively) at its first
        call. ``call(seq)``: what a timeout error says was called (built only then)."""
        nbytes = len(row)
        shared = self._shared[nbytes] if nbytes in self._shared else \
            await self._shared_gather(nbytes)
        return None if shared is None else await self._run_shared(shared, row, call)

    async def _run_shared(self, shared: _shm.SharedGather, row: bytes,
                          call: Callable[[int], CollectiveCall]) -> bytes:
        """Post, then poll until every rank has; the last rank to arrive finds the call
        complete and never yields (nor builds the call's record). The lock is taken
        without yielding when free, whatever anyio's version (before 4.5 ``acquire``
        always yields: rank 0's consumers could then run between its arrival stamp and
        its post, and the other ranks waited for them)."""
        lock = self._family.lock
        try:
            lock.acquire_nowait()
        except anyio.WouldBlock:
            await lock.acquire()
        try:
            seq = self._seq
            self._seq += 1
            shared.post(row)
            if not shared.ready():
                with anyio.CancelScope(shield=True):    # seen through, as the other paths
                    await self._poll(shared.ready, call(seq))
            return shared.result()
        finally:
            lock.release()

    async def _poll(self, done: Callable[[], bool], call: CollectiveCall) -> None:
        """Until ``done()``, yielding to the loop: back-to-back for the first ``_SPIN_S``,
        then every ``_POLL_S``; past ``timeout_s`` raise."""
        now = time.monotonic()
        deadline, spin_until = now + self.timeout_s, now + _SPIN_S
        while not done():
            now = time.monotonic()
            if now > deadline:
                raise CollectiveTimeoutError(call, (), f"not completed within {self.timeout_s:g} s")
            await anyio.sleep(0 if now < spin_until else _POLL_S)

    async def _wait(self, work: Any, call: CollectiveCall) -> None:
        """Poll ``work`` (an event query), yielding to the loop: back-to-back for the first
        ``_SPIN_S`` (a collective of a balanced group completes within it), then every
        ``_POLL_S``; past ``timeout_s`` raise. ``work.wait()`` then surfaces the backend's
        error and (NCCL) orders the current stream after the collective."""
        await self._poll(work.is_completed, call)
        with self._device_context():
            work.wait()

    def _device_context(self) -> contextlib.AbstractContextManager[Any]:
        # The loop's and worker threads start on cuda:0; NCCL needs this rank's device.
        context: contextlib.AbstractContextManager[Any] = (
            torch.cuda.device(self.device) if self.device.type == "cuda"
            else contextlib.nullcontext())
        return context

    def _blocking(self, call: CollectiveCall, fn: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
        # Worker threads start on cuda:0; bind this rank's device for NCCL.
        ctx = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with ctx:
            try:
                if self._checked:
                    self._check_symmetry(call)
                return fn(*args, **kwargs)
            except CommError:
                raise
            except RuntimeError as exc:
                raise _translate(exc, call) from exc

    def _check_symmetry(self, call: CollectiveCall) -> None:
        # Host tensors for the gloo group, whatever default device the caller set.
        mine = torch.tensor(call.signature(), dtype=torch.int64, device="cpu")  # [3]
        table = torch.empty(self.world_size * mine.numel(), dtype=torch.int64, device="cpu")
        _GATHER_INTO(table, mine, group=self._object_group)
        if bool((table.view(self.world_size, -1) == mine).all()):
            return
        # Every rank saw the same table, so every rank enters this second exchange.
        calls: list[Any] = [None] * self.world_size
        dist.all_gather_object(calls, call, group=self._object_group)
        error = CollectiveMismatchError(dict(zip(self._ranks, calls)))
        log.error("collective_mismatch", rank=self._me, error=str(error))
        raise error

    def _group_for(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type == "cpu":
            return self._object_group      # gloo (the world group itself on a CPU device)
        self._check_device(tensor)
        return self._group

    def _all_gather(self, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        flat = tensor.detach().contiguous().reshape(-1)  # [n]
        out = torch.empty(self.world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
        _GATHER_INTO(out, flat, group=group)
        return out.view(self.world_size, *tensor.shape)

    def _all_gather_async(self, tensor: torch.Tensor, group: Any) -> tuple[Any, torch.Tensor]:
        flat = tensor.detach().contiguous().reshape(-1)  # [n]
        out = torch.empty(self.world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
        work = _GATHER_INTO(out, flat, group=group, async_op=True)
        return work, out.view(self.world_size, *tensor.shape)

    def _all_reduce_async(self, tensor: torch.Tensor, op: str) -> tuple[Any, torch.Tensor]:
        out = tensor.detach().clone().contiguous()  # the caller's tensor stays untouched
        return dist.all_reduce(out, op=_TORCH_OPS[op], group=self._group, async_op=True), out

    def _all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._object_group)
        return out

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        out = tensor.detach().clone().contiguous()  # the caller's tensor stays untouched
        dist.all_reduce(out, op=_TORCH_OPS[op], group=self._group)
        return out

    def _broadcast_object(self, obj: Any, src: int) -> Any:
        box = [pickle.loads(pickle.dumps(obj)) if self.rank == src else None]  # src gets a copy too
        dist.broadcast_object_list(box, group=self._object_group, group_src=src)
        return box[0]

    def _new_groups(self, members: tuple[int, ...], name: str) -> tuple[Any, Any]:
        span = self._family.timeout
        group = dist.new_group(list(members), timeout=span, use_local_synchronization=True, group_desc=name)
        if self.device.type != "cuda":
            return group, group
        objects = dist.new_group(list(members), backend="gloo", timeout=span,
                                 use_local_synchronization=True, group_desc=f"{name}_objects")
        return group, objects

    def _check_device(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != self.device.type:
            raise ValueError(f"tensor is on {tensor.device}, but this communicator's device is {self.device}")


def _fast_lock() -> anyio.Lock:
    """A lock whose uncontended acquire does not yield to the loop (anyio >= 4.5): a
    collective is then posted before other tasks run (issue 12: rank 0 posting late)."""
    try:
        return anyio.Lock(fast_acquire=True)
    except TypeError:       # older anyio
        return anyio.Lock()


def _object_call(op: str, group: str, seq: int, detail: str) -> CollectiveCall:
    return CollectiveCall(op, group, seq, detail=detail)


def _pick_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK, or the named device. With fewer GPUs than local ranks, ranks share
    them round-robin (the model runner's rule, ``engine._runner.resolve_device``): NCCL
    refuses two ranks on one GPU, so only a group without device collectives (no LM-head
    TP; the host exchange through shared memory or gloo) runs so, e.g. ``bench/adp_run.py``
    measuring the exchange on a one-GPU machine."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return dev


def _translate(exc: RuntimeError, call: CollectiveCall) -> RuntimeError:
    """Backend errors that mean "a peer never came" become CollectiveTimeoutError."""
    text = str(exc).lower()
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "timed out" in text or "timeout" in text:
        return CollectiveTimeoutError(call, (), f"the backend timed out ({first})")
    if any(marker in text for marker in _PEER_LOST):
        return CollectiveTimeoutError(call, (), f"lost the connection to a peer, which probably died ({first})")
    return exc
