"""The engine core in its own process (``ProcessEngine``) against the engine in this one
(``AsyncEngine``): tokens/s of each speculative config at each batch, all engines of a
batch open at once and taking turns run by run (drift hits all alike), with the host's
speed before each run (``host_python_us``).

Why: from batch ~2 a speculative iteration is host-bound on the H200, and from ~32 plain
decoding is too; about half the host's work an iteration is the front door's (each
request's consumer woken, detokenizing), which ``ProcessEngine`` moves to this process
(docs/performance-history.md, "The engine core in its own process").

    python bench/bench_process_gpu.py --out rows.jsonl [--configs "none,eagle3 K=3"]
        [--batches 1,32,64,128] [--runs 3] [--tokens 128] [--min-prompts 32]
        [--kinds process,process-pinned,in-process] [--consumer stream|batch] [--device cpu]
        [--buckets serving] [--min-rounds 4]
        [--arrival steady [--requests N] [--spread 0.5]] [--timers] [--core-timers]
        [--replicas 3] [--one-engine]

``--timers``: for each in-process engine, µs an iteration in adaptive K's calls and the
chained step's queueing (bench/_host_timers.py) and in each iteration state.
``--core-timers``: the same inside each ``ProcessEngine``'s core (``core_timers_us``,
``core_states_us``; bench/_host_timers.py ``CoreTimers``, an observer the core builds,
whose totals ride the stats the parent fetches): the host time of the engine as served,
without this process's front door in it.

``--kinds process-pinned``: a ``ProcessEngine`` whose core pins its loop thread
(``parallel.pin_host_cores = "on"``), taking turns with the unpinned one run by run.

``--one-engine``: one engine a config (and kind, replica) for every batch of
``--batches``, built for the largest and capped at each batch in turn
(``set_max_running``; ``sweep``): one engine start a config instead of one a batch.

``--arrival steady``: a run is steady load instead of closed rounds (a server's: ``batch``
requests in flight, a new one as each finishes; bench/_common.py ``steady_load``, as
bench_adaptive_gpu.py's), tokens/s over its window.

With an adaptive config among ``--configs`` ("eagle3 adaptive<=3") it also prints issue
13's ratio: adaptive over the best of the others, per kind.

Each row: one (batch, config, kind); ``vs_none`` its median over the same kind's first
config's median, ``vs_in_process`` over the in-process engine of the same config (runs
paired by order), ``al`` from the engine's (the core's) stats; an adaptive config's
``mix_vs_best``: its AL over its K mix's wall per iteration against the best fixed
config's AL over its own (what its choices are worth), and ``vs_mix``: its wall per
iteration over its K mix's at the fixed configs' beside it
(``adaptive_vs_mix``; each by the median of its runs' walls per iteration,
``iteration_ms_median``, where ``iteration_ms`` is all runs' wall over their iterations).
Under ``--arrival steady`` the counters, walls and core timers behind these are each run's
window's (``Window``), the iterations its tokens/s measure.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time

import anyio
import attrs

from _common import (add_arrival_args, add_round_args, device_sync, emit_row, engine_config,
                     generate_round, held_out_sets, held_out_texts, host_python_us,
                     quiet_logs, speed_row, steady_load, steady_setup)
from _host_timers import per_iteration
from profile_spec_gpu import CONFIGS


async def open_engines(stack, names, kinds, loaded, batch, device, buckets, core_log_level,
                       states=None, replicas=1, core_timers=False) -> dict:
    """-> {(name, kind, replica): engine}, each entered on ``stack``, built for ``batch``
    (its ``scheduler.max_batch_size`` and graph buckets). ``states``: {(name, kind):
    observer} for the in-process engines (``--timers``); the rest as ``measure``'s."""
    from specloop.engine import AsyncEngine, ProcessEngine  # noqa: PLC0415

    engines = {}
    for name in names:
        spec = {k: v for k, v in CONFIGS[name].items()
                if k not in ("unchained", "fixed_times", "twin")}
        config = engine_config(spec, batch, device, buckets)
        for kind in kinds:
            observers = [states[name, kind]] if states is not None else []
            for replica in range(1 if kind == "in-process" else replicas):
                engine = AsyncEngine(config, model=loaded, observers=observers) \
                    if kind == "in-process" \
                    else ProcessEngine(_pinned(_core_timed(config, core_timers), kind),
                                       log_level=core_log_level)
                engines[name, kind, replica] = await stack.enter_async_context(engine)
    return engines


