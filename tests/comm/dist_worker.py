"""One rank of the real multi-process tests; started by test_torch_dist.py.

Prints one JSON line (`RESULT {...}`) with what each scenario observed.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import anyio
import torch

from specloop.comm import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    TorchDistributedCommunicator,
    distributed_argmax,
)


async def ops(comm: TorchDistributedCommunicator) -> dict:
    r = comm.rank
    if comm.device.type == "cuda":
        torch.set_default_device(comm.device)
    out = {
        "rank": r,
        "world_size": comm.world_size,
        "all_gather": (await comm.all_gather(torch.tensor([r, 10 * r]))).tolist(),
        "all_gather_2d_shape": list((await comm.all_gather(torch.full((2, 3), float(r)))).shape),
        "sum": (await comm.all_reduce(torch.tensor([1.0, r]))).tolist(),
        "max": (await comm.all_reduce(torch.tensor([r, -r]), op="max")).tolist(),
        "min": (await comm.all_reduce(torch.tensor([r, -r]), op="min")).tolist(),
        "objects": await comm.all_gather_object({"rank": r}),
        "bytes": [b.hex() for b in await comm.all_gather_bytes(bytes([r, 7, r]))],
        "broadcast": await comm.broadcast_object(f"from {r}", src=1),
    }
    await comm.barrier()
    sub = await comm.subgroup([1, 0], "adp")
    out["sub_rank"] = sub.rank
    out["sub_gather"] = (await sub.all_gather(torch.tensor([r]))).tolist()
    # V = 11 over 2 ranks: S = 6, rank 1 holds 5 real columns and 1 padding column.
    full = torch.arange(2 * 11, dtype=torch.float32).reshape(2, 11) % 7
    shard = torch.cat([full, torch.full((2, 1), 99.0)], dim=1)[:, 6 * r: 6 * (r + 1)]
    out["argmax"] = (await distributed_argmax(sub, shard, vocab_size=11)).tolist()
    out["argmax_expected"] = torch.argmax(full, dim=1).tolist()
    return out


async def mismatches(comm: TorchDistributedCommunicator) -> dict:
    r = comm.rank
    cases = {
        "shape": lambda: comm.all_gather(torch.zeros(3 + r)),
        "dtype": lambda: comm.all_gather(torch.zeros(3, dtype=torch.float32 if r == 0 else torch.int64)),
        "op": lambda: comm.all_gather(torch.zeros(3)) if r == 0 else comm.all_reduce(torch.zeros(3)),
    }
    out = {}
    for name, make in cases.items():
        start = time.perf_counter()
        try:
            await make()
            out[name] = None
        except CollectiveMismatchError as exc:
            out[name] = {"message": str(exc), "elapsed": time.perf_counter() - start}
    # The exchange kept ranks in step: a symmetric collective still works.
    out["after"] = (await comm.all_reduce(torch.tensor([1]))).tolist()
    return out


# Rank 1 skips a collective and must stay alive until rank 0 has timed out in it (else rank
# 0 would see a closed peer, not a timeout). test_torch_dist.py names a folder in
# SPECLOOP_TEST_SIGNAL_DIR where rank 0 drops a file once it has its result: rank 1 waits
# for that file (at most 60 s) instead of a fixed 6 s, twice rank 0's 3 s timeout, which
# cost ~3 s idle per scenario. Without the variable (a hand run): the fixed 6 s.
async def stay_until_rank0_done(name: str) -> None:
    folder = os.environ.get("SPECLOOP_TEST_SIGNAL_DIR")
    if not folder:
        await anyio.sleep(6)
        return
    with anyio.fail_after(60):
        while not (Path(folder) / name).exists():
            await anyio.sleep(0.05)


def rank0_done(name: str) -> None:
    folder = os.environ.get("SPECLOOP_TEST_SIGNAL_DIR")
    if folder:
        (Path(folder) / name).touch()


async def timeout(comm: TorchDistributedCommunicator) -> dict:
    if comm.rank == 1:
        await stay_until_rank0_done("timeout")  # skip the barrier, alive past rank 0's timeout
        return {"skipped": True}
    start = time.perf_counter()
    try:
        await comm.barrier()
        return {"error": None}
    except CollectiveTimeoutError as exc:
        return {"error": str(exc), "elapsed": time.perf_counter() - start}
    finally:
        rank0_done("timeout")


async def inline_timeout(comm: TorchDistributedCommunicator) -> dict:
    """A tensor collective issued inline (not in a thread) that rank 1 never enters."""
    if comm.rank == 1:
        await stay_until_rank0_done("inline_timeout")
        return {"skipped": True}
    start = time.perf_counter()
    try:
        await comm.all_gather(torch.zeros(3))
        return {"error": None}
    except CollectiveTimeoutError as exc:
        return {"error": str(exc), "elapsed": time.perf_counter() - start}
    finally:
        rank0_done("inline_timeout")


async def shared_memory(comm: TorchDistributedCommunicator) -> dict:
    """Host all-gathers through shared memory: 300 in a row, each row's content new
    (both buffers reused many times over), checked against what every rank sent; then
    rank 1 skips one: rank 0 times out instead of hanging."""
    wrong = 0
    for i in range(300):
        mine = torch.arange(5, dtype=torch.int64) * (i + 1) + 1000 * comm.rank
        got = await comm.all_gather(mine)
        want = torch.stack([torch.arange(5) * (i + 1) + 1000 * r for r in range(2)])
        wrong += not torch.equal(got, want)
    half = await comm.all_gather(torch.full((4,), comm.rank + 0.5, dtype=torch.bfloat16))
    wrong += not torch.equal(half, torch.tensor([[0.5] * 4, [1.5] * 4], dtype=torch.bfloat16))
    # Sizes and dtypes in turn (an empty tensor, a SCHEDULE-sized header, NaN and -0.0
    # bits), each call's rows new: bit-exact, in rank order.
    for i in range(30):
        shape, dtype = [((0,), torch.float32), ((326,), torch.int64), ((3, 2), torch.float64)][i % 3]
        rows = [torch.arange(i, i + torch.Size(shape).numel()).reshape(shape).to(dtype) * (r + 1)
                for r in range(2)]
        if dtype == torch.float64:
            for row in rows:
                row[0, 0], row[1, 1] = float("nan"), -0.0
        got = await comm.all_gather(rows[comm.rank])
        want = torch.stack(rows)
        wrong += not torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # Objects through shared memory: pickles of a few sizes (one rank's far longer), and
    # one past _OBJECT_MAX, which both ranks send over gloo instead.
    cases = [None, ("x" * 5000 if comm.rank else "y", comm.rank),
             {"rank": comm.rank, "tokens": list(range(300 * comm.rank))},
             b"\0\1" * (comm.rank * (1 << 20)) or comm.rank]
    for case in cases:
        got = await comm.all_gather_object(case)
        # What each rank sent, rebuilt here (rank r's case for this index).
        want = [[None, ("x" * 5000 if r else "y", r), {"rank": r, "tokens": list(range(300 * r))},
                 b"\0\1" * (r * (1 << 20)) or r][cases.index(case)] for r in range(2)]
        wrong += got != want
    out = {"wrong": wrong, "sizes": sorted(k for k, v in comm._shared.items() if v)}
    if comm.rank == 1:
        await stay_until_rank0_done("shared_memory")
        return out
    start = time.perf_counter()
    try:
        await comm.all_gather(torch.zeros(5, dtype=torch.int64))
        out["error"] = None
    except CollectiveTimeoutError as exc:
        out.update(error=str(exc), elapsed=time.perf_counter() - start)
    finally:
        rank0_done("shared_memory")
    return out


async def latency(comm: TorchDistributedCommunicator, iters: int = 200) -> dict:
    """Mean microseconds per call of a SYNC-sized all_gather ([3] int64) and an object gather."""
    out = {}
    for name, call in {"all_gather_3xi64": lambda: comm.all_gather(torch.zeros(3, dtype=torch.int64)),
                       "all_gather_object": lambda: comm.all_gather_object((1, 2, True))}.items():
        for _ in range(10):
            await call()
        start = time.perf_counter()
        for _ in range(iters):
            await call()
        out[name] = round((time.perf_counter() - start) / iters * 1e6, 1)
    return out


async def run(flags: list[str]) -> dict:
    """One launch's worth (what its flags ask) on a process group of its own."""
    checked = "--checked" in flags
    device = "cuda" if "--cuda" in flags else "cpu"
    comm = TorchDistributedCommunicator.from_env(device=device, checked=checked, timeout=3.0)
    result = {}
    if "--inline" in flags:
        # First the default path (unchecked, from a thread): the plain run, in this launch
        # rather than a fourth pair of processes importing torch.
        result["ops_plain"] = await ops(comm)
        comm.inline = True      # gloo: issued on the loop and polled, as NCCL by default
    comm.shared_memory = "--shm" in flags
    result.update({"ops": await ops(comm), "inline": comm.inline})
    if "--latency" in flags:
        result["latency_us"] = await latency(comm)
    if checked:
        result["mismatches"] = await mismatches(comm)
    if checked and comm.device.type == "cpu":  # NCCL's watchdog aborts instead
        result["timeout"] = await timeout(comm)
    if "--inline" in flags and comm.device.type == "cpu":
        result["timeout"] = await inline_timeout(comm)
    if comm.shared_memory:
        result["shared_memory"] = await shared_memory(comm)
    print("RESULT " + json.dumps(result), flush=True)
    comm.close()
    return result


async def main() -> None:
    """``--checked --then --inline --then --shm``: the runs in turn, a RESULT line each.
    Each run leaves its group broken on purpose (a collective that timed out): the next
    joins a new one, from_env again after close(), on the next port of
    SPECLOOP_TEST_PORTS (a fresh store: one reused after destroy_process_group can hand
    out the old group's keys). One process for several runs: each process's torch import
    (~2.5 s of CPU) costs more than a run."""
    runs: list[list[str]] = [[]]
    for arg in sys.argv[1:]:
        if arg == "--then":
            runs.append([])
        else:
            runs[-1].append(arg)
    ports = os.environ.get("SPECLOOP_TEST_PORTS", "").split(",")
    for i, flags in enumerate(runs):
        if i:
            os.environ["MASTER_PORT"] = ports[i - 1]
        await run(flags)


if __name__ == "__main__":
    anyio.run(main)
