"""Host time of the single torch and CUDA calls an engine iteration is made of, on a GPU:
what a chained step's queueing, RESCAN's read-back and the page table's sync pay per call
on the lent machine's host (whose Python runs ~2-3x slower than this repository's CPU),
so host-time work knows which calls to remove. Each call is timed alone, ``--calls`` times
with GPU work queued ahead (as in the engine: the step queued ahead), median µs a call.
A CUDA graph's launch is bench_graph_launch_gpu.py's: timed here, 100 launches of a
200-kernel graph in a row filled the launch queue, and the median was the GPU's time
for the graph (~1.1 µs a kernel), not the host's (~2.5 µs a launch whatever its kernels).

    python bench/bench_host_ops_gpu.py [--calls 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import array
import statistics
import time
from typing import Callable

import numpy
import torch

from specloop.models._host import current_stream


def timed(fn: Callable[[], object], calls: int, work: Callable[[], None],
          every: int = 100) -> float:
    """Median µs of a call of ``fn``, each call timed alone; every ``every`` calls the GPU
    is drained and ``work`` (~1 ms) queued ahead, so the launch queue holds little: the
    host's time, not the GPU's (bench_graph_launch_gpu.py)."""
    times = []
    for i in range(calls):
        if i % every == 0:
            torch.cuda.synchronize()
            work()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def cases() -> dict[str, Callable[[], object]]:
    dev = torch.device("cuda")
    small = torch.arange(128, dtype=torch.int64).view(4, 32)
    values = list(range(128))
    on_dev = torch.zeros(4, 32, dtype=torch.int64, device=dev)
    packed = torch.zeros(32, 5, dtype=torch.int64, device=dev)
    pinned = torch.empty(128, dtype=torch.int64, pin_memory=True)
    pinned_np = pinned.numpy()
    table = torch.zeros(257 * 256, dtype=torch.int32, device=dev)
    index = torch.tensor([5, 900, 4000], dtype=torch.int64, device=dev)
    pages = torch.tensor([1, 2, 3], dtype=torch.int32, device=dev)
    event = torch.cuda.Event()
    event.record()
    events = [torch.cuda.Event() for _ in range(4)]
    rows = torch.arange(32, device=dev)
    hidden = torch.zeros(32, 4, 576, dtype=torch.bfloat16, device=dev)
    return {
        "int64_tensor(list of 128)": lambda: torch.frombuffer(array.array("q", values),
                                                              dtype=torch.int64),
        "torch.tensor(list of 128)": lambda: torch.tensor(values),
        "pin_memory() [4,32]": lambda: small.pin_memory(),
        "to_device [4,32] (pin + .to)": lambda: small.pin_memory().to(dev, non_blocking=True),
        "numpy write into pinned (128 ints)": lambda: pinned_np.__setitem__(
            slice(0, 128), values),
        "numpy fromiter 128": lambda: numpy.fromiter(values, numpy.int64, 128),
        "copy_ pinned -> device [128]": lambda: on_dev.view(-1).copy_(pinned,
                                                                      non_blocking=True),
        "empty pinned + copy_ device -> host [32,5]": lambda: torch.empty(
            (32, 5), dtype=torch.int64, pin_memory=True).copy_(packed, non_blocking=True),
        "copy_ device -> preallocated pinned [32,5]": lambda: pinned.view(32, 4).copy_(
            packed[:, :4], non_blocking=True),
        "torch.cuda.Event()": lambda: torch.cuda.Event(),
        "event.record()": lambda: event.record(),
        "event.query() (done)": lambda: event.query(),
        "event.synchronize() (done)": lambda: events[0].synchronize(),
        "table[index] = pages (index_put)": lambda: table.__setitem__(index, pages),
        "table.index_copy_(0, index, pages)": lambda: table.index_copy_(0, index, pages),
        "tensor slice t[:n]": lambda: table[:100],
        "tensor .view(dtype)": lambda: table[:100].view(torch.int64),
        "index_select rows [32,4,576]": lambda: hidden.index_select(0, rows),
        "torch.cat two [32,2] int64": lambda: torch.cat([packed[:, :2], packed[:, 2:4]],
                                                        dim=1),
        "x.new_zeros(32, 2)": lambda: packed.new_zeros(32, 2),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "models._host.current_stream(0)": lambda: current_stream(0),
        "event.record(current_stream(0))": lambda: event.record(current_stream(0)),
        ".tolist() of a host [32,5]": lambda: small.tolist(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    big = torch.randn(4096, 4096, device="cuda")

    def work() -> None:
        for _ in range(4):
            torch.mm(big, big)      # ~1 ms queued ahead

    found: dict[str, list[float]] = {}
    with torch.inference_mode():
        all_cases = cases()
        for _ in range(args.rounds):
            for name, fn in all_cases.items():
                found.setdefault(name, []).append(round(timed(fn, args.calls, work), 1))
    width = max(map(len, found))
    for name, us in found.items():
        print(f"{name:{width}s}  {min(us):6.1f}-{max(us):6.1f} us a call (median; rounds)")


if __name__ == "__main__":
    main()