async def sweep(per_batch, names, kinds, loaded, tokens, runs, device, consumer, buckets,
                core_log_level="warning", timers=None, replicas=1, core_timers=False,
                report=None) -> dict:
    """``--one-engine``: every batch of ``per_batch`` ([(batch, sets, steady)]) on the same
    engines, built once a config (and kind, replica) for the largest batch and capped at
    each one in turn (``set_max_running``): a config's process and host draw the same at
    every batch, and one engine start a config instead of one a batch (~15-20 s each on
    the H200, most of a sweep's time). ``report(batch, sets, steady, result)`` as each
    batch is done (a sweep cut short keeps the batches it measured). -> {batch:
    ``measure``'s result}."""
    from bench_host_overhead import StateTimes  # noqa: PLC0415

    states = {(name, kind): StateTimes() for name in names for kind in kinds}
    top = max(batch for batch, _, _ in per_batch)
    async with contextlib.AsyncExitStack() as stack:
        engines = await open_engines(stack, names, kinds, loaded, top, device, buckets,
                                     core_log_level, states if timers is not None else None,
                                     replicas, core_timers)
        results = {}
        for batch, sets, steady in per_batch:
            got = results[batch] = await measure(
                names, kinds, loaded, sets, tokens, runs, device, consumer, buckets, steady,
                core_log_level, timers, replicas, core_timers, engines=engines, states=states)
            if report is not None:
                report(batch, sets, steady, got)
        return results


