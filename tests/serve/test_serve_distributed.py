"""Two ranks serving over gloo, ADP behind one HTTP front: started by torchrun (rank 0's
engine the front door), or by `specloop serve` alone (a ProcessEngine spawning the two
cores: the server's default for a group outside torchrun)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest import ENV, write_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


@pytest.mark.parametrize("launch", [[*TORCHRUN, "-m"], [sys.executable, "-m"]],
                         ids=["torchrun", "core-processes"])
def test_two_ranks_serve(serve_model, tmp_path, launch):
    config = write_config(tmp_path / "adp2.toml", serve_model, extra="""
[parallel]
world_size = 2
attention_dp = true

[components]
communicator = "torch_distributed"
""")
    proc = subprocess.Popen(
        [*launch, "specloop.engine.cli", "serve", "--config", config, "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**ENV, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 180
        line = ""
        while " on http://" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline
        url = line.split(" on ", 1)[1].split()[0]
        rank0 = int(line.split("(pid ", 1)[1].split(";")[0])
        with httpx.Client(base_url=url, timeout=120) as http:
            def one(i):
                return http.post("/v1/completions", json={
                    "prompt": f"request {i}", "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True})
            # Concurrent requests spread over both ranks (least loaded first).
            with ThreadPoolExecutor(4) as pool:
                replies = list(pool.map(one, range(4)))
            assert [r.status_code for r in replies] == [200] * 4
            assert all(r.json()["usage"]["completion_tokens"] == 8 for r in replies)
            # Each request's drafts as its rank's VERIFY events saw them: under torchrun
            # only rank 0's reach the server; with the cores it started, every rank's.
            drafted = ["spec_decode" in r.json()["usage"] for r in replies]
            if launch[0:len(TORCHRUN)] != TORCHRUN:
                assert all(drafted), [r.json()["usage"] for r in replies]
            assert http.get("/health").json() == {"status": "ok"}
        os.kill(rank0, signal.SIGTERM)          # the server (rank 0) shuts the group down
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
    finally:
        proc.kill()
