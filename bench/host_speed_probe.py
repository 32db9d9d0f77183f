"""Does the host's speed vary between processes, and with what? A fixed host workload shaped
like the engine's per-iteration work (Python dict and list work, small torch calls on the
CPU and, with CUDA, small host-to-device copies and event records, with GPU work queued
behind them as a step queued ahead leaves it), timed in ``--procs``
fresh processes one after another, alternating ``OMP_NUM_THREADS`` unset and 1.

The H200 host's Python ran at two speeds between processes (up to 2x: batch 32 without
speculation iterated in 1.153 ms on 0.869 ms of GPU work in one process, 0.863 on 0.862
in another; docs/performance-history.md, "qkv's prefix to 4 rows, the LM head's tail, the
curve (fifteenth session)"). If this workload's per-process times split the same way, the
machine sets the pace (CPU placement, clocks, neighbours); if not, something of the
engine's does.

    python bench/host_speed_probe.py [--procs 8] [--reps 5]

Each child prints one JSON row: the CPU it ended on, the OMP setting, the median µs of
each part over ``--reps``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def child(reps: int) -> dict:
    import torch  # noqa: PLC0415 - timed after import, in the child only

    from _common import median_seconds, python_work  # noqa: PLC0415 - beside this script

    cuda = torch.cuda.is_available()
    if cuda:
        torch.zeros(1, device="cuda")   # the context, off the clock

    def torch_cpu() -> None:
        for _ in range(500):
            t = torch.frombuffer(bytearray(64), dtype=torch.int64)
            t[1:3].tolist()

    def torch_cuda() -> None:
        if not cuda:
            return
        dst = torch.empty(8, dtype=torch.int64, device="cuda")
        for _ in range(200):
            dst.copy_(torch.arange(8).pin_memory(), non_blocking=True)
            torch.cuda.Event().record()
        torch.cuda.synchronize()

    def busy_gpu() -> None:
        """~0.1-0.2 s of queued GPU work, as the engine keeps a step queued ahead."""
        if cuda:
            x = torch.randn(4096, 4096, device="cuda")
            for _ in range(200):
                x = x @ x / 64

    parts = {"python": python_work, "torch_cpu": torch_cpu, "torch_cuda": torch_cuda}
    out = {}
    for name, fn in parts.items():
        busy_gpu()
        out[name + "_us"] = round(median_seconds(fn, reps) * 1e6, 1)
    with open("/proc/self/stat") as f:
        cpu = int(f.read().rsplit(")", 1)[1].split()[36])
    return {"cpu": cpu, "omp": os.environ.get("OMP_NUM_THREADS", "unset"),
            "torch_threads": torch.get_num_threads(), **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.reps)), flush=True)
        return
    for i in range(args.procs):
        env = dict(os.environ)
        env.pop("OMP_NUM_THREADS", None)
        if i % 2:
            env["OMP_NUM_THREADS"] = "1"
        subprocess.run([sys.executable, __file__, "--child", "--reps", str(args.reps)],
                       env=env, check=True)


if __name__ == "__main__":
    main()
