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

    python bench/probe_ttft_gpu.py --prompts prompts.jsonl --configs "none,eagle3 tree31"
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import anyio
import torch

from _common import (add_round_args, device_sync, emit_row, held_out_sets, quiet_logs,
                     request_times, timed_sets)
from profile_spec_gpu import bench_engine


class Timeline:
    """Host timestamps (perf_counter seconds) of each admission's parts, CUDA events
    around the device work, and every state transition."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.admits: list[dict] = []
        self.transitions: list[tuple[str, float, float]] = []   # state, start, µs

    def on_transition(self, event) -> None:
        self.transitions.append((event.state.value, event.started_at, event.duration_us))

    def event(self):
        if not self.cuda:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def watch(self, worker) -> None:
        admit, prefill = worker._admit, worker._prefill
        runner, drafter = worker.runner, worker.drafter

        async def timed_admit():
            start = time.perf_counter()
            n = len(self.admits)
            admitted = await admit()
            if admitted and len(self.admits) > n:
                self.admits[-1].update(admit_start=start, admit_end=time.perf_counter())
            return admitted

        def timed_prefill(admitted):
            row = {"thread_start": time.perf_counter(), "e0": self.event()}
            hidden = runner.prefill_many(admitted)
            row.update(target_end=time.perf_counter(), e1=self.event())
            if drafter is not None:
                drafter.prefill_many([r.batch_slot for r in admitted],
                                     [r.token_ids[:-1] for r in admitted], hidden)
            row.update(thread_end=time.perf_counter(), e2=self.event(),
                       prompt=len(admitted[0].token_ids))
            self.admits.append(row)

        worker._admit = timed_admit
        worker._prefill = timed_prefill

    def clear(self) -> None:
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
    return {**{k: round(med(v), 1) for k, v in parts.items()},
            "states": {k: round(med(v), 1) for k, v in states.items()}}


async def measure(names, loaded, sets, tokens, runs, device="cuda"):
    sync, out = device_sync(device), {}
    import contextlib  # noqa: PLC0415
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
                await timed_sets(engine, sets, tokens, sync, 0.0, times)
                sync()
                parts[name].append(split(timelines[name], times))
                logs[name].extend(times)
        for name in names:
            runs_ = parts[name]
            row = {k: round(statistics.median(r[k] for r in runs_), 1)
                   for k in runs_[0] if k != "states"}
            row["states"] = {k: round(statistics.median(r["states"].get(k, 0.0)
                                                        for r in runs_), 1)
                             for k in runs_[0]["states"]}
            row["per_run_ttft"] = [r["ttft"] for r in runs_]
            out[name] = {**row, **request_times(logs[name])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    add_round_args(ap, batches="1")
    ap.add_argument("--configs", default="none,eagle3 tree31")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    ap.add_argument("--min-prompts", type=int, default=16)
    args = ap.parse_args()
    quiet_logs()
    names = args.configs.split(",")
    for loaded, batch, sets in held_out_sets(args, min_prompts=args.min_prompts):
        if batch != 1:
            raise SystemExit("probe_ttft_gpu.py splits batch-1 requests: --batches 1")
        got = anyio.run(measure, names, loaded, sets, args.tokens, args.runs, args.device)
        for name in names:
            emit_row({"config": name, "device": torch.cuda.get_device_name()
                      if args.device == "cuda" else args.device, **got[name]}, args.out)


if __name__ == "__main__":
    main()
