"""H200, real SmolLM2 (bf16, CUDA graphs): where a speculative iteration's time goes.

For each batch and configuration (no speculation, eagle3 K=2/3/5, n-gram K=4), in one process: tokens/s
over ``--runs`` timed rounds in which the configs take turns (ratio of medians to the first
config, and each run's ratio to the first config's run beside it; ``--min-prompts``: a
run goes through several batches of distinct prompts, one after another), time per iteration
state through the engine's observers, and one profiled round (torch.profiler, CPU + CUDA):
kernels, GPU busy time, graph launches, copies and host waits per iteration, the top
kernels by time, and every kernel's launches and time per iteration. Greedy (``--temperature``:
sampled, each request seeded), held-out chat prompts, EOS ignored. Rows go to --out (JSON lines).

    python bench/profile_spec_gpu.py --prompts prompts.jsonl --out rows.jsonl
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import time

import anyio
import torch

from _common import (TREES, add_round_args, critical_path_us, device_events, device_sync,
                     emit_row, engine_config, generate_round, held_out_sets, host_python_us,
                     quiet_logs, request_times, speed_row, timed_sets, union_us)

HEAD = "smollm2-135m-instruct-eagle3"
CONFIGS = {"none": {"method": "none"},
           "eagle3 K=1": {"method": "eagle3", "num_draft_tokens": 1, "draft_weights": HEAD},
           "eagle3 K=2": {"method": "eagle3", "num_draft_tokens": 2, "draft_weights": HEAD},
           "eagle3 K=3": {"method": "eagle3", "num_draft_tokens": 3, "draft_weights": HEAD},
           "eagle3 K=5": {"method": "eagle3", "num_draft_tokens": 5, "draft_weights": HEAD},
           "eagle3 adaptive<=3": {"method": "eagle3", "num_draft_tokens": 3,
                                  "draft_weights": HEAD, "adaptive": True},
           # The rule as before the fifty-first session: admissions' cost in X(b), charged
           # to every iteration (``speculative.adaptive_admissions``).
           "eagle3 adaptive<=3 x-admissions": {"method": "eagle3", "num_draft_tokens": 3,
                                               "draft_weights": HEAD, "adaptive": True,
                                               "adaptive_admissions": "per_iteration"},
           # The same engine as "eagle3 K=2", judged as a rule would be (bench_process_gpu.py
           # ``adaptive_vs_max``: over the best of the others): what a rule that always
           # drafts the best fixed K scores there, the bar's noise floor where K = 2 and 3
           # run level (batch 64-256 on the H100, fifty-second session).
           "eagle3 K=2 twin": {"method": "eagle3", "num_draft_tokens": 2,
                               "draft_weights": HEAD, "twin": True},
           # A run's second iteration after a switch learned as nothing, explored runs of
           # four (``speculative.adaptive_settling``; the lead from the fifty-first
           # session's batch 256: the rule priced K = 2 at 1.15 x K = 3 where fixed K = 2
           # iterated 25 % cheaper).
           "eagle3 adaptive<=3 settling": {"method": "eagle3", "num_draft_tokens": 3,
                                           "draft_weights": HEAD, "adaptive": True,
                                           "adaptive_settling": 1},
           # Adaptive K's machinery over fewer K values (``adaptive_k``): among {3} alone it
           # runs K = 3 every iteration; set beside "eagle3 K=3" and "adaptive<=3" they part
           # the machinery's own cost from the mix's.
           "eagle3 adaptive{3}": {"method": "eagle3", "num_draft_tokens": 3,
                                  "draft_weights": HEAD, "adaptive": True, "adaptive_k": [3]},
           # The same held at K = 1 or 2 (num_draft_tokens is always among the K values:
           # it is the K held): with PROCESS_CORE_LOG=info each logs the time the rule
           # learns for its K in a stretch (``adaptive_k``'s measured_ms) beside that K's
           # wall per iteration: what the learned times leave out (the prefill, disturbed
           # iterations) was the same per iteration at every K (X(b), engine/_adaptive.py).
           "eagle3 adaptive{1}": {"method": "eagle3", "num_draft_tokens": 1,
                                  "draft_weights": HEAD, "adaptive": True, "adaptive_k": [1]},
           "eagle3 adaptive{2}": {"method": "eagle3", "num_draft_tokens": 2,
                                  "draft_weights": HEAD, "adaptive": True, "adaptive_k": [2]},
           # Two K values: the switches' own cost (twenty-sixth session).
           "eagle3 adaptive{1+3}": {"method": "eagle3", "num_draft_tokens": 3,
                                    "draft_weights": HEAD, "adaptive": True,
                                    "adaptive_k": [1, 3]},
           "eagle3 adaptive{2+3}": {"method": "eagle3", "num_draft_tokens": 3,
                                    "draft_weights": HEAD, "adaptive": True,
                                    "adaptive_k": [2, 3]},
           "eagle3 adaptive{1+2+3}": {"method": "eagle3", "num_draft_tokens": 3,
                                      "draft_weights": HEAD, "adaptive": True,
                                      "adaptive_k": [1, 2, 3]},
           # n-gram (issue 12's batch-1 bar is at K = 4; adaptive: K = 0 .. 4 per iteration).
           "ngram K=4": {"method": "ngram", "num_draft_tokens": 4},
           "ngram adaptive<=4": {"method": "ngram", "num_draft_tokens": 4, "adaptive": True},
           # The same rule on warm-up's device times alone (nothing learned, no exploring):
           # what the rule chooses when its times are the GPU's.
           "ngram adaptive<=4 warm-up times": {"method": "ngram", "num_draft_tokens": 4,
                                               "adaptive": True, "fixed_times": True},
           # The same engine with DRAFT and VERIFY not chained on the device (before).
           "eagle3 K=3 unchained": {"method": "eagle3", "num_draft_tokens": 3,
                                    "draft_weights": HEAD, "unchained": True},
           # Sampled rows (--temperature): the chain verified by rejection sampling (the
           # others verify strictly: a tree's sampled rows, and the chain's beside it).
           "eagle3 K=3 rejection": {"method": "eagle3", "num_draft_tokens": 3,
                                    "draft_weights": HEAD, "use_rejection_sampling": True},
           # Draft trees of depth 3 (speculative.tree; unchained, as "K=3 unchained").
           **{f"eagle3 tree{n}": {"method": "eagle3", "num_draft_tokens": 3,
                                  "draft_weights": HEAD, "tree": tree}
              for n, tree in TREES.items()},
           # Adaptive K with a tree standing for K = 3 where a batch may draft it.
           **{f"eagle3 adaptive<=3 tree{n}": {"method": "eagle3", "num_draft_tokens": 3,
                                              "draft_weights": HEAD, "tree": tree,
                                              "adaptive": True}
              for n, tree in TREES.items()}}
RUNTIME = ("cudaGraphLaunch", "cudaLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize",
           "cudaEventSynchronize", "cudaDeviceSynchronize", "cuLaunchKernel",
           "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaEventRecord", "cudaEventQuery",
           "cudaStreamWaitEvent", "cudaMalloc", "cudaHostAlloc", "cudaFree")


@contextlib.asynccontextmanager
async def bench_engine(name, loaded, batch, device, buckets="batch", observers=()):
    """The engine of CONFIGS[name], with the bench's own switches applied: ``unchained``
    (DRAFT and VERIFY not chained on the device), ``fixed_times`` (adaptive K on warm-up's
    device times, nothing learned)."""
    from specloop.engine import AsyncEngine  # noqa: PLC0415
    spec = dict(CONFIGS[name])
    unchained = spec.pop("unchained", False)
    fixed_times = spec.pop("fixed_times", False)
    async with AsyncEngine(engine_config(spec, batch, device, buckets), model=loaded,
                           observers=list(observers)) as engine:
        if unchained:
            engine.worker.chain = None
        if engine.worker.adaptive is not None:
            engine.worker.adaptive.cost.learn = not fixed_times
        yield engine


def ahead_steps(ahead) -> tuple[int, int, int]:
    """Steps queued ahead so far: taken, fed by the graph, of those after a K = 0 step the
    chain queued."""
    return ahead.taken_steps, ahead.in_graph_steps, ahead.after_chain_steps


class StateTimes:
    """Each state's time summed over iterations, and per iteration (``rows``: its K and
    each state's microseconds, ``wait`` the read-back's wait for the GPU inside VERIFY)
    for ``by_move``."""

    def __init__(self):
        self.us = collections.defaultdict(float)
        self.iterations = 0
        self.rows: list[tuple[int, dict[str, float], tuple[str, ...]]] = []
        self._now: dict[str, float] = {}
        self._ids: tuple[str, ...] = ()

    def on_transition(self, event):
        self.us[event.state.value] += event.duration_us
        self.iterations += event.state.value.upper() == "VERIFY"
        if event.batch_size:
            self._now[event.state.value] = event.duration_us
            if event.request_ids:       # VERIFY's: which requests the iteration ran
                self._ids = event.request_ids
        if event.next_state.value == "DONE" and self._now:
            self.rows.append((event.num_draft_tokens, self._now, self._ids))
            self._now = {}

    def waited(self, seconds: float) -> None:
        self._now["wait"] = self._now.get("wait", 0.0) + seconds * 1e6

    def watch(self, runner) -> None:
        """Time the runner's read-back waits (the host idle, waiting for the GPU)."""
        finish = runner.finish_read_back

        def timed(pending):
            start = time.perf_counter()
            try:
                return finish(pending)
            finally:
                self.waited(time.perf_counter() - start)
        runner.finish_read_back = timed

    def by_move(self, least: int = 10, then: bool = False) -> dict:
        """Per move (the K before > this K) seen ``least`` times or more: the count and the
        median microseconds of each state, the read-back's wait, and the host's own time
        (the states less the wait), over ``rows``; an iteration pairs with the one before
        only when both ran the same requests (not across a new prompt, whose first
        iteration prefilled). ``then``: keyed by the K after it too ("0>0>4": the K = 0
        iteration that queued the chained K = 4 step, leaving a K = 0 stretch)."""
        per = collections.defaultdict(list)
        rows = self.rows
        after = [(r[0], r[2]) for r in rows[1:]] + [(None, ())]
        for (before, _, ids_before), (k, states, ids), (nxt, ids_next) in zip(
                rows, rows[1:], after[1:]):
            if ids and ids == ids_before and (not then or ids_next == ids):
                per[f"{before}>{k}" + (f">{nxt}" if then else "")].append(states)
        out = {}
        for move, rows in sorted(per.items()):
            if len(rows) < least:
                continue
            names = sorted({name for r in rows for name in r})
            med = {n: round(statistics.median(r.get(n, 0.0) for r in rows), 1) for n in names}
            med["host"] = round(statistics.median(
                sum(v for n, v in r.items() if n != "wait") - r.get("wait", 0.0)
                for r in rows), 1)
            out[move] = {"n": len(rows), **med}
        return out


