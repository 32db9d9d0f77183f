"""Soak: N requests through AsyncEngine on the tiny random model, with a fraction cancelled
(every path: cancel() while queued or running, break, timeout) and a fraction of bad
inputs; then checks that nothing was lost or leaked. Bounded: stops by itself.

    python bench/bench_soak.py --n 10000 --world 1
    python bench/bench_soak.py --n 10000 --world 2     # two LocalGroup ranks

Prints completed (length) / cancelled / left_early / rejected / lost / wrong / leaked
slots, requests, ids and tasks / RSS after a 200-request warm-up, after the soak (engine
still up) and after the engine closed; exits 1 if anything was lost, wrong or leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import anyio
import torch

from _common import quiet_logs
from specloop.comm import LocalGroup
from specloop.engine import (AsyncEngine, EngineClosedError, EngineConfig, FinishReason,
                             RequestError)
from specloop.models import load_model
from specloop.models.testing import write_tiny_checkpoint
from specloop.samplers import SamplingParams

PROMPTS = [[5, 17, 99, 3, 42], [200, 201, 202, 203, 200, 201, 202], [7],
           [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [300, 5, 300, 5, 300]]
BAD_PROMPTS = [[], [1, 2, 10**6], "bad \ud800 text", [1.5, 2]]
CANCELS = ("cancel_queued", "cancel_running", "break", "timeout")


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def config_for(model_dir: Path, args) -> EngineConfig:
    return EngineConfig.from_dict({
        "model": {"name": str(model_dir), "dtype": "float32", "device": "cpu",
                  "max_seq_len": 256, "chat_template": False},
        "scheduler": {"max_batch_size": args.batch, "max_num_tokens": 512, "seed": 0},
        "speculative": {"method": "ngram", "num_draft_tokens": 3},
        "parallel": {"world_size": args.world, "attention_dp": args.world > 1}})


class Soak:
    """Runs the requests on rank 0's engine and tallies how each one ended."""

    def __init__(self, engine, args, references) -> None:
        self.engine, self.args, self.refs = engine, args, references
        self.counts: Counter[str] = Counter()
        self.rng = random.Random(args.seed)

    def plan(self, i: int) -> tuple[str, int, SamplingParams]:
        r = self.rng.random()
        kind = ("bad" if r < self.args.bad_frac else
                self.rng.choice(CANCELS) if r < self.args.bad_frac + self.args.cancel_frac
                else "complete")
        seed = None if self.rng.random() < 0.5 else self.rng.randrange(4)
        params = SamplingParams(temperature=0 if seed is None else 1.0, seed=seed,
                                max_tokens=self.rng.choice((1, 4, 8, 16)), ignore_eos=True)
        return kind, self.rng.randrange(len(PROMPTS)), params

    async def one(self, i: int) -> None:
        kind, p, params = self.plan(i)
        rid = f"r{i}"
        try:
            with anyio.fail_after(self.args.request_timeout_s):
                await self._run(kind, rid, p, params)
        except TimeoutError:
            self.counts["lost"] += 1        # its stream never ended
        except RequestError:
            self.counts["rejected" if kind == "bad" else "rejected_good"] += 1
        except EngineClosedError:
            self.counts["engine_closed"] += 1

    async def _run(self, kind: str, rid: str, p: int, params: SamplingParams) -> None:
        if kind == "bad":
            bad = self.rng.randrange(len(BAD_PROMPTS) + 1)
            prompt = BAD_PROMPTS[bad] if bad < len(BAD_PROMPTS) else PROMPTS[p]
            rid = rid if bad < len(BAD_PROMPTS) else "req-7"   # the reserved id form
            await self._consume(kind, rid, prompt, params)
            self.counts["bad_accepted"] += 1
            return
        if kind == "cancel_queued":
            self.engine.cancel(rid)          # unknown yet: ignored, must not hurt
        tokens, reason = await self._consume(kind, rid, PROMPTS[p], params)
        if reason is None:
            self.counts["left_early"] += 1
            key = None
        else:
            self.counts[reason.value] += 1
            key = (p, params.seed, params.max_tokens)
        if key is not None and params.seed is None:
            want = self.refs[key]
            if tokens != want[:len(tokens)] or (reason is FinishReason.LENGTH
                                                and tokens != want):
                self.counts["wrong"] += 1
        elif key is not None and reason is FinishReason.LENGTH:
            if self.refs.setdefault(key, tokens) != tokens:
                self.counts["wrong"] += 1

    async def _consume(self, kind, rid, prompt, params):
        tokens, reason = [], None
        stream = self.engine.generate(prompt, params, request_id=rid)
        limit = self.rng.choice((0, 0.001, 0.01)) if kind == "timeout" else float("inf")
        async with contextlib.aclosing(stream):
            with anyio.move_on_after(limit):
                async for out in stream:
                    if kind == "cancel_queued" and not tokens and not out.finished:
                        self.engine.cancel(rid)
                    tokens.extend(out.token_ids)
                    if out.finished:
                        reason = out.finish_reason
                    elif kind == "break" and len(tokens) >= 2:
                        break
                    elif kind == "cancel_running" and len(tokens) >= 2:
                        self.engine.cancel(rid)
        return tokens, reason

    async def run(self, n: int, deadline: float) -> int:
        """Keeps `concurrency` requests in flight until n were sent or time is up."""
        limiter = anyio.Semaphore(self.args.concurrency)
        sent = 0

        async def guarded(i):
            try:
                await self.one(i)
            finally:
                limiter.release()

        async with anyio.create_task_group() as tg:
            for i in range(n):
                await limiter.acquire()
                if time.monotonic() > deadline:
                    limiter.release()
                    break
                tg.start_soon(guarded, i)
                sent += 1
        return sent


