"""H200/H100, real SmolLM2 (bf16, CUDA graphs): where a batch-1 request's time to first
output goes.

profile_spec_gpu.py's rows give ``ttft_ms`` (submission → first output) beside
``ms_per_output`` (a steady iteration): at batch 1 a request's ttft less one iteration is
what admission costs it. This splits it, request by request over closed batch-1 rounds
of held-out chat prompts (greedy, EOS ignored), for each config in one process:

- ``door``: submission → the admitting SCHEDULE's prefill call (front door, exchange);
- ``hop_in`` / ``hop_out``: into and out of the prefill's worker thread;
- ``target`` / ``drafter``: the host's time in the target's and the drafter's prefill
  (launching graph replays, building inputs);
- ``target_gpu`` / ``drafter_gpu``: their device time (CUDA events around each);
- ``first_iter``: the prefill's end → the first output (the first iteration's states,
  ``states`` their medians);
- ``ttft`` and a steady ``per_output``, as profile_spec_gpu.py's.

All medians in µs; each config's rows in the prompts' order. Output: JSON lines.
``--spin-us U``: the loop's thread kept busy U µs before each request (a core slow to
come back from the last round's device sync would show as parts that shrink with it).
``--profile N``: N more requests a config under cProfile, the prefill's thread and the
event loop's side from the admission to the first iteration's RESCAN apart, their
functions by cumulative time written beside --out (``<out>.<config>.prof.txt``).

    python bench/probe_ttft_gpu.py --prompts prompts.jsonl --configs "none,eagle3 tree31"
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import contextlib
import io
import pstats
import statistics
import sys
import time

import anyio
import torch

from _common import (add_round_args, device_sync, emit_row, held_out_sets, quiet_logs,
                     request_times, timed_round, timed_sets)
from profile_spec_gpu import bench_engine


class Timeline:
    """Host timestamps (perf_counter seconds) of each admission's parts, CUDA events
    around the device work, and every state transition."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.admits: list[dict] = []
        self.transitions: list[tuple[str, float, float]] = []   # state, start, µs
        # With ``profiling``: cProfile of the prefill's thread and of the loop's side from
        # the admission to the first RESCAN after it (``loop_profile`` on while it runs).
        # From Python 3.12 a profiler sees every thread (sys.monitoring) and only one may
        # be on: the loop's then covers the thread too.
        self.profiling = False
        self.per_thread = sys.version_info < (3, 12)
        self.thread_profile, self.loop_profile = cProfile.Profile(), cProfile.Profile()
        self._loop_on = False
        # Host µs of each call ``time_calls`` wraps, made inside a prefill ("prefill:") or
        # between its end and the first RESCAN after it ("first:"), per request.
        self.calls: dict[str, list[float]] = collections.defaultdict(list)
        self._window: str | None = None

    def on_transition(self, event) -> None:
        self.transitions.append((event.state.value, event.started_at, event.duration_us))
        if event.state.value.upper() == "RESCAN":
            self._window = None
        if self._loop_on and event.state.value.upper() == "RESCAN":
            self.loop_profile.disable()
            self._loop_on = False

    def event(self):
        if not self.cuda:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def time_calls(self, obj, names: str, label: str) -> None:
        """Time ``obj``'s methods ``names`` (space-separated) when called inside a prefill;
        an object that takes no attributes (slotted) is left alone."""
        for name in names.split():
            fn = getattr(obj, name, None)
            if fn is None:
                continue

            def timed(*a, _fn=fn, _key=f"{label}.{name}", **kw):
                window = self._window
                if window is None:
                    return _fn(*a, **kw)
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    self.calls[f"{window}:{_key}"].append((time.perf_counter() - t0) * 1e6)
            try:
                setattr(obj, name, timed)
            except (AttributeError, TypeError):
                pass

    def watch(self, worker) -> None:
        admit, prefill = worker._admit, worker._prefill
        runner, drafter = worker.runner, worker.drafter

        async def timed_admit():
            start = time.perf_counter()
            n = len(self.admits)
            if self.profiling and worker.scheduler.num_requests and not self._loop_on:
                self.loop_profile.enable()
                self._loop_on = True
            admitted = await admit()
            if admitted and len(self.admits) > n:
                self.admits[-1].update(admit_start=start, admit_end=time.perf_counter())
            return admitted

        self.time_calls(runner, "to_device", "runner")
        if getattr(runner, "_prefill_staging", None) is not None:
            self.time_calls(runner._prefill_staging, "take copy_into", "ring")
        self.time_calls(runner.pages, "sync resize", "pages")
        if runner.prefill_cache is not None:
            self.time_calls(runner.prefill_cache, "replay", "cache")
        if drafter is not None:
            self.time_calls(drafter, "prefill_many _prefill_rows _prefill_into propose "
                            "propose_tree chained_inputs", "drafter")
            if getattr(drafter, "pending", None) is not None:
                self.time_calls(drafter.pending, "prompt", "pending")
        self.time_calls(worker, "_verify _queue_verify _collect_verify", "worker")

        # The worker's own prefill, the target's part marked where it returns.
        row: dict = {}
        target_prefill = runner.prefill_many

        def marked_target(*args, **kw):
            hidden = target_prefill(*args, **kw)
            row.update(target_end=time.perf_counter(), e1=self.event())
            return hidden

        def timed_prefill(admitted):
            if self.profiling and self.per_thread:
                self.thread_profile.enable()
            self._window = "prefill"
            row.clear()
            row.update(thread_start=time.perf_counter(), e0=self.event())
            prefill(admitted)
            row.update(thread_end=time.perf_counter(), e2=self.event(),
                       prompt=len(admitted[0].token_ids))
            self._window = "first"
            if self.profiling and self.per_thread:
                self.thread_profile.disable()
            self.admits.append(dict(row))

        runner.prefill_many = marked_target
        worker._admit = timed_admit
        worker._prefill = timed_prefill

    def profiles(self, top: int = 30) -> str:
        out = io.StringIO()
        parts = [("event loop, admission to the first RESCAN", self.loop_profile)]
        if self.per_thread:
            parts.insert(0, ("prefill thread", self.thread_profile))
        for title, prof in parts:
            out.write(f"== {title}\n")
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
        return out.getvalue()

    def clear(self) -> None:
        self.calls.clear()
        self.admits.clear()
        self.transitions.clear()