def ops_outside_graphs(prof, per: int, frames: int = 8) -> list:
    """Host ops that launched device work themselves (kernels or copies outside any graph
    replay), grouped by the Python lines that called them: [op, launches per iteration,
    device us per iteration, specloop frames]. Needs a profile taken with_stack."""
    rows = []
    for e in prof.key_averages(group_by_stack_n=frames):
        if e.device_type != torch.autograd.DeviceType.CPU or not e.self_device_time_total:
            continue
        stack = [f for f in (e.stack or []) if "specloop" in f or "/bench/" in f]
        rows.append([e.key, round(e.count / per, 2), round(e.self_device_time_total / per, 1),
                     stack[:frames]])
    return sorted(rows, key=lambda r: -r[1])[:40]


def summarize_profile(prof, iterations, stacks=False):
    per = max(iterations, 1)
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    runtime = [e for e in prof.key_averages() if e.key in RUNTIME]
    calls = {e.key: e.count for e in runtime}
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]
    # Every kernel name with its launches and GPU time per iteration (where the count is).
    by_count = sorted(kernels, key=lambda e: -e.count)
    return {"kernels_per_iter": round(sum(e.count for e in kernels) / per, 1),
            # The kernels' summed durations; they overlap under PDL (a kernel starts while
            # the one before it runs), so this can exceed the iteration: the union of their
            # spans is the device's busy time.
            "gpu_busy_ms_per_iter": round(gpu_us / per / 1e3, 3),
            "gpu_union_ms_per_iter": round(union_us(device_events(prof.events())) / per / 1e3,
                                           3),
            # What each kernel (and copy) adds to that union, and the idle time before it:
            # the critical path's shares under PDL (``critical_path_us``).
            "critical_path_us_per_iter": critical_path_us(
                device_events(prof.events(), copies=True), per),
            "runtime_calls_per_iter": {k: round(v / per, 2) for k, v in calls.items()},
            # The host's time in them: a call that blocks for the GPU (a copy to pageable
            # memory) shows here, outside the read-back. Not cudaGraphLaunch's: under the
            # profiler a graph launch pays CUPTI's cost for each of its kernel nodes
            # (263-402 us an iteration at batch 1-2, where cProfile has ~20 us a replay).
            "runtime_us_per_iter": {e.key: round(e.cpu_time_total / per, 1) for e in runtime},
            "top_kernels_us_per_iter": {e.key[:60]: round(e.self_device_time_total / per, 1)
                                        for e in top},
            "kernels_by_count_per_iter": {
                e.key[:70]: [round(e.count / per, 2), round(e.self_device_time_total / per, 1)]
                for e in by_count},
            **({"ops_outside_graphs": ops_outside_graphs(prof, per)} if stacks else {})}