async def measure(names, kinds, loaded, sets, tokens, runs, device, consumer, buckets,
                  steady=None, core_log_level="warning", timers=None, replicas=1,
                  core_timers=False, engines=None, states=None):
    """-> {(name, kind): (rates, AL, extra)}; every engine built and warmed first (a whole
    round: adaptive K explores its K values then), then ``runs`` runs in which the engines
    take turns, each run starting one engine further on. ``engines`` (``sweep``): open
    already, built for a larger batch and capped at this one here, with ``states`` their
    in-process observers. ``steady``: (prompts to cycle,
    requests a run, spread of the lengths): a run is steady load (``steady_load``), not
    closed rounds over ``sets``. ``core_log_level``: the ProcessEngine core's (its stderr;
    "info" shows adaptive K's ``adaptive_k`` events). ``timers``: a ``HostTimers``
    installed in this process: each in-process engine's time in its functions, and its
    iteration states' (observers), µs an iteration over its timed runs. ``replicas``:
    engines of each ProcessEngine kind per config (each core its own process, so its own
    draw of the host's speed), taking turns with the others; a key's rates are all its
    replicas' runs, replica after replica, and ``replica_medians`` each one's median.
    ``core_timers``: each ProcessEngine core times its own calls and states
    (``CoreTimers``), µs an iteration over the timed runs."""
    from bench_host_overhead import StateTimes  # noqa: PLC0415

    batch, sync = len(sets[0]), device_sync(device)
    out = {}
    if states is None:
        states = {(name, kind): StateTimes() for name in names for kind in kinds}
    spent: dict[tuple[str, str], dict[str, float]] = {}
    async with contextlib.AsyncExitStack() as stack:
        if engines is None:     # (name, kind, replica) -> engine
            engines = await open_engines(stack, names, kinds, loaded, batch, device, buckets,
                                         core_log_level,
                                         states if timers is not None else None, replicas,
                                         core_timers)
        else:
            for engine in engines.values():
                engine.set_max_running(batch)
        for engine in engines.values():
            await generate_round(engine, sets[0], tokens, consumer)
        for times in states.values():
            times.total_us.clear()
        walls = {key: [] for key in engines}
        run_iterations = {key: [] for key in engines}   # each run's iterations
        # key -> [(stats after, before) a run]: around the run, or its steady window
        counted: dict[tuple, list] = {key: [] for key in engines}
        lags: dict[tuple, list] = {}   # (name, kind) -> each steady run's [start, end] ms
        rates = {key: [] for key in engines}
        speeds = {key: [] for key in engines}
        keys = list(engines)
        for run in range(runs):
            for key in keys[run % len(keys):] + keys[:run % len(keys)]:
                engine = engines[key]
                speeds[key].append(host_python_us())
                sync()
                mark = timers.snapshot() if timers is not None else None
                # The counters (and the core's totals) around this run only (between its
                # runs the core idles in SCHEDULE, waiting on its pipe, which the totals
                # would count too); under steady load around its window only, not the
                # fill's and the drain's iterations.
                if steady is None:
                    run_mark = await _stats(engine)
                    start = time.perf_counter()
                    for prompts in sets:
                        await generate_round(engine, prompts, tokens, consumer)
                    sync()
                    wall = time.perf_counter() - start
                    pair = (await _stats(engine), run_mark)
                else:
                    window = Window(engine)
                    got = await steady_load(engine, steady.prompts, tokens, steady.in_flight,
                                            steady.requests, spread=steady.spread,
                                            on_mark=window.mark, detokenize=steady.detokenize)
                    sync()
                    wall, pair = window.span()
                    lags.setdefault(key[:2], []).append(
                        [window.lags_ms["start"], window.lags_ms["end"]])
                walls[key].append(wall)
                run_iterations[key].append(pair[0].num_iterations - pair[1].num_iterations)
                counted[key].append(pair)
                if mark is not None:
                    mine = spent.setdefault(key[:2], {})
                    for label, sec in timers.since(mark).items():
                        mine[label] = mine.get(label, 0.0) + sec
                rates[key].append(batch * len(sets) * tokens / walls[key][-1]
                                  if steady is None else got["tok_s"])
        merged = merge_replicas(keys, counted, rates, walls, speeds, run_iterations)
        for pair, (pair_rates, al, extra, iterations) in merged.items():
            out[pair] = (pair_rates, al, extra)
            if pair in lags:
                extra["window_lag_ms"] = lags[pair]
            if timers is not None and pair[1] == "in-process":
                extra["states_us"] = per_iteration(states[pair].total_us, iterations)
                extra["timers_us"] = per_iteration(spent.get(pair, {}), iterations, 1e6)
            if core_timers and pair[1] != "in-process":
                spent_core, states_core, moves_core = core_totals(keys, counted, pair)
                extra["core_timers_us"] = per_iteration(spent_core, iterations, 1e6)
                extra["core_states_us"] = per_iteration(states_core, iterations)
                extra["core_moves_us"] = per_move(moves_core)
    return out


def _core_timed(config, on: bool):
    """``config`` with the core's own timers among its observers (``--core-timers``)."""
    if not on:
        return config
    observers = (*config.components.observers, "_host_timers:CoreTimers")
    return attrs.evolve(config, components=attrs.evolve(config.components,
                                                        observers=observers))


def core_totals(keys, runs, pair) -> tuple[dict[str, float], dict[str, float],
                                           dict[str, list[float]]]:
    """(seconds in each timed call, µs in each state, [iterations, wall µs, µs waiting
    for the GPU, host-bound iterations] per move of K) the cores of ``pair``'s engines
    spent in the timed runs: the growth of ``CoreTimers``' totals on their stats over each
    run, or its steady window (``runs``: {key: [(after, before), ...]}), summed over the
    runs and the replicas."""
    calls: dict[str, float] = {}
    states: dict[str, float] = {}
    moves: dict[str, list[float]] = {}
    for key in keys:
        if key[:2] != pair:
            continue
        for after, before in runs.get(key, ()):
            for into, name in ((calls, "host_timers"), (states, "host_states_us")):
                then = getattr(before, name, {})
                for label, total in getattr(after, name, {}).items():
                    into[label] = into.get(label, 0.0) + total - then.get(label, 0.0)
            then = getattr(before, "host_moves_us", {})
            for move, totals in getattr(after, "host_moves_us", {}).items():
                none = [0] * len(totals)        # a move first seen in this run
                grown = [t - b for t, b in zip(totals, then.get(move, none))]
                moves[move] = [m + g for m, g in zip(moves.get(move, none), grown)]
    return calls, states, moves


