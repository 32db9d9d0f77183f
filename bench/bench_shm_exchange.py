"""Host cost per call of ADP's shared-memory exchange (``comm.shared_memory``), in ONE
process, so two ranks polling do not compete for a small box's cores: this rank's side
of the real code path, with the peer's side (a second ``SharedGather`` on the same file,
driven from the same process) posted before or during each call.

    python bench/bench_shm_exchange.py [--calls 2000] [--runs 3] [--slots 64] [--k 0]
        [--busy] [--two-process]

What it times, per call (median / min µs over ``--calls`` calls, per run):
- ``gather``: ``TorchDistributedCommunicator.all_gather`` of SCHEDULE's header, the peer's
  row already posted (this rank arrives last: post, see it complete, read the rows);
- ``exchange``: ``OutputExchange`` (rank 1, no outputs, no flag) around it, as the engine
  calls it once per iteration, and its own ``collective`` figure (arrival stamp -> done,
  ``ExchangeTimes``; the figure docs/performance.md reports on the GPUs), peer arrived first;
- ``notice``: this rank posted first and polls; a task on the same (otherwise idle)
  event loop posts the peer's row: peer's post -> this rank's call returned;
- ``objects``: the flagged exchange's ``all_gather_object`` (rank 1's empty report out,
  rank 0's message in), the peer's lengths and pickle posted first.

``--busy`` runs a second thread of small torch ops meanwhile, as the compute thread
queueing the step run ahead does under ADP: each torch op of the exchange releases the
GIL and must take it back from that thread.

``--two-process`` instead runs the gather in lock step between this process (core 0) and
a child (core 1), both polling: per call, what each rank's ``all_gather`` took (its own
path plus noticing the other's post across cores). On a box whose 2 cores also run other
work, the median says more than the mean.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import anyio
import torch
import torch.distributed as dist

from specloop.comm import _shm
from specloop.comm._torch_dist import TorchDistributedCommunicator, _Family
from specloop.engine._exchange import OutputExchange
from specloop.engine._wire import block_width

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BusyTorchThread  # noqa: E402

ME, PEER, WORLD = 1, 0, 2


def _one_process_world() -> None:
    """A world of 1 (the communicator reads its global rank from torch.distributed);
    the bench never issues a gloo collective: the shared-memory gather is set up here."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _communicator(nbytes: int, path: str | None = None, rank: int = ME
                  ) -> tuple[TorchDistributedCommunicator, _shm.SharedGather | None]:
    """This process's communicator as ``rank`` of WORLD, its shared-memory gather of
    ``nbytes`` set up on ``path`` (a new file, and the peer's side here, without it)."""
    _one_process_world()
    family = _Family(torch.device("cpu"), datetime.timedelta(seconds=60), owns_world=False)
    # This process's global rank (0) at index ``rank``: a group of WORLD.
    ranks = (0, 1) if rank == 0 else (1, 0)
    comm = TorchDistributedCommunicator(family=family, group=dist.group.WORLD,
                                        object_group=dist.group.WORLD, ranks=ranks)
    comm.shared_memory = True
    if path is not None:
        comm._shared[nbytes] = _shm.SharedGather(path, rank, WORLD, nbytes)
        return comm, None
    return comm, _add_size(comm, nbytes)


def _add_size(comm: TorchDistributedCommunicator, nbytes: int) -> _shm.SharedGather:
    """Set up ``comm``'s shared-memory gather of ``nbytes``; -> the peer's side of it."""
    path = _shm.create_file(WORLD, nbytes)
    try:
        comm._shared[nbytes] = _shm.SharedGather(path, comm.rank, WORLD, nbytes)
        return _shm.SharedGather(path, 1 - comm.rank, WORLD, nbytes)
    finally:
        os.unlink(path)


def _stats(samples_ns: list[int]) -> str:
    us = [s / 1000 for s in samples_ns]
    return f"median {statistics.median(us):6.1f} µs, min {min(us):6.1f}"


async def bench_gather(header: torch.Tensor, calls: int) -> str:
    comm, peer = _communicator(header.numel() * header.element_size())
    peer_row = header.clone()
    times = []
    for i in range(calls + 100):
        peer_row[0] = i
        peer.post(_shm.tensor_bytes(peer_row))
        start = time.perf_counter_ns()
        got = await comm.all_gather(header)
        times.append(time.perf_counter_ns() - start)
        assert int(got[PEER, 0]) == i and torch.equal(got[ME], header)
    comm.close()
    peer.close()
    return _stats(times[100:])


def _exchange(comm: TorchDistributedCommunicator, slots: int, k: int) -> OutputExchange:
    config = SimpleNamespace(speculative=SimpleNamespace(k=k),
                             scheduler=SimpleNamespace(idle_wait_s=0.1))
    scheduler = SimpleNamespace(num_requests=1, slots=SimpleNamespace(num_slots=slots))
    return OutputExchange(config=config, comm=comm, front=None, scheduler=scheduler)


