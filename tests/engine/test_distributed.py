"""Real processes over gloo, launched by torchrun (marked ``distributed``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specloop.models.testing import write_tiny_checkpoint

from .conftest import write_gloo_config

# Two launches per test (one rank as a plain process, two under torchrun; the one-rank
# reference is shared where only how collectives are issued differs), each bounded at 240 s.
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


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


@pytest.fixture(scope="module")
def one_rank_runs() -> dict[tuple[str, ...], Path]:
    return {}


@pytest.mark.parametrize("extra", [[], ["--method", "mtp_eagle", "--rejection",
                                        "--lm-head-tp", "--checked"],
                                   # collectives issued on the loop and polled (gloo here)
                                   ["--method", "mtp_eagle", "--rejection", "--lm-head-tp",
                                    "--inline-collectives"]])
def test_two_gloo_ranks_equal_one_rank(tmp_path, extra, one_rank_runs):
    if not extra:
        extra = ["--method", "ngram"]
    # How collectives are issued (checked, inline) changes nothing on one rank: the
    # reference run is shared by the cases that differ only in that.
    key = tuple(a for a in extra if a not in ("--checked", "--inline-collectives"))
    outs = []
    for n in (1, 2):
        if n == 1 and key in one_rank_runs:
            outs.append(one_rank_runs[key])
            continue
        out = tmp_path / f"out{n}.json"
        cmd = ("bench/adp_run.py", "--tiny", "--requests", "18", "--out", out, *extra)
        proc = launch(n, *cmd)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "SYNC median" in proc.stdout
        outs.append(out)
        if n == 1:
            one_rank_runs[key] = out
    # What `bench/adp_run.py --compare` checks (every greedy and seeded sampled request's
    # tokens identical), read here rather than in a fourth process that imports torch.
    one, two = (json.loads(Path(out).read_text())["outputs"] for out in outs)
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
