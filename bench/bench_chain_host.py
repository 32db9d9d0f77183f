"""Host time per chained eagle3 iteration (engine/_chain.py) on the CPU, without the model.

The GPU's part is taken away: a graph cache whose replays copy their inputs into static
tensors (as ``CudaGraphCache.replay``) and return the outputs captured at warm-up without
computing anything (each VERIFY accepts 1 draft per row). What is left is what the host
does per iteration on the H200: SCHEDULE, PICK_GRAPH_KEY, DRAFT (the chain's match),
VERIFY (queueing the chained DRAFT + VERIFY, the read-back, on_verified), RESCAN. A tiny
random target (models/testing.py) with a random eagle3 head, fp32, chain forced on.

    python bench/bench_chain_host.py [--batches 1,32] [--iterations 400] [--runs 3]
        [--method eagle3] [--k 3] [--profile prof.txt] [--closed [--sampled]]
        [--adaptive-at K] [--cycle 0,0,0,0,0,0,4,4] [--steady] [--tree 15]

Per run: the copies into the graphs' static inputs an iteration, by input (each a torch
call on the host: what a replay costs beyond its ~2.5 µs launch); each state's mean time
per iteration, (``per-iteration medians``) the median of
its per-iteration times, which a shared, loaded host disturbs far less (a preempted
iteration moves a mean, not the median), and each state's thread CPU time per iteration
(the event loop thread's; the summary gives VERIFY + DRAFT + PICK_GRAPH_KEY's range).
``--closed``: closed rounds of requests that end apart instead (batch changes: the chain
taken for fewer rows, the sampling rows rebuilt), thread CPU per iteration and the K mix;
``--steady``: a server's load instead of endless requests (each of the batch's clients
sends another request as its last one ends; also with ``--cycle``); ``--sampled``:
odd requests sample (seeded, top-p), so the batch is not all greedy. ``--cycle``: batch 1
(``--cycle-batch``: another), adaptive K's one-rank path held to that cycle of K (n-gram: in and out of K = 0 stretches),
each state's median µs per move, the K before > this K > the K after (``0>0>4``: the K = 0
iteration that queues the chained step leaving a stretch), as profile_spec_gpu.py's
``by_move_then_states_us`` on the H200.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time

import anyio
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests' helpers
from _common import TREES, quiet_logs  # noqa: E402
from bench_host_overhead import StateTimes  # noqa: E402

from specloop.graphs import CudaGraphCache, GraphKey  # noqa: E402
from specloop.graphs._cache import inputs_written  # noqa: E402


class _Kept:
    def __init__(self, inputs, outputs, writes):
        self.inputs, self.outputs, self.writes, self.replays = inputs, outputs, writes, 0
        self.sources: dict = {}


class IterationTimes:
    """Each state's time in every iteration with a batch (for per-iteration medians)."""

    def __init__(self):
        self.us: dict[str, list[float]] = {}

    def on_transition(self, event):
        if event.batch_size:
            self.us.setdefault(event.state.value, []).append(event.duration_us)


class ThreadTimes:
    """Each state's thread CPU time (the event loop's thread; what ran on it since the last
    transition, consumers included), summed over iterations with a batch: unlike wall
    time, not moved by other processes on a shared, loaded host."""

    def __init__(self):
        self.us: dict[str, float] = {}
        self._last = time.thread_time()

    def on_transition(self, event):
        now = time.thread_time()
        if event.batch_size:
            key = event.state.value
            self.us[key] = self.us.get(key, 0.0) + (now - self._last) * 1e6
        self._last = now

    def clear(self):
        self.us.clear()
        self._last = time.thread_time()


