"""Load generator for `specloop serve`: rising concurrency, against AsyncEngine directly.

    python bench/bench_serve.py [--config FILE] [--concurrency 1,2,4,...,64]
        [--max-tokens 128] [--runs 3] [--methods ngram,none] [--plot serve.png] [--out r.json]
        [--core-process]

For each method (speculation on, then off) and each concurrency level C it runs C closed-loop
clients (each sends its next request when the previous one ends) for --requests-per-client
requests each, once through the server (a `specloop serve` subprocess on a free port, the
official `openai` async client, streaming) and once on AsyncEngine in this process, and
prints requests/s, output tokens/s, TTFT and ITL percentiles and mean acceptance length,
and server ÷ direct tokens/s (the goal: >= 0.95). Greedy, ignore_eos, so every request
generates --max-tokens tokens. --plot needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import anyio

from _common import quiet_logs

# The n-gram config (model-free drafts; --methods overrides speculative.method). It was
# the engine's embedded default, engine/defaults/smollm2-ngram.toml, until c141830 made the
# eagle3 head the default and kept the n-gram config as this example only.
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "smollm2-ngram.toml"

PROMPTS = [
    "Tell me about llamas.", "Write a Python function that reverses a list.",
    "What causes the seasons on Earth?", "Summarize the plot of Hamlet in three sentences.",
    "Explain speculative decoding to a new engineer.", "List five uses of a paperclip.",
    "How do I make a cup of tea?", "Translate 'good morning' into French and Spanish.",
]


class Timing:
    """One request's arrival, output times and token counts."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.drafts = self.accepted = 0

    def output(self, count: int) -> None:
        if count:
            self.times.append(time.perf_counter())
            self.tokens.append(count)

    @property
    def ttft(self) -> float:
        return self.times[0] - self.start

    def itls(self) -> list[float]:
        out = []
        for prev, now, n in zip(self.times, self.times[1:], self.tokens[1:]):
            out += [(now - prev) / n] * n
        return out


async def _closed_loop(concurrency: int, per_client: int, one) -> tuple[list[Timing], float]:
    timings: list[Timing] = []

    async def client(c):
        for r in range(per_client):
            timings.append(await one(c * per_client + r))

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for c in range(concurrency):
            tg.start_soon(client, c)
    return timings, time.perf_counter() - start


def summarize(timings: list[Timing], elapsed: float) -> dict:
    def pct(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(q / 100 * len(values)))] * 1e3 if values else 0.0

    ttfts = [t.ttft for t in timings]
    itls = [x for t in timings for x in t.itls()]
    tokens = sum(sum(t.tokens) for t in timings)
    drafts = sum(t.drafts for t in timings)
    return {"requests_per_s": len(timings) / elapsed, "output_tokens_per_s": tokens / elapsed,
            "ttft_ms": {q: pct(ttfts, q) for q in (50, 90, 99)},
            "itl_ms": {q: pct(itls, q) for q in (50, 90, 99)},
            "mean_al": 1 + sum(t.accepted for t in timings) / drafts if drafts else 1.0}


# through the server ---------------------------------------------------------------------
def start_server(config: str, method: str, *flags: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specloop.engine.cli", "serve", "--config", config,
         "--method", method, "--port", "0", *flags], stdout=subprocess.PIPE, text=True,
        env=env)
    line = proc.stdout.readline()
    if " on http://" not in line:
        raise SystemExit(f"server did not start: {line!r}")
    return proc, line.split(" on ", 1)[1].split()[0]


async def run_server(url: str, concurrency: int, per_client: int, max_tokens: int) -> dict:
    import httpx  # noqa: PLC0415
    import openai  # noqa: PLC0415

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                timeout=600, http_client=httpx.AsyncClient(
                                    limits=httpx.Limits(max_connections=256)))
    model = (await client.models.list()).data[0].id

    async def one(i):
        timing = Timing()
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            for choice in chunk.choices:
                timing.output(len(getattr(choice, "token_ids", None) or []))
            spec = getattr(chunk.usage, "spec_decode", None) if chunk.usage else None
            if spec:
                timing.drafts, timing.accepted = spec["num_drafts"], spec["num_accepted_tokens"]
        return timing

    await one(0)                                    # warm up
    result = summarize(*await _closed_loop(concurrency, per_client, one))
    await client.close()
    return result


# directly on AsyncEngine -------------------------------------------------------------------
class SpecRows:
    """The per-request acceptance the server reports, from the same VERIFY events."""

    def __init__(self) -> None:
        self.rows: dict[str, Timing] = {}

    def on_transition(self, event) -> None:
        if event.accepted:
            for rid, n in zip(event.request_ids, event.accepted):
                timing = self.rows.get(rid)
                if timing is not None:
                    timing.drafts += 1
                    timing.accepted += n


