"""bench/serve_smoke_gpu.py (the H200's `specloop serve` check with stdlib clients) on the
CPU with the tiny model: the server starts with its defaults (on the CPU the engine stays
in the server's process), the clients get their tokens, one JSON line per level."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .conftest import ENV

ROOT = Path(__file__).resolve().parents[2]


def test_serve_smoke_bench_on_cpu(serve_config):
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serve_smoke_gpu.py"), "--config", serve_config,
         "--concurrency", "1,3", "--requests-per-client", "2", "--max-tokens", "4"],
        capture_output=True, text=True, env=ENV, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].endswith("child processes 0"), lines     # CPU: no core process
    rows = [json.loads(line) for line in lines[1:]]
    assert [r["concurrency"] for r in rows] == [1, 3]
    assert all(r["output_tokens_per_s"] > 0 for r in rows)
