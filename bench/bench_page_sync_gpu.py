"""Host time of ``PageTable.sync`` on a GPU: the shipped path (the changed entries
written into a pinned buffer of a staging ring, one copy, one ``index_copy_``) against
the fifteenth session's (a fresh pageable buffer pinned a call, advanced-index scatter)
and the fourteenth's (the changed rows: an index tensor, a gather, two copies). ``--rows``
rows cross a page a call (1: as at batch 8 with eagle3; 8: a larger batch), with matmuls
queued now and then so the copies queue behind GPU work as in the engine. Each round
checks that the device table equals the host's afterwards.

    python bench/bench_page_sync_gpu.py [--calls 2000] [--rounds 3] [--rows 1,8]

Fifteenth session, one H200: medians 59-76 us a call (pinned a call) against 72-74
(rows) (docs/performance-history.md, "qkv's prefix to 4 rows, the LM head's tail, the
curve").
"""

from __future__ import annotations

import argparse
import array
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


class PinnedSync(PageTable):
    """The fifteenth session's sync: a fresh buffer pinned a call, advanced indexing."""

    def sync(self) -> None:
        dirty = self._dirty
        if not dirty:
            return
        n = len(dirty)
        packed = torch.frombuffer(array.array("i", [*dirty, *dirty.values()]),
                                  dtype=torch.int32)
        dirty.clear()
        packed = to_device(packed, self.table.device)
        self.table.view(-1)[packed[:n]] = packed[n:]


def median_us(cls: type[PageTable], calls: int, rows: int = 1) -> float:
    table = cls(256, 4096, 16, device="cuda")
    lengths = [1] * 256
    x = torch.randn(4096, 4096, device="cuda")
    times = []
    for i in range(calls):
        if i % 200 == 0:
            for _ in range(20):
                x = x @ x / 64      # ~3 ms of queued work
        for j in range(rows):
            slot = (i * rows + j) % 256
            lengths[slot] = lengths[slot] % 4000 + table.page_size
            table.resize(slot, lengths[slot])
        start = time.perf_counter()
        table.sync()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    if not torch.equal(table.table, table.host.to("cuda")):
        raise AssertionError(f"{cls.__name__}: the device table differs from the host's")
    return statistics.median(times) * 1e6


def copy_us(calls: int, ring: bool) -> float:
    """A [4, 32] int64 input's copy to the GPU: ``to_device`` (pinned a call, as the
    engine's other per-iteration inputs) or through a ``StagingRing``."""
    from specloop.models._host import StagingRing, int64_tensor  # noqa: PLC0415
    staging = StagingRing(torch.device("cuda"), torch.int64)
    values = list(range(128))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        if ring:
            host, i = staging.take(128)
            host[:128] = values
            out = staging.copy(i, 128).view(4, 32)
        else:
            out = to_device(int64_tensor(values), "cuda").view(4, 32)
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    assert out.sum().item() == sum(values)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default="1,8", help="rows crossing a page a call")
    args = ap.parse_args()
    for rows in map(int, args.rows.split(",")):
        for _ in range(args.rounds):
            print(f"{rows} rows a call: " + "; ".join(
                f"{cls.__name__} median {median_us(cls, args.calls, rows):.1f} us"
                for cls in (RowsSync, PinnedSync, PageTable)))
    for _ in range(args.rounds):
        print(f"[4, 32] int64 input: to_device median {copy_us(args.calls, False):.1f} us, "
              f"staging ring {copy_us(args.calls, True):.1f} us")


if __name__ == "__main__":
    main()