async def bench_exchange(slots: int, k: int, calls: int) -> str:
    facts = (64, 64, 64, 1)
    numel = 2 + len(facts) + slots * block_width(k)
    comm, peer = _communicator(8 * numel)
    exchange = _exchange(comm, slots, k)
    peer_row = torch.zeros(numel, dtype=torch.int64)
    width = 2 + len(facts)
    times = []
    for i in range(calls + 100):
        peer_row[1] = i
        peer_row[width - 1] = time.time_ns() // 1000
        peer.post(_shm.tensor_bytes(peer_row))
        start = time.perf_counter_ns()
        await exchange(facts)
        times.append(time.perf_counter_ns() - start)
        assert exchange.gathered_rows[PEER][0] == i
    collective = [c * 1000 for _, c in list(exchange.times.recent)[-calls:]]
    comm.close()
    peer.close()
    return f"{_stats(times[100:])}; its collective figure {_stats(collective)}"


async def bench_objects(calls: int) -> str:
    """SCHEDULE's flagged exchange as rank 1 sees it: its (empty) report out, rank 0's
    message (here four cancels) in, as ``all_gather_object`` through shared memory."""
    import pickle

    from specloop.engine._frontdoor import FrontDoorMessage, RankReport
    message, report = FrontDoorMessage(cancels=tuple(f"req-{i}" for i in range(4))), RankReport(())
    data = pickle.dumps(message)
    cap = max(256, 1 << (max(len(data), len(pickle.dumps(report))) - 1).bit_length())
    comm, lengths = _communicator(8)
    pickles = _add_size(comm, cap)
    times = []
    for _ in range(calls + 100):
        lengths.post(len(data).to_bytes(8, "little"))
        pickles.post(data + bytes(cap - len(data)))
        start = time.perf_counter_ns()
        got = await comm.all_gather_object(report)
        times.append(time.perf_counter_ns() - start)
        assert got == [message, report]
    comm.close()
    return _stats(times[100:])


async def bench_notice(header: torch.Tensor, calls: int) -> str:
    comm, peer = _communicator(header.numel() * header.element_size())
    times = []
    for _ in range(calls + 100):
        posted = [0]

        async def late_peer() -> None:
            await anyio.sleep(0)       # the waiting rank has posted and polls
            await anyio.sleep(0)
            peer.post(_shm.tensor_bytes(header))
            posted[0] = time.perf_counter_ns()

        async with anyio.create_task_group() as tg:
            tg.start_soon(late_peer)
            await comm.all_gather(header)
            times.append(time.perf_counter_ns() - posted[0])
    comm.close()
    peer.close()
    return _stats(times[100:])


async def lock_step(header: torch.Tensor, calls: int, path: str, rank: int) -> str:
    comm, _ = _communicator(header.numel() * header.element_size(), path, rank)
    times = []
    for i in range(calls + 100):
        header[0] = i
        start = time.perf_counter_ns()
        got = await comm.all_gather(header)
        times.append(time.perf_counter_ns() - start)
        assert got[:, 0].tolist() == [i, i]
    comm.close()
    return _stats(times[100:])


async def two_process(args: argparse.Namespace, header: torch.Tensor) -> None:
    nbytes = header.numel() * header.element_size()
    for run in range(args.runs):
        path = _shm.create_file(WORLD, nbytes)
        try:
            child = subprocess.Popen([sys.executable, __file__, "--peer", path,
                                      "--calls", str(args.calls), "--slots", str(args.slots),
                                      "--k", str(args.k)], stdout=subprocess.PIPE, text=True)
            os.sched_setaffinity(0, {0})
            mine = await lock_step(header, args.calls, path, 0)
            theirs = child.communicate(timeout=60)[0].strip()
        finally:
            os.unlink(path)
        print(f"run {run + 1}: two processes, rank 0 {mine}; rank 1 {theirs}", flush=True)


async def main(args: argparse.Namespace) -> None:
    numel = 2 + 4 + args.slots * block_width(args.k)
    header = torch.arange(numel, dtype=torch.int64)
    if args.peer:
        os.sched_setaffinity(0, {1})
        print(await lock_step(header, args.calls, args.peer, 1), flush=True)
        return
    if args.two_process:
        await two_process(args, header)
        return
    print(f"SCHEDULE header: {numel} int64 ({8 * numel} bytes), {args.calls} calls per run"
          + (", a busy torch thread beside" if args.busy else ""), flush=True)
    busy = BusyTorchThread() if args.busy else None
    try:
        await _runs(args, header)
    finally:
        if busy is not None:
            busy.stop()


async def _runs(args: argparse.Namespace, header: torch.Tensor) -> None:
    for run in range(args.runs):
        print(f"run {run + 1}: gather   {await bench_gather(header, args.calls)}", flush=True)
        print(f"run {run + 1}: exchange {await bench_exchange(args.slots, args.k, args.calls)}",
              flush=True)
        print(f"run {run + 1}: notice   {await bench_notice(header, args.calls)}", flush=True)
        print(f"run {run + 1}: objects  {await bench_objects(args.calls)}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--slots", type=int, default=64, help="max_batch_size: the block's rows")
    ap.add_argument("--k", type=int, default=0, help="speculative.k: the block's width - 5")
    ap.add_argument("--busy", action="store_true",
                    help="a thread of small torch ops beside (the compute thread under ADP)")
    ap.add_argument("--two-process", action="store_true",
                    help="lock step with a child process, one per core (see above)")
    ap.add_argument("--peer", help=argparse.SUPPRESS)   # the child of --two-process
    torch.set_num_threads(1)
    anyio.run(main, ap.parse_args())