def split(timeline: Timeline, times: list) -> dict:
    """Each request's parts (µs; batch 1: admissions and requests pair in order)."""
    if len(timeline.admits) != len(times):
        raise RuntimeError(f"{len(timeline.admits)} admissions for {len(times)} requests")
    parts = collections.defaultdict(list)
    states = collections.defaultdict(list)
    for a, (submitted, first, *_) in zip(timeline.admits, times):
        us = lambda t0, t1: (t1 - t0) * 1e6  # noqa: E731
        parts["door"].append(us(submitted, a["admit_start"]))
        parts["hop_in"].append(us(a["admit_start"], a["thread_start"]))
        parts["target"].append(us(a["thread_start"], a["target_end"]))
        parts["drafter"].append(us(a["target_end"], a["thread_end"]))
        parts["hop_out"].append(us(a["thread_end"], a["admit_end"]))
        parts["first_iter"].append(us(a["admit_end"], first))
        parts["ttft"].append(us(submitted, first))
        parts["prompt"].append(a["prompt"])
        if a["e0"] is not None:
            parts["target_gpu"].append(a["e0"].elapsed_time(a["e1"]) * 1e3)
            parts["drafter_gpu"].append(a["e1"].elapsed_time(a["e2"]) * 1e3)
        # The states that ran between the prefill's end and the first output (the rest of
        # the admitting SCHEDULE included), summed per state.
        seen = collections.defaultdict(float)
        for state, start, dur in timeline.transitions:
            if a["admit_start"] <= start < first:
                seen[state] += dur
        for state, dur in seen.items():
            states[state].append(dur)
    med = statistics.median
    # Each timed call's µs a prefill (all its calls in the run over the prefills).
    calls = {k: [round(sum(v) / len(times), 1), round(len(v) / len(times), 2)]
             for k, v in timeline.calls.items()}
    return {**{k: round(med(v), 1) for k, v in parts.items()}, "calls": calls,
            "states": {k: round(med(v), 1) for k, v in states.items()}}


