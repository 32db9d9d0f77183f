"""Real processes over gloo, launched by torchrun (marked ``distributed``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specloop.models.testing import write_tiny_checkpoint

from .conftest import write_gloo_config

# Two launches for the three gloo cases (one rank, two ranks; each bounded at 280 s, both in
# the first case's 600) and one for the CLI.
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("adp_worker.py")


def launch(n, *args, timeout=240):
    """``args`` under torchrun on ``n`` ranks; one rank as a plain process: without
    WORLD_SIZE, adp_run.py runs world 1 on the single communicator, what torchrun's one
    rank ran (same tokens), without the launcher's own torch import and agent (~2 s of CPU
    a run)."""
    env = {k: v for k, v in os.environ.items()
           if n > 1 or k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                 "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"] \
        if n > 1 else []
    return subprocess.run([sys.executable, *launcher, *map(str, args)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


# bench/adp_run.py's options per case: n-gram; MTP-EAGLE with rejection sampling and LM-head
# TP, collectives checked; the same with collectives issued on the loop and polled (gloo
# here). How collectives are issued (checked, inline) changes nothing on one rank: the
# last two share their one-rank reference.
CASES = {"ngram": "--method ngram",
         "checked": "--method mtp_eagle --rejection --lm-head-tp --checked",
         "inline": "--method mtp_eagle --rejection --lm-head-tp --inline-collectives"}
ONE_RANK = {"ngram": "--method ngram", "checked": CASES["checked"].replace(" --checked", "")}
ONE_RANK["inline"] = ONE_RANK["checked"]


def run_all(n, runs, out_dir):
    """Every run of ``runs`` (name -> adp_run options) in one launch on ``n`` ranks
    (tests/engine/adp_worker.py: a launch's torch imports and torchrun agent, not a run,
    were most of a case's time) -> name -> the outputs rank 0 wrote."""
    names = list(runs)
    out_dir.mkdir()
    proc = launch(n, WORKER, out_dir, *(runs[name] for name in names), timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Every rank of every run reported its SYNC cost.
    assert proc.stdout.count("SYNC median") == n * len(names), proc.stdout[-3000:]
    return {name: json.loads((out_dir / f"run{i}.json").read_text())["outputs"]
            for i, name in enumerate(names)}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    distinct = {opts: opts for opts in ONE_RANK.values()}      # two runs for three cases
    got = run_all(1, distinct, tmp_path_factory.mktemp("one") / "out")
    return {case: got[opts] for case, opts in ONE_RANK.items()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_all(2, CASES, tmp_path_factory.mktemp("two") / "out")


@pytest.mark.parametrize("case", list(CASES))
def test_two_gloo_ranks_equal_one_rank(case, one_rank, two_ranks):
    # What `bench/adp_run.py --compare` checks (every greedy and seeded sampled request's
    # tokens identical), read here rather than in another process that imports torch.
    one, two = one_rank[case], two_ranks[case]
    assert len(one) == 18 and all(one), one
    assert two == one


def test_cli_under_torchrun(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "tiny", vocab_size=384)
    config = write_gloo_config(tmp_path / "adp2.toml", model)
    proc = launch(2, "-m", "specloop.engine.cli", "generate", "--config", config,
                    "--prompt", "hello", "--prompt", "world", "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("--- prompt") == 2
    assert "[specloop] new tokens 16" in proc.stdout