async def run_direct(engine, spec: SpecRows, concurrency: int, per_client: int,
                     max_tokens: int) -> dict:
    from specloop.samplers import SamplingParams  # noqa: PLC0415

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i):
        timing = Timing()
        rid = f"bench-{len(spec.rows)}"
        spec.rows[rid] = timing
        messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        ids = engine.tokenizer.encode_chat(messages)
        async for out in engine.generate(ids, params, request_id=rid):
            timing.output(len(out.token_ids))
        return timing

    await one(0)
    return summarize(*await _closed_loop(concurrency, per_client, one))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--methods", default="ngram,none")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--out", help="write every figure as JSON")
    p.add_argument("--core-process", action="store_true",
                   help="also through a server with --core-process (the engine core in a "
                   "child process), beside the plain one")
    p.add_argument("--plot", help="PNG: tokens/s and p99 ITL against concurrency")
    args = p.parse_args()
    quiet_logs()
    levels = [int(c) for c in args.concurrency.split(",")]
    results = []
    for method in args.methods.split(","):
        for run in range(args.runs):
            results += bench_method(args, method, levels, run)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)


def bench_method(args, method: str, levels: list[int], run: int) -> list[dict]:
    from specloop.engine import AsyncEngine, EngineConfig  # noqa: PLC0415

    out = []
    # The plain server keeps the engine in its own process (on a GPU `serve` would
    # otherwise run the core in a child by default).
    servers = [("server", ("--no-core-process",))] + ([("server-core", ("--core-process",))]
                                                       if args.core_process else [])
    for path, flags in servers:
        proc, url = start_server(args.config, method, *flags)
        try:
            for c in levels:
                served = anyio.run(run_server, url, c, args.requests_per_client,
                                   args.max_tokens)
                out.append({"method": method, "run": run, "concurrency": c, "path": path,
                            **served})
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    data = EngineConfig.from_toml(args.config).to_dict()
    data["speculative"]["method"] = method
    config = EngineConfig.from_dict(data)

    async def direct():
        spec = SpecRows()
        async with AsyncEngine(config, observers=(spec,)) as engine:
            for c in levels:
                res = await run_direct(engine, spec, c, args.requests_per_client,
                                       args.max_tokens)
                out.append({"method": method, "run": run, "concurrency": c, "path": "direct",
                            **res})
    anyio.run(direct)
    for c in levels:
        s, d = (next(r for r in out if r["concurrency"] == c and r["path"] == path)
                for path in ("server", "direct"))
        print(f"{method:6s} run {run} C={c:3d}  server {s['output_tokens_per_s']:8.1f} tok/s "
              f"{s['requests_per_s']:6.2f} req/s  TTFT p50/p99 {s['ttft_ms'][50]:7.1f}/"
              f"{s['ttft_ms'][99]:7.1f} ms  ITL p50/p99 {s['itl_ms'][50]:6.1f}/"
              f"{s['itl_ms'][99]:6.1f} ms  AL {s['mean_al']:.2f} | direct "
              f"{d['output_tokens_per_s']:8.1f} tok/s AL {d['mean_al']:.2f} | server/direct "
              f"{s['output_tokens_per_s'] / d['output_tokens_per_s']:.3f}", flush=True)
        core = next((r for r in out if r["concurrency"] == c and r["path"] == "server-core"),
                    None)
        if core is not None:
            print(f"{method:6s} run {run} C={c:3d}  --core-process "
                  f"{core['output_tokens_per_s']:8.1f} tok/s  TTFT p50/p99 "
                  f"{core['ttft_ms'][50]:7.1f}/{core['ttft_ms'][99]:7.1f} ms  ITL p50/p99 "
                  f"{core['itl_ms'][50]:6.1f}/{core['itl_ms'][99]:6.1f} ms | core/server "
                  f"{core['output_tokens_per_s'] / s['output_tokens_per_s']:.3f}", flush=True)
    return out


def plot(results: list[dict], path: str) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    for method in sorted({r["method"] for r in results}):
        for route, style in (("server", "-o"), ("server-core", "-s"), ("direct", "--x")):
            rows = [r for r in results if r["method"] == method and r["path"] == route]
            if not rows:
                continue
            levels = sorted({r["concurrency"] for r in rows})
            tps = [statistics.median(r["output_tokens_per_s"] for r in rows
                                     if r["concurrency"] == c) for c in levels]
            itl = [statistics.median(r["itl_ms"][99] for r in rows if r["concurrency"] == c)
                   for c in levels]
            label = f"{method} ({route})"
            a.plot(levels, tps, style, label=label)
            b.plot(levels, itl, style, label=label)
    for ax, title in ((a, "output tokens/s"), (b, "p99 inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