def per_move(moves: dict[str, list[float]], least: int = 10) -> dict[str, dict[str, float]]:
    """Per move of K and class of rows ("K before>K@B") seen ``least`` times or more:
    iterations, the mean wall and wait for the GPU an iteration, µs, and the share of
    them that were host-bound (``CoreTimers``: waited < HOST_BOUND_US) (``core_totals``'
    moves)."""
    return {move: {"n": int(n), "wall": round(wall / n, 1), "wait": round(wait / n, 1),
                   "host_bound": round(bound / n, 3)}
            for move, (n, wall, wait, bound) in sorted(moves.items()) if n >= least}


def merge_replicas(keys, deltas, rates, walls, speeds, run_iterations=None):
    """-> {(name, kind): (rates, AL, extra, iterations)} from each engine's
    ``keys`` (name, kind, replica): its counters after and before each timed run, or its
    steady window (``deltas``: {key: [(stats, first), ...]}), its runs' tokens/s, walls
    (over the same spans) and host speeds (and
    iterations, ``run_iterations``). A pair's counters are summed over its replicas; its
    rates, walls and speeds listed replica after replica (``keys``' order);
    ``replica_medians`` where it has more than one. ``iteration_ms``: all its runs' wall
    over all their iterations (one slow run moves it); ``iteration_ms_runs`` each run's,
    and ``iteration_ms_median`` their median (what ``vs_mix`` compares: the runs'
    tokens/s are compared by medians too)."""
    counts: dict[tuple[str, str], list] = {}
    # Rows an iteration, run by run: under steady load the batch the window ran at (the
    # H200 at 256 in flight, fifty-fourth session: 148-236 rows, varying run to run, where
    # the client's replacements of finished requests lagged).
    rows: dict[tuple[str, str], list[float]] = {}
    for key in keys:
        got = counts.setdefault(key[:2], [0, 0, 0, 0, {}])
        run_rows = rows.setdefault(key[:2], [])
        for stats, first in deltas[key]:
            got[0] += stats.num_drafting_rows - first.num_drafting_rows
            got[1] += stats.num_accepted_tokens - first.num_accepted_tokens
            iterations = stats.num_iterations - first.num_iterations
            got[2] += iterations
            got[3] += stats.num_overlapped_iterations - first.num_overlapped_iterations
            for k, n in stats.iterations_per_k.items():
                got[4][k] = got[4].get(k, 0) + n - first.iterations_per_k.get(k, 0)
            if iterations > 0:
                run_rows.append(round((stats.num_verify_rows - first.num_verify_rows)
                                  / iterations, 1))
    merged = {}
    for pair, (drafting, accepted, iterations, overlapped, per_k) in counts.items():
        mine = [key for key in keys if key[:2] == pair]
        extra = {"host_python_us": [s for key in mine for s in speeds[key]],
                 # Which K the timed runs drafted (adaptive K's choices).
                 "iterations_per_k": dict(sorted(per_k.items())),
                 # Iterations whose step was queued ahead or chained (host and GPU
                 # overlapped; a one-token prompt joining a chained batch, or a K switch
                 # that cannot chain, breaks it).
                 "overlapped": round(overlapped / max(iterations, 1), 3),
                 "iteration_ms": round(sum(w for key in mine for w in walls[key]) * 1e3
                                       / max(iterations, 1), 3)}
        extra["rows_runs"] = rows[pair]
        if run_iterations is not None:
            per_run = [round(w * 1e3 / n, 3) for key in mine
                       for w, n in zip(walls[key], run_iterations[key]) if n]
            extra["iteration_ms_runs"] = per_run
            if per_run:
                extra["iteration_ms_median"] = round(statistics.median(per_run), 3)
        if len(mine) > 1:
            extra["replica_medians"] = [round(statistics.median(rates[key]), 1)
                                        for key in mine]
        merged[pair] = ([r for key in mine for r in rates[key]],
                        1 + accepted / drafting if drafting else None, extra, iterations)
    return merged