async def measure(names, loaded, sets, tokens, runs, traces, device="cuda", stacks=False,
                  buckets="batch", temperature=0.0):
    """Every config's engine is built and warmed first (all stay open), then ``runs`` timed
    runs in which the configs take turns (drift on a shared machine hits all alike), each
    run the prompt ``sets`` one round after another (one batch each), then one profiled
    round each (the first set). -> {name: (rates, AL, the profile's summary)}."""
    prompts = sets[0]
    batch, cuda, sync = len(prompts), device == "cuda", device_sync(device)
    out = {}
    async with contextlib.AsyncExitStack() as stack:
        engines, observers, observed, ahead_before = {}, {}, {}, {}
        for name in names:
            observers[name] = StateTimes()
            engines[name] = await stack.enter_async_context(bench_engine(
                name, loaded, batch, device, buckets, [observers[name]]))
            observers[name].watch(engines[name].worker.runner)
            adaptive = engines[name].worker.adaptive
            if adaptive is not None:
                observed[name] = record_observations(adaptive)
        for name, engine in engines.items():
            await generate_round(engine, prompts, 8, temperature=temperature)
            observers[name].us.clear()
            observers[name].iterations = 0
            observers[name].rows.clear()
            ahead_before[name] = ahead_steps(engine.worker.ahead)
            if name in observed:
                observed[name]["timed"] = len(observed[name]["seen"])
        walls = {name: [] for name in names}
        # Each request's submission, first and last output, outputs, its round's end: where
        # a closed round's wall goes beyond the steady iterations (``request_times``).
        request_log: dict = {name: [] for name in names}
        # The host's speed before each timed run (host_python_us): it differs by ~1.9x
        # between processes on the lent H200, and host-bound rows (batch >= 2 with
        # speculation) move with it.
        speeds = {name: [] for name in names}
        ahead_counts = {}
        for _ in range(runs):
            for name, engine in engines.items():
                speeds[name].append(host_python_us())
                walls[name].append(await timed_sets(engine, sets, tokens, sync, temperature,
                                                    request_log[name]))
        # Steps queued ahead in the timed runs (``chain_queued_taken``: the engine's whole
        # life, profiled round included).
        for name, engine in engines.items():
            ahead_counts[name] = [n - b for n, b in zip(ahead_steps(engine.worker.ahead),
                                                        ahead_before[name])]
        from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        for name, engine in engines.items():
            obs = observers[name]
            iters = max(obs.iterations, 1)
            states = {s: round(us / iters / 1e3, 3) for s, us in obs.us.items()}
            moves = obs.by_move()    # the timed runs' (batch 1: one row an iteration)
            moves_then = obs.by_move(then=True) if engine.worker.adaptive is not None else None
            wall_ms = sum(walls[name]) * 1e3 / iters
            # Both over the timed runs, before the profiled round adds its tokens.
            al = engine.stats.mean_acceptance_length
            per_position = [round(a, 3) for a in engine.stats.acceptance_per_position]
            # Adaptive K as the timed runs left it: the profiled round's iterations run
            # ~2x slower under the profiler and would be the times it learned last.
            chain, adaptive = engine.worker.chain, engine.worker.adaptive
            ks = None if adaptive is None else {
                "k_chosen": dict(sorted(adaptive.chosen.items())),
                "chain_k0_steps": None if chain is None else chain.k0_steps,
                **adaptive_state(adaptive), **observations(observed[name])}
            obs.iterations = 0
            with profile(activities=activities, with_stack=stacks) as prof:
                await generate_round(engine, prompts, 32, temperature=temperature)
                sync()
            summary = summarize_profile(prof, obs.iterations, stacks)
            if traces.get(name):
                prof.export_chrome_trace(traces[name])
            chained = None if chain is None else [chain.queued_steps, chain.taken_steps]
            out[name] = ([batch * len(sets) * tokens / w for w in walls[name]], al,
                         {"iteration_ms": round(wall_ms, 3), "host_python_us": speeds[name],
                          **request_times(request_log[name]),
                          "states_ms": states,
                          "per_position": per_position, "by_move_states_us": moves,
                          "by_move_then_states_us": moves_then,
                          "chain_queued_taken": chained,
                          "ahead_taken_in_graph": ahead_counts[name],
                          **(ks or {}), **summary})
    return out


