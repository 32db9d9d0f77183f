"""Triton kernels tested on the CPU: a child process runs the test's source under Triton's
interpreter (TRITON_INTERPRET must be set before Triton is first imported, which this
process may already have done)."""

import os
import subprocess
import sys


def run_interpreted(child: str, *args: str) -> None:
    """Runs ``child`` (Python source that prints "ok" last when all its checks passed) with
    ``args`` as its argv and TRITON_INTERPRET=1; fails with the child's stderr otherwise."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", child, *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
