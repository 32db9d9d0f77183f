"""One live `specloop serve` per session on 127.0.0.1 (a free port), on a tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import importlib.util

import httpx
import pytest

# Skip without the server extras; find_spec, not importorskip: importing openai costs ~1 s
# of CPU in every xdist worker at collection, whether or not it runs a serve test.
if not all(importlib.util.find_spec(m) for m in ("starlette", "openai")):
    pytest.skip("needs the server extras (starlette, openai)", allow_module_level=True)

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from specloop.models.testing import write_tiny_checkpoint  # noqa: E402

API_KEY = "test-key"
MAX_BATCH = 16
K = 3
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def write_config(path, model, *, method="ngram", extra="") -> str:
    path.write_text(f"""
[model]
name = "{model}"
dtype = "float64"
device = "cpu"
max_seq_len = 512

[scheduler]
max_batch_size = {MAX_BATCH}
max_num_tokens = 1024

[speculative]
method = "{method}"
num_draft_tokens = {K}
{extra}""")
    return str(path)


@pytest.fixture(scope="session")
def serve_model(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("serve") / "tiny", vocab_size=384,
                                 num_layers=2, hidden=64, seed=3)


@pytest.fixture(scope="session")
def serve_config(serve_model, tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("serve") / "serve.toml", serve_model)


class Server:
    def __init__(self, args, *, timeout=120.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specloop.engine.cli", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        deadline = time.monotonic() + timeout
        while True:
            line = self.proc.stdout.readline()
            if " on http://" in line:
                self.url = line.split(" on ", 1)[1].split()[0]
                break
            if not line and self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"server did not start: {self.proc.stderr.read()[-2000:]}")

    def stop(self, sig=signal.SIGINT, timeout=60.0) -> tuple[int, str, str]:
        self.proc.send_signal(sig)
        try:
            out, err = self.proc.communicate(timeout=timeout)
        finally:
            self.proc.kill()
        return self.proc.returncode, out, err


@pytest.fixture(scope="session")
def server(serve_config, tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "serve-trace.json"
    srv = Server(["--config", serve_config, "--api-key", API_KEY, "--trace", str(trace),
                  "--shutdown-timeout", "2"])
    yield srv
    # Graceful shutdown with a stream still open: SIGTERM ends it, the process exits 0
    # and writes its trace.
    chunks = []
    with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"prompt": "hello", "max_tokens": 480, "stream": True,
                            "ignore_eos": True}) as response:
        lines = response.iter_lines()
        chunks.append(next(lines))
        code, _, err = srv.stop(signal.SIGTERM)
        try:
            chunks.extend(lines)
        except httpx.HTTPError:
            pass            # the connection closed under the stream: also an end
    assert code == 0, err[-3000:]
    assert chunks[0].startswith("data: ")
    doc = json.loads(trace.read_text())
    assert any(e["name"] == "VERIFY" for e in doc["traceEvents"])


@pytest.fixture(scope="session")
def core_server(serve_config):
    """The same server with ``--core-process``: the engine core in a child process."""
    srv = Server(["--config", serve_config, "--api-key", API_KEY, "--core-process",
                  "--shutdown-timeout", "2"])
    yield srv
    code, _, err = srv.stop(signal.SIGTERM)
    assert code == 0, err[-3000:]


def metrics(url: str) -> dict[str, float]:
    """``{"name{label=value}": value}`` from /metrics."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
