"""Host time of ``PageTable.sync`` on a GPU: the shipped path (the changed entries in one
packed host buffer, one copy, one scatter) against the fourteenth session's (the changed
rows: an index tensor, a gather, two copies), one row crossing a page a call, as at batch 8
with eagle3, with matmuls queued now and then so the copies queue behind GPU work as in
the engine. Each round checks that the device table equals the host's afterwards.

    python bench/bench_page_sync_gpu.py [--calls 2000] [--rounds 3]

Fifteenth session, one H200: medians 59-76 us a call against 72-74 (docs/
performance-history.md, "qkv's prefix to 4 rows, the LM head's tail, the curve").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specloop.models import PageTable
from specloop.models._host import to_device


class RowsSync(PageTable):
    """The fourteenth session's sync: whole changed rows."""

    def sync(self) -> None:
        dirty = self._dirty
        if not dirty:
            return
        rows = torch.tensor(sorted({i // self.pages_per_slot for i in dirty}),
                            dtype=torch.int64)
        dirty.clear()
        dev = self.table.device
        self.table[to_device(rows, dev)] = to_device(self.host[rows], dev)


def median_us(cls: type[PageTable], calls: int) -> float:
    table = cls(256, 4096, 16, device="cuda")
    lengths = [1] * 256
    x = torch.randn(4096, 4096, device="cuda")
    times = []
    for i in range(calls):
        if i % 200 == 0:
            for _ in range(20):
                x = x @ x / 64      # ~3 ms of queued work
        slot = i % 256
        lengths[slot] += table.page_size
        table.resize(slot, lengths[slot])
        start = time.perf_counter()
        table.sync()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    if not torch.equal(table.table, table.host.to("cuda")):
        raise AssertionError(f"{cls.__name__}: the device table differs from the host's")
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for _ in range(args.rounds):
        for cls in (RowsSync, PageTable):
            print(f"{cls.__name__:10s} sync: median {median_us(cls, args.calls):.1f} us a call")


if __name__ == "__main__":
    main()
