"""Adaptive K against no speculation and fixed K, per batch size (the issue-13 bar: adaptive
÷ max(none, fixed K) >= 0.97 at every batch). Real SmolLM2 (bf16, CUDA graphs: one bucket
per batch, or with ``--buckets serving`` buckets for every power of two up to the batch, so
a round's last iterations, when few rows are left, replay small graphs), the shipped eagle3
head, greedy, held-out chat prompts, EOS ignored.

For each batch size every config's engine is built first (all stay open), one warm-up
round each (a whole one), then ``--runs`` runs in which the configs take turns (so drift hits all
alike; run r starts with config r mod n). A run is, with ``--arrival closed`` (the default), one round: ``batch`` prompts
at once, timed until the last finishes (a round lasts until its slowest row is done);
with ``--arrival steady``, steady load as a server sees it (vLLM's ``benchmark_serving
--max-concurrency``): ``batch`` requests in flight at all times, a new prompt submitted
whenever one finishes (the held-out prompts cycled), ``--requests`` in all (default
max(4 x batch, 32)), request j asking for ``--tokens`` x (1 +- ``--spread``) tokens
(uniform, seeded: the same lengths for every config; default 0.5: with equal lengths an
engine without speculation finishes its rows together, so its load stays closed rounds
without their tail, while a server's requests end apart; ``--spread 0`` for equal
lengths); its tokens/s are the tokens delivered from the ``batch``-th finish to the last
submission over that window's seconds (bench/_common.py ``steady_load``: before it the
engine fills, after it drains). Prints one JSON row per (batch, config):
tokens/s per run, the median, the ratio to no speculation, AL, iterations per K (each
state's median ms per K: ``runs_traced[].state_median_ms_by_k``); then adaptive ÷
max(others) per batch, of the medians and per run (``paired_vs_max``: a run's adaptive
over the best other config in that run; the configs take turns, each run starting one
config further on). ``--plot rows.jsonl`` draws tokens/s per batch (PNG)
from earlier rows, without a GPU. ``--device cpu`` (tiny ``--batches``/``--tokens``) is a
smoke test of the script (tests/engine/test_bench_steady.py).

    python bench/bench_adaptive_gpu.py --prompts prompts.jsonl --out rows.jsonl
    python bench/bench_adaptive_gpu.py --prompts prompts.jsonl --out rows.jsonl \
        --buckets serving --arrival steady
    python bench/bench_adaptive_gpu.py --plot rows.jsonl --png bench/adaptive_h200.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import statistics
import sys
import time

import anyio
import torch

from _common import (HELD_OUT, add_arrival_args, device_sync, emit_row, engine_config,
                     generate_round, held_out_sets, held_out_texts, quiet_logs, steady_load,
                     steady_setup, timed_sets)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # tests' helpers
from tests.triton_variants import compiled_variants, new_variants  # noqa: E402


class RunTrace:
    """IterationObserver: per timed run, the iterations' wall time (their states' durations
    summed, SCHEDULE left out: a round's first one waits for its requests while the other
    configurations run theirs; it stays in ``states``) by K, the slowest few with their state breakdown, and the Triton kernels
    that specialised during the run ({kernel: new variants} in this process,
    tests/triton_variants.py) -- what a slow run spent its
    time on (batch 256's first adaptive run was 2.8x slow in two sessions)."""

    def __init__(self) -> None:
        self.iters: dict[int, dict] = {}

    def on_transition(self, event) -> None:
        it = self.iters.setdefault(event.iteration, {
            "k": event.num_draft_tokens, "batch": event.batch_size, "ms": 0.0, "states": {}})
        ms = event.duration_us / 1e3
        if event.state.name != "SCHEDULE":     # SCHEDULE waits for requests: between
            it["ms"] += ms                      # rounds, while the other configs run
        it["states"][event.state.name] = round(it["states"].get(event.state.name, 0.0) + ms, 3)
        if event.state.name != "SCHEDULE":     # SYNC chooses K: SCHEDULE's is the config's
            it["k"] = event.num_draft_tokens

    def take(self, compiled: dict[str, int]) -> dict:
        iters, self.iters = self.iters, {}
        by_k: dict[int, list[float]] = {}
        for it in iters.values():
            by_k.setdefault(it["k"], []).append(it["ms"])
        slow = sorted(iters.items(), key=lambda kv: -kv[1]["ms"])[:4]
        # Each state's median ms per K: which state a slow run's iterations spent more in
        # (a round's first SCHEDULE, waiting between rounds, is left in: its median is not).
        states: dict[int, dict[str, list[float]]] = {}
        for it in iters.values():
            for state, ms in it["states"].items():
                states.setdefault(it["k"], {}).setdefault(state, []).append(ms)
        return {"iterations": len(iters), "triton_compiled": compiled,
                "ms_by_k": {k: [len(v), round(sum(v), 1)] for k, v in sorted(by_k.items())},
                "state_median_ms_by_k": {
                    k: {state: round(statistics.median(v), 3) for state, v in per.items()}
                    for k, per in sorted(states.items())},
                "slowest": [{"iteration": i, "k": it["k"], "batch": it["batch"],
                             "ms": round(it["ms"], 2), "states": it["states"]}
                            for i, it in slow]}


HEAD = {"method": "eagle3", "draft_weights": "smollm2-135m-instruct-eagle3"}
CONFIGS = {"none": {"method": "none"},
           "K=1": {**HEAD, "num_draft_tokens": 1},
           "K=2": {**HEAD, "num_draft_tokens": 2},
           "K=3": {**HEAD, "num_draft_tokens": 3},
           "K=5": {**HEAD, "num_draft_tokens": 5},
           "adaptive<=3": {**HEAD, "num_draft_tokens": 3, "adaptive": True},
           "adaptive<=5": {**HEAD, "num_draft_tokens": 5, "adaptive": True}}


class LearnLog:
    """``--learn-log``: what adaptive K learned and chose, one record per call, to tell a
    K's learned T(b, k) from what a stretch of it costs (the fourteenth session's rows:
    the K the rule ran least had learned 1.3-1.5x its fixed-K iteration time at batch
    32-256). Wraps the engine's ``CostTable.observe`` (each learned time with its flags)
    and ``AdaptiveK._rule`` (the times and E(k) each choice saw); ``mark`` starts a run."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self._names: dict[int, str] = {}     # id(CostTable) / id(AdaptiveK) -> config
        self._originals: tuple | None = None   # the classes' own methods while attached

    def attach(self, name: str, adaptive) -> None:
        """Log ``adaptive``'s calls as ``name``'s (the engine's CostTable is a slotted
        attrs class: the methods are wrapped on the classes, once, by instance)."""
        from specloop.engine._adaptive import AdaptiveK, CostTable  # noqa: PLC0415
        self._names[id(adaptive.cost)] = self._names[id(adaptive)] = name
        if self._originals is not None:
            return
        observe, rule = self._originals = CostTable.observe, AdaptiveK._rule

        def logged_observe(cost, bucket, k, seconds, disturbed=False, switched=False,
                           leaving=False):
            name = self._names.get(id(cost))
            if name is not None:
                self.records.append({"c": name, "ev": "observe", "b": bucket, "k": k,
                                     "ms": round(seconds * 1e3, 4), "dist": disturbed,
                                     "sw": switched, "leave": leaving,
                                     "trying": not cost.tried(bucket, k)})
            observe(cost, bucket, k, seconds, disturbed, switched, leaving)

        def logged_rule(adaptive, expected, bucket, calls):
            k = rule(adaptive, expected, bucket, calls)
            name = self._names.get(id(adaptive))
            if name is not None:
                times = adaptive.cost.times(bucket, adaptive.candidates)
                self.records.append({
                    "c": name, "ev": "rule", "b": bucket, "calls": calls, "k": k,
                    "e": {c: round(e, 3) for c, e in expected.items()},
                    "t": {c: round(t * 1e3, 4) for c, t in times.items()},
                    # E(k) of the pooled counts, where ``e`` may be the batch's tail's
                    "ep": {c: round(e, 3) for c, e in adaptive._expected_here(None).items()},
                    "settled": bucket in adaptive._settled})
            return k

        CostTable.observe, AdaptiveK._rule = logged_observe, logged_rule

    def detach(self) -> None:
        """The classes' own methods back (the engines are closed)."""
        from specloop.engine._adaptive import AdaptiveK, CostTable  # noqa: PLC0415
        if self._originals is not None:
            CostTable.observe, AdaptiveK._rule = self._originals
            self._originals = None

    def mark(self, name: str, run: int, trace: dict | None = None) -> None:
        self.records.append({"c": name, "ev": "run", "run": run,
                             **({} if trace is None else {"ms_by_k": trace["ms_by_k"]})})

    def write(self, path: str, batch: int) -> None:
        with open(path, "a") as f:
            for r in self.records:
                f.write(json.dumps({"batch": batch, **r}) + "\n")
        self.records = []


async def measure_batch(names, loaded, sets, tokens, runs, device, buckets, steady=None,
                        learn_log=None):
    """``steady``: (the prompts to cycle, requests per run, spread of the lengths) for
    ``--arrival steady``; None: closed rounds, a run one round of each prompt set (a batch
    each) in turn. ``learn_log``: a LearnLog for the adaptive configs."""
    from specloop.engine import AsyncEngine
    prompts = sets[0]
    batch, sync = len(prompts), device_sync(device)
    rates = {name: [] for name in names}
    windows = {name: [] for name in names}      # steady: (seconds, tokens) per run
    traces = {name: RunTrace() for name in names}
    runs_traced = {name: [] for name in names}
    async with contextlib.AsyncExitStack() as stack:
        engines = {}
        for name in names:
            engines[name] = await stack.enter_async_context(
                AsyncEngine(engine_config(CONFIGS[name], batch, device, buckets), model=loaded,
                            observers=[traces[name]]))
            if learn_log is not None and engines[name].worker.adaptive is not None:
                learn_log.attach(name, engines[name].worker.adaptive)
        for name, engine in engines.items():
            # A whole round: adaptive K explores every K at each batch class in its first
            # iterations (FIRST_SAMPLES each, with eager catch-ups of the head after K = 0
            # stretches, whose kernels compile on first use); a 16-token warm-up left that
            # to the first timed run (batch 256: 31.8k tok/s against 84-89k after).
            await generate_round(engine, prompts, tokens)
            traces[name].take(0)
        for run in range(runs):
            # Each run starts one config further on: a config is not always the one
            # that follows the same other (what runs before it warms or disturbs it).
            order = names[run % len(names):] + names[:run % len(names)]
            for name in order:
                engine, before = engines[name], compiled_variants()
                if steady is None:
                    wall = await timed_sets(engine, sets, tokens, sync)
                    rates[name].append(batch * len(sets) * tokens / wall)
                else:
                    got = await steady_load(engine, steady.prompts, tokens, steady.in_flight,
                                            steady.requests, spread=steady.spread,
                                            detokenize=steady.detokenize)
                    rates[name].append(got["tok_s"])
                    windows[name].append((round(got["window_s"], 3), got["window_tokens"]))
                runs_traced[name].append(traces[name].take(
                    {kernel: len(keys) for kernel, keys in new_variants(before).items()}))
                if learn_log is not None:
                    learn_log.mark(name, run, runs_traced[name][-1])
        extra = {}
        for name, engine in engines.items():
            stats, adaptive = engine.stats, engine.worker.adaptive
            extra[name] = {
                "runs_traced": runs_traced[name],
                **({} if steady is None else {"requests": steady.requests, "spread": steady.spread,
                                              "window_s_tokens": windows[name]}),
                "al": round(stats.mean_acceptance_length, 3),
                "per_position": [round(a, 3) for a in stats.acceptance_per_position],
                "iterations_per_k": dict(sorted(stats.iterations_per_k.items())),
                "steps_queued_ahead": engine.worker.ahead.taken_steps,
                # DRAFT + VERIFY chained on the device and taken (engine/_chain.py).
                "chained_steps": 0 if engine.worker.chain is None
                else engine.worker.chain.taken_steps,
                # Chained steps queued, taken or not (the rest were dropped: a request
                # joined, as under steady load; the device ran them for nothing).
                "chained_queued": 0 if engine.worker.chain is None
                else engine.worker.chain.queued_steps,
                # Of them, queued at a smaller bucket than their iteration's (rows left).
                "chained_shrunk": 0 if engine.worker.chain is None
                else engine.worker.chain.shrunk_steps,
                # Adaptive K: measured iterations left out as disturbed (an admission in
                # them or the next one; engine/_adaptive.py FIRST_DISTURBED).
                "disturbed_ignored": None if adaptive is None else adaptive.cost.ignored,
                "cost_ms": None if adaptive is None else {
                    f"{b}/{k}": round(s * 1e3, 3) for (b, k), s in adaptive.cost.device.items()},
                "rest_ms": None if adaptive is None else {
                    b: round(s * 1e3, 3) for b, s in adaptive.cost.rest.items()},
                # T(b, k) as the rule last saw it (whole iterations, learned).
                "measured_ms": None if adaptive is None else {
                    f"{b}/{k}": round(s * 1e3, 3)
                    for (b, k), s in sorted(adaptive.cost.measured.items())},
                # What a K's first iteration after another K took beyond its time.
                "switch_ms": None if adaptive is None else {
                    f"{b}/{k}": round(s * 1e3, 3)
                    for (b, k), s in sorted(adaptive.cost.switch.items())}}
    return rates, extra


def run(args) -> None:
    quiet_logs()
    cuda = args.device == "cuda"
    names = args.configs.split(",")
    texts = held_out_texts(args.prompts)
    # Steady load draws its own requests (below); closed rounds go through the sets.
    closed = args.min_prompts if args.arrival == "closed" else None
    for loaded, batch, sets in held_out_sets(args, cycle=True, min_prompts=closed,
                                             min_rounds=args.min_rounds):
        start = time.perf_counter()
        steady = steady_setup(args, loaded.tokenizer, texts, batch)
        learn_log = LearnLog() if args.learn_log else None
        rates, extra = anyio.run(measure_batch, names, loaded, sets, args.tokens,
                                 args.runs, args.device, args.buckets, steady, learn_log)
        if learn_log is not None:
            learn_log.detach()
            learn_log.write(args.learn_log, batch)
        medians = {name: statistics.median(r) for name, r in rates.items()}
        others = [n for n in names if not n.startswith("adaptive")]
        for name in names:
            emit_row({"batch": batch, "config": name,
                      "tok_s": [round(r, 1) for r in rates[name]],
                      "median": round(medians[name], 1),
                      "vs_none": round(medians[name] / medians.get("none", medians[name]), 3),
                      **({"paired_vs_max": [round(x, 3) for x in paired_ratios(
                          rates, name, others)]}
                         if name.startswith("adaptive") and others else {}),
                      **extra[name], "tokens": args.tokens, "runs": args.runs,
                      "prompts_per_run": batch * len(sets) if steady is None else None,
                      "buckets": args.buckets, "arrival": args.arrival,
                      "device": torch.cuda.get_device_name() if cuda else "cpu"}, args.out)
        for name in names:
            if name.startswith("adaptive") and others:
                paired = paired_ratios(rates, name, others)
                print(f"batch {batch}: {name} / max(fixed, none) = "
                      f"{medians[name] / max(medians[n] for n in others):.3f} (medians); "
                      f"per run {statistics.median(paired):.3f} "
                      f"({min(paired):.3f}-{max(paired):.3f}) "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)


def paired_ratios(rates: dict[str, list[float]], name: str, others: list[str]) -> list[float]:
    """``name``'s tokens/s in each run over the best of ``others`` in the same run (the
    configs take turns within a run, so a run's ratio is what drift between runs, which
    spread one config's runs by up to 1.5x at batch >= 32 on the H200, leaves alone)."""
    return [rate / max(rates[n][i] for n in others) for i, rate in enumerate(rates[name])]


def plot(rows_path: str, png: str) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    rows = [json.loads(x) for x in open(rows_path)]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(dict.fromkeys(r["config"] for r in rows))
    for name in names:
        mine = sorted((r for r in rows if r["config"] == name), key=lambda r: r["batch"])
        xs = [r["batch"] for r in mine]
        ax.plot(xs, [r["median"] for r in mine], marker="o", label=name)
        ax2.plot(xs, [r["vs_none"] for r in mine], marker="o", label=name)
    for a, title in ((ax, "tokens/s (median)"), (ax2, "÷ no speculation")):
        a.set_xscale("log", base=2)
        a.set_xlabel("batch")
        a.set_title(title)
        a.grid(alpha=0.3)
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax.set_yscale("log")
    ax.legend()
    fig.suptitle("SmolLM2-135M bf16, H200, CUDA graphs, eagle3 head: adaptive K vs fixed K")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print("wrote", png)


def parser() -> argparse.ArgumentParser:
    """The command line (tests parse their arguments with it, so every option has its
    default there too)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default=HELD_OUT,
                    help="held-out prompts (default: the shipped bench/prompts_heldout.jsonl)")
    ap.add_argument("--out", default="adaptive_rows.jsonl")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--configs", default="none,K=3,K=5,adaptive<=3,adaptive<=5")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    ap.add_argument("--buckets", choices=("batch", "serving"), default="batch",
                    help="graph buckets: the batch only, or every power of two up to it")
    add_arrival_args(ap)
    ap.add_argument("--min-prompts", type=int, default=1,
                    help="closed: each run goes through at least this many prompts, as "
                         "ceil(N / batch) rounds of distinct prompts one after another (at "
                         "batch 1 one prompt's acceptance is not the head's: 16 or more)")
    ap.add_argument("--min-rounds", type=int, default=1,
                    help="closed: and at least this many rounds a run (a round at batch "
                         "32-64 is ~0.1-0.2 s on the H200: 4 keeps the runs' spread down; "
                         "past the prompts' count they repeat)")
    ap.add_argument("--learn-log", default="",
                    help="append what adaptive K learned and chose to this JSON-lines file")
    ap.add_argument("--plot", help="rows (JSON lines) to draw instead of measuring")
    ap.add_argument("--png", default="adaptive_h200.png")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.plot:
        plot(args.plot, args.png)
    else:
        run(args)


if __name__ == "__main__":
    main()
