"""Several bench/adp_run.py runs, one after the other, in the processes of one torchrun
launch; started by test_distributed.py.

    adp_worker.py OUT_DIR RUN ...

A RUN is adp_run.py's options (``--tiny --requests 18`` and ``--out OUT_DIR/run{i}.json``
added): every rank of the launch runs it; or "world=1 OPTIONS": rank 0 alone runs it on
one rank (adp_run's world 1, the single communicator: what a plain one-rank process runs),
after the group's runs. Each process's torch import (and torchrun's agent) costs ~2.5 s
of CPU, more than a run: so one launch runs every configuration and its reference.
"""

import datetime
import os
import shlex
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import adp_run  # noqa: E402

ONE_RANK = "world=1 "


def run(i: int, options: str, out_dir: str) -> None:
    sys.argv = ["adp_run.py", "--tiny", "--requests", "18", *shlex.split(options),
                "--out", str(Path(out_dir) / f"run{i}.json")]
    adp_run.main()
    print(f"[adp_worker] run {i} done", flush=True)


def main() -> None:
    out_dir, *runs = sys.argv[1:]
    # One process group for every run of the group. A second init_process_group on
    # torchrun's store can read the first group's keys (a peer's old address: gloo fails
    # to connect), so the group is made here, once; each engine's
    # TorchDistributedCommunicator.from_env joins it (it is initialized) and leaves it up
    # when the engine closes. The timeout is parallel.collective_timeout_s's default, what
    # from_env would have given it.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    for i, options in enumerate(runs):
        if not options.startswith(ONE_RANK):
            run(i, options, out_dir)
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank == 0:
        os.environ["WORLD_SIZE"] = "1"          # adp_run's world
        for i, options in enumerate(runs):
            if options.startswith(ONE_RANK):
                run(i, options.removeprefix(ONE_RANK), out_dir)


if __name__ == "__main__":
    main()
    # Leave without the interpreter's finalization: gloo's threads can still hold the last
    # collectives' work objects, whose tensors, freed at teardown, take the GIL of a dying
    # interpreter: "terminate called without an active exception" (SIGABRT; once, rank 1
    # after destroy_process_group, in a loaded full run). Every run's output is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