async def references(engine) -> dict:
    """Greedy outputs of each prompt alone, the longest length asked for."""
    refs = {}
    for p, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        tokens = [t async for o in engine.generate(prompt, params) for t in o.token_ids]
        for m in (1, 4, 8, 16):
            refs[(p, None, m)] = tokens[:m]
    return refs


async def leftovers(engines) -> dict:
    """What the engines still hold once every stream ended (cancels reach other ranks
    with the next exchanges, so poll a little first)."""
    with anyio.move_on_after(5):
        while any(e.num_free_slots != e.config.scheduler.max_batch_size
                  or e.worker.scheduler.num_requests for e in engines):
            await anyio.sleep(0.01)
    return {"leaked_slots": sum(e.config.scheduler.max_batch_size - e.num_free_slots
                                for e in engines),
            "leaked_requests": sum(e.worker.scheduler.num_requests for e in engines),
            "leaked_ids": len(engines[0].front.open_request_ids)}


async def main_async(args, loaded, config) -> dict:
    before_tasks = asyncio.all_tasks()
    group = LocalGroup(args.world, timeout=30.0)
    engines, report = {}, {}

    async def rank_main(comm):
        async with AsyncEngine(config, communicator=comm, model=loaded) as engine:
            engines[comm.rank] = engine
            if comm.rank != 0:
                await engine.wait_closed()
                return
            refs = await references(engine)
            soak = Soak(engine, args, refs)
            await soak.run(200, float("inf"))           # warm-up: allocator, caches
            gc.collect()
            report["rss_before_mib"] = round(rss_mib(), 1)
            soak.counts.clear()
            start = time.monotonic()
            report["sent"] = await soak.run(args.n, start + args.time_limit_s)
            report["seconds"] = round(time.monotonic() - start, 1)
            report.update(await leftovers([engines[r] for r in sorted(engines)]))
            gc.collect()
            report["rss_after_soak_mib"] = round(rss_mib(), 1)
            fresh = await references(engine)              # still serves, same outputs
            report["fresh_batch_ok"] = all(fresh[k] == refs[k] for k in fresh)
            report.update(dict(sorted(soak.counts.items())))

    await group.run(rank_main)
    engines.clear()
    gc.collect()
    report["rss_after_mib"] = round(rss_mib(), 1)
    report["leaked_tasks"] = len(asyncio.all_tasks() - before_tasks)
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--world", type=int, default=1, choices=(1, 2))
    p.add_argument("--batch", type=int, default=16, help="scheduler.max_batch_size")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--cancel-frac", type=float, default=0.2)
    p.add_argument("--bad-frac", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout-s", type=float, default=60.0,
                   help="a stream not ended by then counts as lost")
    p.add_argument("--time-limit-s", type=float, default=1200.0,
                   help="stop sending after this long (the run stays bounded)")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args()
    quiet_logs()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_checkpoint(Path(tmp) / "tiny", vocab_size=384)
        loaded = load_model(model_dir, dtype=torch.float32)
        report = anyio.run(main_async, args, loaded, config_for(model_dir, args))
    report = {"n": args.n, "world": args.world, "cancel_frac": args.cancel_frac,
              "bad_frac": args.bad_frac, **report}
    report["rss_growth_mib"] = round(report["rss_after_soak_mib"] - report["rss_before_mib"], 1)
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    bad = (report.get("lost", 0) or report.get("wrong", 0) or report["leaked_slots"]
           or report["leaked_requests"] or report["leaked_ids"] or report["leaked_tasks"]
           or report.get("bad_accepted", 0) or report.get("engine_closed", 0)
           or not report["fresh_batch_ok"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