KINDS = ("process", "process-pinned", "in-process")


def _pinned(config, kind: str):
    """``process-pinned``: the core's loop thread on a core of its own
    (``parallel.pin_host_cores = "on"``); ``process``: the config's own setting."""
    if kind != "process-pinned":
        return config
    return attrs.evolve(config, parallel=attrs.evolve(config.parallel, pin_host_cores="on"))


async def _stats(engine):
    """A copy of the engine's counters (the core's, across the pipe)."""
    return await engine.fetch_stats()


class Window:
    """The engine's counters as a steady run's window opens and closes (``steady_load``'s
    ``on_mark``), each with the time its copy came: the iterations, K mix, AL and core
    timers of the window alone, which its tokens/s measure. Around the whole run they
    counted the fill and the drain too, where an adaptive engine drafts K = 0 as the
    batch empties (~10 % of its iterations at batch 256, the fifty-second session's
    ``h100_1206l_b32_256_before.jsonl``) and a fixed one its K: neither is in the
    window's tokens/s."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.marks: dict[str, tuple[float, object]] = {}
        self.lags_ms: dict[str, float] = {}

    async def mark(self, name: str) -> None:
        asked = time.perf_counter()
        stats = await _stats(self.engine)
        got = time.perf_counter()
        self.marks[name] = (got, stats)
        # How long the copy took to come (the core answers at its next SCHEDULE, behind
        # the outputs on its pipe): a late end mark counts drain iterations in the window.
        self.lags_ms[name] = round((got - asked) * 1e3, 2)

    def span(self) -> tuple[float, tuple[object, object]]:
        """-> (seconds between the two copies, (counters at the end, at the start))."""
        (t0, first), (t1, last) = self.marks["start"], self.marks["end"]
        return t1 - t0, (last, first)


def judged(name: str) -> bool:
    """Whether ``adaptive_vs_max`` judges the config against the others (an adaptive one,
    or a fixed one's ``twin``) rather than counting it among them."""
    return bool(CONFIGS[name].get("adaptive") or CONFIGS[name].get("twin"))


def fixed_k(name: str) -> tuple[str, int] | None:
    """(method, K) of a fixed config of CONFIGS ("none": K = 0 of any method), or None for
    one ``judged`` (an adaptive one, a twin: ``adaptive_vs_mix`` prices its iterations at
    the fixed configs')."""
    spec = CONFIGS[name]
    if judged(name):
        return None
    return ("", 0) if spec["method"] == "none" else (spec["method"], spec["num_draft_tokens"])


def same_method(name: str, fixed: dict[str, float]) -> list[tuple[int, str]]:
    """(K, config) of each fixed config among ``fixed``'s keys that runs ``name``'s method
    ("none": K = 0 of any method), in ``fixed``'s order."""
    method, found = CONFIGS[name]["method"], []
    for config in fixed:
        k = fixed_k(config)
        if k is not None and k[0] in ("", method):
            found.append((k[1], config))
    return found


def per_iteration_ms(extra: dict) -> float:
    """A row's wall per iteration: the median of its runs' where each run was counted
    (``iteration_ms_median``), else all runs' wall over their iterations."""
    return extra.get("iteration_ms_median", extra["iteration_ms"])


def mix_ms(name: str, per_k: dict, fixed_ms: dict[str, float]) -> float | None:
    """The wall per iteration of ``name``'s K mix (``per_k``, {"K": count}) at the same
    method's fixed configs' walls per iteration in the same process (``fixed_ms``:
    {config: ms}; K = 0 at "none"'s, which does not feed a head); None where a K of the mix
    has no fixed config beside it."""
    at = {k: fixed_ms[config] for k, config in same_method(name, fixed_ms)}
    counts = {int(k): n for k, n in per_k.items() if n}
    if not counts or any(k not in at for k in counts):
        return None
    return sum(at[k] * n for k, n in counts.items()) / sum(counts.values())


def adaptive_vs_mix(name: str, per_k: dict, iteration_ms: float,
                    fixed_ms: dict[str, float]) -> float | None:
    """An adaptive config's wall per iteration over its K mix's (``mix_ms``). Above 1:
    adaptive's iterations cost more than the same K values run by fixed engines (its own
    work, its switches, a K = 0 that feeds the head): what it loses in running its
    choices. None where a K of the mix has no fixed config beside it. (The twenty-fifth
    session's batch 32-128: 1.05-1.13, docs/performance-history.md, "Long steady
    windows".)"""
    mix = mix_ms(name, per_k, fixed_ms)
    return None if mix is None else round(iteration_ms / mix, 3)


def mix_vs_best(name: str, per_k: dict, al: float | None, fixed_ms: dict[str, float],
                fixed_al: dict[str, float | None]) -> float | None:
    """What an adaptive config's choices are worth: the tokens a row its iterations made
    (``al``, its drafting iterations'; 1 at K = 0) over its K mix's wall per iteration
    (``mix_ms``), against the best fixed config of its method's AL over its own wall per
    iteration ("none": 1 token). Below 1: its K values, run as the fixed engines run
    them, make fewer tokens a ms than the best one K; over ``vs_mix`` it is its rate an
    iteration over the best's (admissions and the runs' ends aside). None without AL or a
    complete mix."""
    mix = mix_ms(name, per_k, fixed_ms)
    rates = [(fixed_al.get(n) or 1.0) / fixed_ms[n]
             for _, n in same_method(name, fixed_ms) if fixed_ms[n]]
    if mix is None or al is None or not rates:
        return None
    # AL counts drafting rows only: a K = 0 iteration makes one token a row (its rows
    # taken as many as a drafting iteration's).
    total = sum(per_k.values())
    at_0 = sum(n for k, n in per_k.items() if int(k) == 0)     # keys: ints, or str in JSON
    made = (al * (total - at_0) + at_0) / total
    return round(made / mix / max(rates), 3)


def adaptive_vs_max(batch, kind, names, rates) -> None:
    """Issue 13's adaptive bar: each ``judged`` config's median over the best other
    config's median, and run by run (a run's adaptive over the best other in that run). A
    fixed config's twin, judged so, is what a rule that always drafts that K scores."""
    others = [n for n in names if not judged(n)]
    for name in names:
        if not judged(name) or not others:
            continue
        best_name = max(others, key=lambda n: statistics.median(rates[n]))
        best = statistics.median(rates[best_name])
        paired = [rate / max(rates[n][i] for n in others) for i, rate in enumerate(rates[name])]
        # Against the one config best by medians, run by run (the engines take turns, so
        # a run's host draw is shared): the median of those ratios is not lifted by
        # taking a maximum over noisy configs, as the first figure is.
        against = [rate / rates[best_name][i] for i, rate in enumerate(rates[name])]
        print(f"batch {batch} {kind}: {name} / max(others) = "
              f"{statistics.median(rates[name]) / best:.3f} (medians); runs "
              + " ".join(f"{p:.3f}" for p in paired)
              + f"; / {best_name} run by run: median {statistics.median(against):.3f}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_round_args(ap, batches="1,32,64,128")
    ap.add_argument("--configs", default="none,eagle3 K=3")
    ap.add_argument("--kinds", default="process,in-process",
                    help="of " + ", ".join(KINDS) + " (process-pinned: its core's loop "
                         "thread pinned, parallel.pin_host_cores = on)")
    ap.add_argument("--consumer", choices=("stream", "batch"), default="stream")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    ap.add_argument("--min-prompts", type=int, default=32)
    ap.add_argument("--min-rounds", type=int, default=1,
                    help="rounds a run at least (as many as the distinct prompts fill)")
    ap.add_argument("--buckets", choices=("batch", "serving"), default="batch",
                    help="graphs for the batch only, or for every power of two up to it")
    ap.add_argument("--core-log-level", default="warning",
                    help="the ProcessEngine core's log level (info: adaptive K's view, "
                         "an adaptive_k event every 256 choices, on stderr)")
    ap.add_argument("--timers", action="store_true",
                    help="in-process engines: µs an iteration in adaptive K's calls "
                         "(bench/_host_timers.py) and in each iteration state")
    ap.add_argument("--core-timers", action="store_true",
                    help="each ProcessEngine core: µs an iteration in its calls and states "
                         "(bench/_host_timers.py CoreTimers), over the timed runs")
    ap.add_argument("--one-engine", action="store_true",
                    help="one engine a config (and kind, replica) for every batch: built "
                         "for the largest and capped at each batch in turn "
                         "(set_max_running); one start a config instead of one a batch")
    ap.add_argument("--replicas", type=int, default=1,
                    help="ProcessEngines per config and kind (each core its own process: "
                         "the lent H200's host runs at one of two speeds a process, so one "
                         "core a config compares its draws as much as the configs)")
    add_arrival_args(ap)
    args = ap.parse_args()
    quiet_logs()
    timers = None
    if args.timers:
        from _host_timers import HostTimers  # noqa: PLC0415
        timers = HostTimers()
        timers.install()
    names, kinds = args.configs.split(","), args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:     # a misspelt kind would otherwise run as an unpinned ProcessEngine
        ap.error(f"--kinds: unknown {', '.join(unknown)} (known: {', '.join(KINDS)})")
    texts = held_out_texts(args.prompts)
    per_batch, loaded = [], None
    for loaded, batch, sets in held_out_sets(args, cycle=True, min_prompts=args.min_prompts,
                                             min_rounds=args.min_rounds):
        per_batch.append((batch, sets, steady_setup(args, loaded.tokenizer, texts, batch)))
    common = (names, kinds, loaded)
    rest = (args.tokens, args.runs, args.device, args.consumer, args.buckets)
    options = (args.core_log_level, timers, args.replicas, args.core_timers)
    report = functools.partial(report_batch, args, names, kinds)
    if args.one_engine:
        anyio.run(sweep, per_batch, *common, *rest, *options, report)
    else:
        for batch, sets, steady in per_batch:
            report(batch, sets, steady,
                   anyio.run(measure, *common, sets, *rest, steady, *options))


def report_batch(args, names, kinds, batch, sets, steady, got) -> None:
    """One batch's ``measure`` result: issue 13's ratios printed, a row a config and kind
    printed and appended to ``--out``."""
    for kind in kinds:
        base = statistics.median(got[names[0], kind][0])
        adaptive_vs_max(batch, kind, names, {n: got[n, kind][0] for n in names})
        fixed_ms = {n: per_iteration_ms(got[n, kind][2]) for n in names
                    if fixed_k(n) is not None}
        fixed_al = {n: got[n, kind][1] for n in fixed_ms}
        for name in names:
            rates, al, extra = got[name, kind]
            if fixed_k(name) is None:
                per_k = extra["iterations_per_k"]
                extra = {**extra,
                         "vs_mix": adaptive_vs_mix(name, per_k, per_iteration_ms(extra),
                                                   fixed_ms),
                         "mix_vs_best": mix_vs_best(name, per_k, al, fixed_ms, fixed_al)}
                print(f"batch {batch} {kind}: {name} ms an iteration / its K mix's at "
                      f"the fixed configs' = {extra['vs_mix']} (running its choices); "
                      f"its AL / its mix's ms against the best fixed config's = "
                      f"{extra['mix_vs_best']} (its choices)", flush=True)
            paired = None
            if kind != "in-process" and (name, "in-process") in got and args.replicas == 1:
                paired = [round(a / b, 3) for a, b in zip(rates, got[name, "in-process"][0])]
            emit_row(speed_row(batch, name, rates, base, al, args.tokens, args.device,
                               kind=kind, consumer=args.consumer, buckets=args.buckets,
                               arrival=args.arrival,
                               prompts_per_run=batch * len(sets) if steady is None
                               else steady.requests,
                               in_flight=None if steady is None else steady.in_flight,
                               one_engine=args.one_engine,
                               vs_in_process=paired, **extra), args.out)


if __name__ == "__main__":
    main()
