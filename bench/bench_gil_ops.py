"""What a small op costs on one thread while another thread runs small torch ops, as the
loop thread's exchange does beside a rank's compute thread under ADP: a torch op
releases the GIL and must take it back; numpy's small copies and buffer slicing keep it
(docs/performance-history.md, "The exchange on one shared H200").

    python bench/bench_gil_ops.py [--calls 20000]

Prints µs a call idle and with the busy thread, for each op.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from array import array

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BusyTorchThread  # noqa: E402


def ops() -> dict:
    row = array("q", range(400))
    src, dst = torch.ones(400, dtype=torch.int64), torch.zeros(400, dtype=torch.int64)
    table = torch.zeros(2, 400, dtype=torch.int64)
    shared = mmap.mmap(-1, 8 * 800)
    view = memoryview(shared)
    as_bytes = memoryview(row).cast("B")
    return {
        "torch copy_ (400 int64)": lambda: dst.copy_(src),
        "torch clone": lambda: src.clone(),
        "torch slice + tolist ([2, 10])": lambda: table[:, :10].tolist(),
        "torch.frombuffer": lambda: torch.frombuffer(row, dtype=torch.int64),
        "Tensor.numpy": lambda: src.numpy(),
        "numpy slice + tolist ([2, 10])": lambda: table.numpy()[:, :10].tolist(),
        "map slice assignment (3,200 bytes)": lambda: view.__setitem__(slice(0, 3200), as_bytes),
        "map read into numpy": lambda: np.frombuffer(bytearray(view[0:6400]), dtype=np.int64),
    }


def timed(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    table = ops()
    idle = {name: timed(fn, args.calls) for name, fn in table.items()}
    busy = BusyTorchThread()
    time.sleep(0.1)
    try:
        for name, fn in table.items():
            print(f"{name:38s} idle {idle[name]:6.2f} µs, busy thread beside "
                  f"{timed(fn, max(args.calls // 10, 100)):6.2f} µs", flush=True)
    finally:
        busy.stop()


if __name__ == "__main__":
    main()