def adaptive_state(adaptive) -> dict:
    """What adaptive K decided from: T(b, k) learned and at warm-up, switch costs (ms), and E(k) per
    draft class (the last: unclassed, every class's counts pooled)."""
    cost = adaptive.cost
    return {"t_ms": {f"{b},{k}": round(t * 1e3, 3) for (b, k), t in sorted(cost.measured.items())},
            "warmup_ms": {f"{b},{k}": round(t * 1e3, 3) for (b, k), t in sorted(cost.device.items())},
            "switch_ms": {f"{b},{k}": round(t * 1e3, 3)
                          for (b, k), t in sorted(cost.switch.items())},
            "e_by_class": [[round(e, 3) for e in adaptive._expected([adaptive._row([c])]).values()]
                           for c in range(adaptive.classes + 1)]}


def record_observations(adaptive) -> dict:
    """Every iteration time adaptive K's clock hands its rule (bucket, K, seconds,
    disturbed), learned or not (``cost.learn``): ``observations`` sums them up."""
    record = {"seen": [], "timed": 0, "learned": []}
    choose, observe = adaptive._choose, adaptive.cost.observe
    cost = adaptive.cost

    def observed_by_table(bucket, k, seconds, disturbed=False, switched=False,
                          leaving=False):
        # What the table made of it: a first sample, T's, a switch cost's, or ignored.
        key, ignored = (bucket, k), cost.ignored
        kind = "not learned" if not cost.learn or cost._device(bucket, k) is None else \
            "first" if not cost.tried(bucket, k) else \
            "switch" if switched or leaving else "T"
        observe(bucket, k, seconds, disturbed, switched, leaving)
        if cost.ignored > ignored:
            kind = "ignored"
        record["learned"].append((k, kind, seconds, cost.measured.get(key)))

    class Logged(type(cost)):   # the table is slotted: its class, not its attribute
        __slots__ = ()

        def observe(self, *args, **kw):
            observed_by_table(*args, **kw)
    cost.__class__ = Logged

    def observed(rows, measured_us, disturbed, padded_batch_size, full_us=0, tree=False):
        # Every choice's last iteration (the group's time, as ``_choose`` gets it), burning
        # in too, and an untimed one (None: the clock left it out, e.g. a step not queued
        # ahead) so that moves pair with the iteration really before.
        if adaptive._last is not None:
            record["seen"].append((*adaptive._last,
                                   measured_us / 1e6 if measured_us else None, disturbed))
        return choose(rows, measured_us, disturbed, padded_batch_size, full_us, tree)

    adaptive._choose = observed
    return record


