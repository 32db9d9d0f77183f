"""Several bench/adp_run.py runs, one after the other, in one process: one rank of a
torchrun launch, or a plain one-rank process; started by test_distributed.py.

    adp_worker.py OUT_DIR "OPTIONS 0" "OPTIONS 1" ...

Run i is ``adp_run.py --tiny --requests 18 OPTIONS i --out OUT_DIR/run{i}.json``. Each
launch costs every process a torch import (and torchrun its agent): ~2.5 s of CPU a
process, more than a run itself; so a launch runs every configuration.
"""

import datetime
import os
import shlex
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import adp_run  # noqa: E402


def main() -> None:
    out_dir, *runs = sys.argv[1:]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        # One process group for every run. A second init_process_group on torchrun's store
        # can read the first group's keys (a peer's old address: gloo fails to connect), so
        # the group is made here, once; each engine's TorchDistributedCommunicator.from_env
        # joins it (it is initialized) and leaves it up when the engine closes. The timeout
        # is parallel.collective_timeout_s's default, what from_env would have given it.
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    for i, options in enumerate(runs):
        sys.argv = ["adp_run.py", "--tiny", "--requests", "18", *shlex.split(options),
                    "--out", str(Path(out_dir) / f"run{i}.json")]
        adp_run.main()
        print(f"[adp_worker] run {i} done", flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
