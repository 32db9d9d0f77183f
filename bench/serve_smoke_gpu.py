"""`specloop serve` on a GPU with its defaults (the engine core in a child process for one
rank on CUDA), loaded by stdlib clients: C concurrent closed-loop clients, non-streaming
chat completions of --max-tokens each (greedy, ignore_eos), output tokens/s per level, and
the server's process tree (the core's child process present or not).

    python bench/serve_smoke_gpu.py --config examples/smollm2-serve-h200.toml \
        [--concurrency 1,64] [--requests-per-client 2] [--max-tokens 128] [-- serve flags]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request


def start(config: str, flags: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "specloop.engine.cli", "serve", "--config",
                             config, "--port", "0", *flags], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if " on http://" not in line:
        raise SystemExit(f"server did not start: {line!r}")
    url = line.split(" on ", 1)[1].split()[0]
    deadline = time.monotonic() + 600      # bound first, ready once the model is up
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None:
            raise SystemExit("server exited before it was ready")
        time.sleep(0.5)
    raise SystemExit("server not ready in 600 s")


def model_id(url: str) -> str:
    """The served model's id (/v1/models)."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def one(url: str, model: str, i: int, max_tokens: int) -> int:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content":
                      f"Tell me something interesting about the number {i}."}],
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]


def level(url: str, model: str, c: int, per_client: int, max_tokens: int) -> float:
    tokens = [0] * c

    def client(k: int) -> None:
        for r in range(per_client):
            tokens[k] += one(url, model, k * per_client + r, max_tokens)
    threads = [threading.Thread(target=client, args=(k,)) for k in range(c)]
    start_t = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (time.perf_counter() - start_t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("flags", nargs="*", help="serve's own flags, after --")
    args = ap.parse_args()
    proc, url = start(args.config, args.flags)
    try:
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                  text=True).stdout.split()
        print(f"server pid {proc.pid}, child processes {len(children)}", flush=True)
        model = model_id(url)
        one(url, model, 0, 8)      # warm up
        for c in map(int, args.concurrency.split(",")):
            rate = level(url, model, c, args.requests_per_client, args.max_tokens)
            print(json.dumps({"concurrency": c, "output_tokens_per_s": round(rate, 1),
                              "flags": args.flags}), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
