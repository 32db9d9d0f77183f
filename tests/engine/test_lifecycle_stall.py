"""A stalled (SIGSTOPped, not dead) rank under torch.distributed: the survivor raises
CollectiveTimeoutError within parallel.collective_timeout_s and the CLI exits non-zero."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specloop.models.testing import write_tiny_checkpoint

from .conftest import write_gloo_config

pytestmark = [pytest.mark.distributed]
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 3.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rank(rank, port, config, log_path, level):
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    # Two prompts: the group spreads them, so rank 1 serves one when it is stopped.
    cmd = [sys.executable, "-m", "specloop.engine.cli", "generate", "--config", str(config),
           "--prompt", "hello", "--prompt", "world", "--max-tokens", "3000", "--ignore-eos",
           "--log-level", level]
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=log)


def wait_for(path: Path, text: str, proc, limit: float) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if text in path.read_text():
            return
        assert proc.poll() is None, path.read_text()[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not seen in {path}: {path.read_text()[-3000:]}")


def test_a_stopped_rank_times_out_the_survivor(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "tiny", vocab_size=384)
    config = write_gloo_config(tmp_path / "adp2.toml", model, max_seq_len=4096,
                               collective_timeout_s=TIMEOUT_S)
    port = free_port()
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    procs = [start_rank(0, port, config, logs[0], "warning"),
             start_rank(1, port, config, logs[1], "debug")]
    try:
        # Rank 1 is mid-run: it has a request in its batch.
        wait_for(logs[1], "batch_size=1", procs[1], limit=120)
        os.kill(procs[1].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        code = procs[0].wait(timeout=TIMEOUT_S + 60)
        elapsed = time.monotonic() - stopped
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    err = logs[0].read_text()
    print(f"stopped -> exit {elapsed:.1f} s; rank 0 said: {err[-2000:]}")
    assert code != 0, err[-3000:]
    assert "CollectiveTimeoutError" in err, err[-3000:]
    # It waited out the configured timeout (not the 300 s default), then failed.
    assert 0.8 * TIMEOUT_S <= elapsed <= TIMEOUT_S + 30, (elapsed, err[-3000:])