def observations(record) -> dict:
    """The iteration times the clock measured: the engine's first 24 (warm-up round
    included: where the rule's first samples come from) and, per (bucket, K) over the
    timed runs' undisturbed iterations, count and 10th / 50th / 90th percentile (ms);
    ``by_move_ms`` the same per (the K before, this K), e.g. "0>4": a switch out of
    K = 0."""
    seen = record["seen"]
    per, moves = collections.defaultdict(list), collections.defaultdict(list)
    before = None
    for b, k, s, disturbed in seen[record["timed"]:]:
        if s is not None and not disturbed:
            per[f"{b},{k}"].append(s * 1e3)
            if before is not None:      # by the K before it: what a switch costs, where
                moves[f"{before}>{k}"].append(s * 1e3)
        before = k

    def spread(xs):
        xs = sorted(xs)
        return [len(xs)] + [round(xs[min(int(q * len(xs)), len(xs) - 1)], 3)
                            for q in (0.1, 0.5, 0.9)]

    kinds = collections.defaultdict(list)
    for k, kind, s, _ in record["learned"]:
        kinds[f"{k} {kind}"].append(s * 1e3)
    # T(b, 0)'s path (no drafting, chosen least at batch 1): (the sample, T after it)
    # for each sample it learned, in ms.
    path = [[round(s * 1e3, 3), round(t * 1e3, 3)] for k, kind, s, t in record["learned"]
            if k == 0 and kind in ("first", "T") and t is not None]
    timed = [(k, s, d) for _, k, s, d in seen if s is not None]
    return {"first_ms": [[k, round(s * 1e3, 3), int(d)] for k, s, d in timed[:24]],
            "learned_ms": {key: spread(xs) for key, xs in sorted(kinds.items())},
            "t0_path_ms": path[:300],
            "measured_ms": {key: spread(xs) for key, xs in sorted(per.items())},
            "by_move_ms": {key: spread(xs) for key, xs in sorted(moves.items())}}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_round_args(ap)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    ap.add_argument("--trace-dir", default="", help="chrome traces at batch 1 here")
    ap.add_argument("--buckets", choices=("batch", "serving"), default="batch",
                    help="graphs for the batch only, or for every power of two up to it "
                         "(a round's last iterations, with few rows left, replay small ones)")
    ap.add_argument("--stacks", action="store_true",
                    help="attribute device work launched outside graph replays to Python lines")
    ap.add_argument("--min-prompts", type=int, default=1,
                    help="each timed run goes through at least this many prompts, as "
                         "ceil(N / batch) rounds of distinct prompts one after another (at "
                         "batch 1 one prompt's acceptance is not the drafter's: 16 or more)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: sampled rows (request i seeded i), e.g. 0.7")
    ap.add_argument("--min-rounds", type=int, default=1,
                    help="and at least this many rounds a run (as many as the distinct "
                         "prompts fill)")
    args = ap.parse_args()
    quiet_logs()
    names = args.configs.split(",")
    for loaded, batch, sets in held_out_sets(args, min_prompts=args.min_prompts,
                                             min_rounds=args.min_rounds):
        traces = {name: f"{args.trace_dir}/trace_b{batch}_"
                        f"{name.replace(' ', '').replace('=', '')}.json"
                  for name in names} if args.trace_dir and batch == 1 else {}
        got = anyio.run(measure, names, loaded, sets, args.tokens, args.runs, traces,
                        args.device, args.stacks, args.buckets, args.temperature)
        base_rates = got[names[0]][0]
        for name in names:
            rates, al, prof = got[name]
            # Paired ratios: run r of this config over run r of the first (taken in turn).
            paired = [round(a / b, 3) for a, b in zip(rates, base_rates)]
            emit_row(speed_row(batch, name, rates, statistics.median(base_rates), al,
                               args.tokens, args.device, buckets=args.buckets,
                               prompts_per_run=batch * len(sets),
                               paired_vs_first=paired, temperature=args.temperature,
                               **prof),
                     args.out)
            # The profiled round's GPU time an iteration (the union of kernel spans): steadier
            # between processes than tokens/s, which moved +-20 % on the H200 (a table's
            # A/B read there, docs/performance-history.md "The down GEMM and 32-row blocks").
            if "gpu_union_ms_per_iter" in prof:
                print(f"gpu: batch {batch} {name}: {prof['gpu_union_ms_per_iter']} ms an "
                      f"iteration (AL {al:.3f})", flush=True)

if __name__ == "__main__":
    main()