@torch.inference_mode()
def prefill_kernels(worker, width: int, reps: int = 10) -> dict:
    """The target's prefill graph at [1, ``width``] (warm-up's padding-row example)
    replayed ``reps`` times under torch.profiler: its device time a replay (CUDA events)
    and every kernel's launches and µs a replay, longest first; {"captured": False}
    where no graph holds that shape."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    runner = worker.runner
    cache = runner.prefill_cache
    found = [(key, example) for key, _, example in runner.prefill_graphs()
             if key.batch_size == 1 and key.tokens == width]
    if cache is None or not found or not cache.has(found[0][0]):
        return {"captured": False}
    key, example = found[0]
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        cache.replay(key, example)
    end.record()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            cache.replay(key, example)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    return {"captured": True, "replay_us": round(start.elapsed_time(end) * 1e3 / reps, 1),
            "kernels": {e.key[:70]: [round(e.count / reps, 2),
                                     round(e.self_device_time_total / reps, 1)]
                        for e in kernels}}


def spin(us: float) -> None:
    """Keep this thread busy for ``us`` µs (``--spin-us``)."""
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


async def measure(names, loaded, sets, tokens, runs, device="cuda", profile=0, spin_us=0.0):
    sync, out = device_sync(device), {}
    async with contextlib.AsyncExitStack() as stack:
        engines, timelines = {}, {}
        for name in names:
            timelines[name] = Timeline(device == "cuda")
            engines[name] = await stack.enter_async_context(bench_engine(
                name, loaded, 1, device, "batch", [timelines[name]]))
            timelines[name].watch(engines[name].worker)
        logs = {name: [] for name in names}
        parts = {name: [] for name in names}
        for _ in range(runs):
            for name, engine in engines.items():
                timelines[name].clear()
                times: list = []
                if spin_us:
                    for prompts in sets:
                        spin(spin_us)
                        await timed_round(engine, prompts, tokens, sync, 0.0, times)
                else:
                    await timed_sets(engine, sets, tokens, sync, 0.0, times)
                sync()
                parts[name].append(split(timelines[name], times))
                logs[name].extend(times)
        for name in names:
            runs_ = parts[name]
            row = {k: round(statistics.median(r[k] for r in runs_), 1)
                   for k in runs_[0] if k not in ("states", "calls")}
            row["calls"] = runs_[-1]["calls"]
            row["states"] = {k: round(statistics.median(r["states"].get(k, 0.0)
                                                        for r in runs_), 1)
                             for k in runs_[0]["states"]}
            row["per_run_ttft"] = [r["ttft"] for r in runs_]
            out[name] = {**row, **request_times(logs[name])}
        for name, engine in engines.items():
            if device == "cuda":
                # The median prompt's padded width (n = its length - 1 tokens prefilled).
                n = int(statistics.median(len(p[0]) for p in sets)) - 1
                width = max(16, 1 << (n - 1).bit_length())
                out[name]["prefill_graph"] = prefill_kernels(engine.worker, width)
            if profile:
                timelines[name].profiling = True
                await timed_sets(engine, (sets * profile)[:profile], tokens, sync)
                out[name]["profile"] = timelines[name].profiles()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    add_round_args(ap, batches="1")
    ap.add_argument("--configs", default="none,eagle3 tree31")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    ap.add_argument("--min-prompts", type=int, default=16)
    ap.add_argument("--spin-us", type=float, default=0.0,
                    help="keep the loop's thread busy this long before each request (after "
                         "the last round's device sync): if the parts shrink, the host's "
                         "core was slow to wake from that sync, not the calls themselves")
    ap.add_argument("--profile", type=int, default=0,
                    help="this many more requests a config under cProfile (text beside --out)")
    args = ap.parse_args()
    quiet_logs()
    names = args.configs.split(",")
    for loaded, batch, sets in held_out_sets(args, min_prompts=args.min_prompts):
        if batch != 1:
            raise SystemExit("probe_ttft_gpu.py splits batch-1 requests: --batches 1")
        got = anyio.run(measure, names, loaded, sets, args.tokens, args.runs, args.device,
                        args.profile, args.spin_us)
        for name in names:
            text = got[name].pop("profile", None)
            if text is not None:
                slug = "".join(c for c in name if c.isalnum())
                with open(f"{args.out}.{slug}.prof.txt", "w") as f:
                    f.write(text)
            emit_row({"config": name, "device": torch.cuda.get_device_name()
                      if args.device == "cuda" else args.device, **got[name]}, args.out)


if __name__ == "__main__":
    main()