class FrozenReplayCache(CudaGraphCache):
    """Captures by running the step once; replays copy inputs, compute nothing. Counts
    the copies by input name (``copies``): each is a torch call of ~10-25 µs on the
    H200's host (docs/performance-history.md, "Graph launches, the sampling columns, and
    one lease's sweep (thirty-third session)")."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.copies: collections.Counter[str] = collections.Counter()

    def capture(self, key: GraphKey, step, example) -> None:
        inputs = {n: t.clone() for n, t in example.items()}
        outputs = step(inputs)
        if "num_accepted" in outputs and key.num_draft_tokens:
            outputs["num_accepted"].fill_(1)
            outputs["token_ids"].fill_(7)
            outputs["packed"][:, :-1] = 7
            outputs["packed"][:, -1] = 1
        self._graphs[key] = _Kept(inputs, outputs, inputs_written(step))

    def replay(self, key, inputs):
        kept = self._graphs[key]
        if inputs is not None:
            for name, static in kept.inputs.items():
                source = inputs[name]
                if kept.sources.get(name) is not source:
                    if source is not static:    # else written in place (static_inputs)
                        static.copy_(source, non_blocking=True)
                        self.copies[name] += 1
                    kept.sources[name] = source
        kept.replays += 1
        for name in kept.writes:
            kept.sources.pop(name, None)
        return kept.outputs

    def feeds_itself(self, key):
        return False


def config(path, method, k, batch, adaptive=False, tree=None):
    from specloop.engine import EngineConfig  # noqa: PLC0415
    spec = {"method": method, "num_draft_tokens": k, "adaptive": adaptive}
    if tree is not None:    # a draft tree (_common.TREES' node count): K is its depth
        spec["tree"] = TREES[tree]
        spec["num_draft_tokens"] = max(len(p) for p in TREES[tree])
    return EngineConfig.from_dict({
        "model": {"name": str(path), "dtype": "float32", "device": "cpu",
                  "max_seq_len": 1 << 15, "chat_template": False},
        "scheduler": {"max_batch_size": batch, "max_num_tokens": 4096},
        "speculative": spec,
        "graphs": {"batch_buckets": [batch]},
        "components": {"graph_cache": "bench_chain_host:FrozenReplayCache"}})


def force_chain(worker, adaptive_at: int | None = None) -> None:
    """DRAFT + VERIFY chained as on one CUDA rank (the engine chains on CUDA only): VERIFY
    inline, and a DeviceChain for a drafter that can chain. ``adaptive_at``: adaptive K's
    one-rank path (the rule asked each iteration, its step queued early), held at that K
    by a warm-up table where it alone is cheap (nothing learned)."""
    from specloop.engine._chain import DeviceChain  # noqa: PLC0415
    worker.verify_inline = True
    if worker.drafter is not None and worker.drafter.can_chain:
        worker.chain = DeviceChain(worker=worker)
    if adaptive_at is not None:
        worker.ahead.at_k0 = True
        if adaptive_at < 0:     # --adaptive-at -1: the rule free, learning this host's times
            return
        cost = worker.adaptive.cost
        cost.learn = False
        for key in list(cost.device):
            cost.device[key] = 0.001 if key[1] == adaptive_at else 1.0


def start_endless(tg, engine, batch: int, steady: bool = False) -> list[int]:
    """``batch`` greedy requests that never end (steady decode) started in ``tg``;
    ``steady``: a server's load instead, each of ``batch`` clients sending a request of
    20 + 4 (i mod 16) tokens again as its last one ends (a request ends and another joins
    every iteration or two at batch 32-64, as on the H200's steady load). -> a list that
    grows by one as each request ends."""
    from specloop.samplers import SamplingParams  # noqa: PLC0415
    ended: list[int] = []

    async def one(i):
        for n in range(10 ** 9 if steady else 1):
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=(
                20 + 4 * ((i + n) % 16) if steady else 10 ** 6))
            async for _ in engine.generate([1, 2, 3, 4, 5, 6], params,
                                           request_id=f"r{i}-{n}"):
                pass
            ended.append(i)
    for i in range(batch):
        tg.start_soon(one, i)
    return ended


async def until(engine, iterations: int) -> None:
    """Wait until the engine has run ``iterations`` iterations in all."""
    while engine.stats.num_iterations < iterations:
        await anyio.sleep(0.002)


async def measure(cfg, loaded, batch, iterations, profiler, adaptive_at=None, steady=False):
    """-> (wall us per iteration, {state: us per iteration}, chained steps taken share,
    {state: median us of an iteration}, {state: thread CPU us per iteration}, requests
    that ended in the timed iterations)."""
    from specloop.engine import AsyncEngine  # noqa: PLC0415
    times, each, cpu = StateTimes(), IterationTimes(), ThreadTimes()
    async with AsyncEngine(cfg, model=loaded, observers=[times, each, cpu]) as engine:
        worker = engine.worker
        force_chain(worker, adaptive_at)
        async with anyio.create_task_group() as tg:
            ended = start_endless(tg, engine, batch, steady)
            await until(engine, 30)
            first, ended_before = engine.stats.num_iterations, len(ended)
            taken = worker.chain.taken_steps if worker.chain is not None else 0
            times.total_us.clear()
            each.us.clear()
            cpu.clear()
            copies = getattr(worker.graph_cache, "copies", None)
            if copies is not None:
                copies.clear()
            if profiler is not None:
                profiler.enable()
            start = time.perf_counter()
            await until(engine, first + iterations)
            elapsed = time.perf_counter() - start
            if profiler is not None:
                profiler.disable()
            done = engine.stats.num_iterations - first
            states = {s: v / done for s, v in times.total_us.items()}
            medians = {s: statistics.median(v) for s, v in each.us.items()}
            thread = {s: v / done for s, v in cpu.us.items()}
            share = ((worker.chain.taken_steps - taken) / done
                     if worker.chain is not None else 0.0)
            ended_here = len(ended) - ended_before
            copied = {name: n / done for name, n in (copies or {}).items()}
            if adaptive_at is not None and adaptive_at < 0:
                # The rule's view at the end (--adaptive-at -1): its times against the
                # fixed K's walls on this host.
                view = worker.adaptive.summary()
                print("  rule:", {k: view[k] for k in (
                    "bucket", "chosen", "measured_ms", "samples", "paired", "running",
                    "times_ms", "expected", "overhead_ms", "switch_ms")})
            tg.cancel_scope.cancel()
    return elapsed / done * 1e6, states, share, medians, thread, ended_here, copied


async def closed_rounds(cfg, loaded, batch, rounds, sampled=False, adaptive_at=None):
    """Closed rounds: ``batch`` requests at once, request i ending after 20 + 4i tokens
    (a batch change every ~2 iterations at batch 32, as a round's requests finish apart);
    the first round warms up. ``adaptive_at``: as ``measure``'s. -> (per round, {state:
    thread CPU us per iteration}; iterations per K over the timed rounds)."""
    from specloop.engine import AsyncEngine  # noqa: PLC0415
    from specloop.samplers import SamplingParams  # noqa: PLC0415
    cpu = ThreadTimes()
    out = []
    async with AsyncEngine(cfg, model=loaded, observers=[cpu]) as engine:
        force_chain(engine.worker, adaptive_at)
        per_k: dict[int, int] = {}
        for r in range(rounds + 1):
            if r == 1:
                per_k = dict(engine.stats.iterations_per_k)
            cpu.clear()
            first = engine.stats.num_iterations

            async def one(i, r=r):
                # --sampled: odd requests sample (seeded, top-p): the batch stays mixed
                # until its last sampled request ends, so batch changes rebuild its
                # sampling rows (an all-greedy batch keeps the last one's).
                params = SamplingParams(
                    temperature=0.8, top_p=0.95, seed=i, max_tokens=20 + 4 * i,
                    ignore_eos=True) if sampled and i % 2 else SamplingParams(
                    temperature=0.0, max_tokens=20 + 4 * i, ignore_eos=True)
                async for _ in engine.generate([1, 2, 3, 4, 5, 6], params,
                                               request_id=f"r{r}-{i}"):
                    pass
            async with anyio.create_task_group() as tg:
                for i in range(batch):
                    tg.start_soon(one, i)
            if r:
                done = engine.stats.num_iterations - first
                out.append({s: v / done for s, v in cpu.us.items()})
        per_k = {k: n - per_k.get(k, 0) for k, n in engine.stats.iterations_per_k.items()
                 if n > per_k.get(k, 0)}
    return out, per_k


async def moves(cfg, loaded, iterations: int, pattern: list[int], batch: int = 1,
                steady: bool = False) -> dict:
    """``--cycle``: ``batch`` endless greedy requests, K held to ``pattern``; -> per move
    (K before > K > K after) the count and each state's median µs (``host``: their
    sum)."""
    from profile_spec_gpu import StateTimes as MoveTimes  # noqa: PLC0415  (by_move)

    from specloop.engine import AsyncEngine  # noqa: PLC0415
    from tests.engine.test_adaptive import cycle_k  # noqa: PLC0415  (the tests' helper)
    times = MoveTimes()
    async with AsyncEngine(cfg, model=loaded, observers=[times]) as engine:
        worker = engine.worker
        force_chain(worker, max(pattern))
        cycle_k(worker.adaptive, pattern)
        async with anyio.create_task_group() as tg:
            start_endless(tg, engine, batch, steady)
            await until(engine, 50)
            times.rows.clear()
            await until(engine, 50 + iterations)
            tg.cancel_scope.cancel()
    return times.by_move(then=True)


def main() -> None:
    from specloop.models import load_model  # noqa: PLC0415
    from specloop.models.testing import write_tiny_checkpoint  # noqa: PLC0415
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--iterations", type=int, default=400)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--method", default="eagle3")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--profile", default="", help="write cProfile stats (last batch) here")
    ap.add_argument("--closed", action="store_true",
                    help="closed rounds of requests of different lengths instead (--runs "
                         "rounds): thread CPU per iteration, batch changes included")
    ap.add_argument("--steady", action="store_true",
                    help="a server's load instead of endless requests: each of the batch's "
                         "clients sends its next request (20-80 tokens) as its last ends")
    ap.add_argument("--sampled", action="store_true",
                    help="--closed: odd requests sample (temperature 0.8, top-p 0.95, "
                         "seeded) instead of all greedy")
    ap.add_argument("--adaptive-at", type=int, default=None, metavar="K",
                    help="adaptive K's one-rank path held at K (its bookkeeping, the "
                         "draft classes and the early choice on top of a fixed K's); -1: "
                         "the rule free, learning this CPU's times (its switches' host work)")
    ap.add_argument("--cycle", default="", metavar="K,K,..",
                    help="batch 1, adaptive K held to this cycle: state times per move (a "
                         "cycle through K = 0 chains with --method ngram only)")
    ap.add_argument("--tree", type=int, default=None, metavar="N",
                    help="draft the tree of N nodes (bench/_common.TREES) instead of a chain")
    ap.add_argument("--cycle-batch", type=int, default=1,
                    help="--cycle: this many endless requests (default 1)")
    args = ap.parse_args()
    quiet_logs()
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(tmp, vocab_size=384, num_layers=2, hidden=64, seed=1)
        loaded = load_model(path, dtype=torch.float32)
        if args.cycle:
            pattern = [int(k) for k in args.cycle.split(",")]
            cfg = config(path, args.method, max(pattern), args.cycle_batch, True)
            for _ in range(args.runs):
                rows = anyio.run(moves, cfg, loaded, args.iterations, pattern,
                                 args.cycle_batch, args.steady)
                for move, row in rows.items():
                    states = " ".join(f"{s} {v:.0f}" for s, v in row.items()
                                      if s not in ("n", "wait", "host"))
                    print(f"  {move:7s} n {row['n']:4d} host {row['host']:5.0f} us: {states}",
                          flush=True)
            return
        for batch in map(int, args.batches.split(",")):
            cfg = config(path, args.method, args.k, batch, args.adaptive_at is not None,
                         args.tree)
            if args.closed:
                rows, per_k = anyio.run(closed_rounds, cfg, loaded, batch, args.runs,
                                        args.sampled, args.adaptive_at)
                for t in rows:
                    print(f"  batch {batch} closed round, thread CPU: "
                          + " ".join(f"{s} {v:.0f}" for s, v in t.items()), flush=True)
                handled = [sum(t.get(s, 0.0) for s in ("SYNC", "PICK_GRAPH_KEY", "DRAFT",
                                                       "VERIFY")) for t in rows]
                print(f"{args.method} K={args.k} batch {batch}, closed rounds: thread CPU "
                      f"SYNC+PICK+DRAFT+VERIFY {min(handled):.0f}-{max(handled):.0f} "
                      f"us/iteration (K: {per_k})", flush=True)
                continue
            walls, per_state, per_median, handled = [], {}, {}, []
            profiler = cProfile.Profile() if args.profile else None
            for _ in range(args.runs):
                wall, states, share, medians, thread, _, copied = anyio.run(
                    measure, cfg, loaded, batch, args.iterations, profiler, args.adaptive_at,
                    args.steady)
                walls.append(wall)
                handled.append(sum(thread.get(s, 0.0)
                                   for s in ("VERIFY", "DRAFT", "PICK_GRAPH_KEY")))
                for s, v in states.items():
                    per_state.setdefault(s, []).append(v)
                for s, v in medians.items():
                    per_median.setdefault(s, []).append(v)
                print(f"  batch {batch}: {wall:.0f} us/iteration wall, chained {share:.2f}; "
                      + " ".join(f"{s} {v:.0f}" for s, v in states.items())
                      + "; per-iteration medians: "
                      + " ".join(f"{s} {v:.0f}" for s, v in medians.items())
                      + "; thread CPU: " + " ".join(f"{s} {v:.0f}" for s, v in thread.items())
                      + f"; copies into graph inputs {sum(copied.values()):.1f} an iteration ("
                      + ", ".join(f"{n} {v:.2f}" for n, v in sorted(copied.items(),
                                                                 key=lambda c: -c[1])) + ")",
                      flush=True)
            summary = " ".join(f"{s} {statistics.median(v):.0f}" for s, v in per_state.items())
            handlers = sum(statistics.median(v) for v in per_state.values())
            held = "" if args.adaptive_at is None else f" adaptive at {args.adaptive_at}"
            print(f"{args.method} K={args.k}{held} batch {batch}: wall {min(walls):.0f}-"
                  f"{max(walls):.0f} us/iteration; handlers {handlers:.0f} (median: "
                  f"{summary}); per-iteration medians, min-max over runs: "
                  + " ".join(f"{s} {min(v):.0f}-{max(v):.0f}" for s, v in per_median.items())
                  + f"; thread CPU VERIFY+DRAFT+PICK {min(handled):.0f}-{max(handled):.0f}",
                  flush=True)
            if profiler is not None:
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(45)
                pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(r"engine|drafters|_cache|graphs", 60)
                # Adaptive K's own calls, all of them (its cost beside a fixed K's).
                pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(
                    r"_adaptive|_ahead")
                with open(args.profile, "w") as f:
                    f.write(out.getvalue())


if __name__ == "__main__":
    main()
