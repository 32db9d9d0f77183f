"""Shared bench helpers: quiet logging, timing, a memory-copy bandwidth probe, and the set-up
the SmolLM2 engine benches share (model, held-out chat prompts, engine config, timed rounds)."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import statistics
import sys
import threading
import time
from typing import NamedTuple

import anyio
import structlog
import torch

# The held-out prompts the GPU benches time by default (bench/held_out_prompts.py).
HELD_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts_heldout.jsonl")


# Draft trees of depth 3 for the shipped eagle3 head (speculative.tree), by node count:
# the trees that accept most on held-out prompts 200-263 (bench/tree_acceptance.py --skip
# 200 --prompts 64 --fit ...; bench/results/cpu_1204_tree_fit_200_263.json, and *_big
# for 23 and 31 nodes; cpu_1206_tree_fit_200_263_wide.json for 47, the most the tree
# attention's 63 rows take: AL 2.77 offline against 2.66 for 31 nodes; deeper trees of 31
# nodes, cpu_1206_tree_fit_200_263_deep.json: 2.73-2.76 at depth 4, 2.75-2.77 at 5, each
# level one more head forward, ~33 us of a 0.7 ms iteration on the H100).
TREES = {
    4: [[0], [1], [0, 0], [0, 0, 0]],
    7: [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]],
    11: [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1],
         [0, 1, 0]],
    15: [[0], [1], [2], [3], [4], [5], [0, 0], [0, 1], [0, 2], [1, 0], [2, 0], [0, 0, 0],
         [0, 0, 1], [0, 1, 0], [1, 0, 0]],
    23: [[0], [1], [2], [3], [4], [5], [6], [0, 0], [0, 1], [0, 2], [0, 3],
         [0, 4], [1, 0], [1, 1], [2, 0], [3, 0], [0, 0, 0], [0, 0, 1],
         [0, 0, 2], [0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0]],
    31: [[0], [1], [2], [3], [4], [5], [6], [7], [8], [0, 0], [0, 1], [0, 2],
         [0, 3], [0, 4], [0, 6], [1, 0], [1, 1], [1, 2], [2, 0], [2, 1],
         [3, 0], [4, 0], [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0],
         [0, 2, 0], [0, 4, 0], [1, 0, 0], [1, 0, 1], [2, 0, 0]],
    47: [[0], [1], [2], [3], [4], [5], [6], [7], [8], [9], [10], [12], [0, 0], [0, 1],
         [0, 2], [0, 3], [0, 4], [0, 5], [0, 6], [0, 7], [0, 8], [1, 0], [1, 1], [1, 2],
         [2, 0], [2, 1], [3, 0], [4, 0], [5, 0], [6, 0], [7, 0], [0, 0, 0], [0, 0, 1],
         [0, 0, 2], [0, 0, 3], [0, 0, 4], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 3, 0],
         [0, 4, 0], [1, 0, 0], [1, 0, 1], [1, 1, 0], [1, 2, 0], [2, 0, 0], [3, 0, 0]],
}


def device_seconds(fn, calls: int) -> float:
    """Device time a call of ``fn`` over ``calls`` calls in a row: CUDA events around
    them, the GPU drained first (nothing queued before is counted)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def quiet_logs() -> None:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def copy_bandwidth_gbs(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best-of-N memory copy rate, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def python_work() -> None:
    """A fixed pure-Python workload (dict and list work, as the engine's per-row host
    work): its time reads the host's speed, which on the lent H200 differs by ~1.9x
    between processes (bench/host_speed_probe.py)."""
    d: dict[int, list[int]] = {}
    for i in range(20000):
        d.setdefault(i % 64, []).append(i)
    sum(len(v) for v in d.values())


class BusyTorchThread:
    """A thread of small torch ops (a 64 x 64 multiply-add at a time, the GIL released
    in each and taken back), until ``stop``: what a rank's compute thread queueing the
    step run ahead does beside the loop thread."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        x = torch.randn(64, 64)
        while not self._stop.is_set():
            x = x * 1.0001 + 0.0001

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def median_seconds(fn, reps: int) -> float:
    """``fn()``'s median wall seconds over ``reps`` calls, after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def host_python_us(reps: int = 5) -> float:
    """``python_work``'s median µs over ``reps``: the host's speed now."""
    return round(median_seconds(python_work, reps) * 1e6, 1)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# --- SmolLM2 engine benches (bench_heads_gpu, bench_adaptive_gpu, profile_spec_gpu/_cpu,
# bench_drafters_speed): one copy of the set-up they share.

MODEL = "smollm2-135m-instruct"
PROMPT = "Tell me about llamas."


def load_smol(device: str):
    """SmolLM2 on ``device``: bf16 on CUDA, fp32 elsewhere (the CPU smoke modes)."""
    from specloop.models import load_model  # noqa: PLC0415
    return load_model(MODEL, device=device,
                      dtype=torch.bfloat16 if device == "cuda" else torch.float32)


def cpu_smol(threads: int):
    """Torch threads set (0: torch's default) and printed with the load average; SmolLM2
    fp32 on the CPU -> (loaded, chat-template ids of PROMPT)."""
    from specloop.models import load_model  # noqa: PLC0415
    if threads:
        torch.set_num_threads(threads)
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    loaded = load_model(MODEL, dtype=torch.float32)
    return loaded, loaded.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])


def held_out_texts(prompts_path: str) -> list[str]:
    """The texts of a prompts.jsonl's eval split."""
    with open(prompts_path) as f:
        rows = [json.loads(line) for line in f]
    return [r["text"] for r in rows if r["split"] == "eval"]


def chat_prompts(tokenizer, texts, batch: int, cycle: bool = False) -> list[list[int]]:
    """The first ``batch`` texts as chat-template ids (at most 400 each). With ``cycle`` the
    texts repeat to fill the batch; without, fewer texts give a smaller batch."""
    pool = texts * (batch // max(len(texts), 1) + 1) if cycle else texts
    return [tokenizer.encode_chat([{"role": "user", "content": t}])[:400] for t in pool[:batch]]


def engine_config(spec: dict, batch: int, device: str, buckets: str = "batch"):
    """One engine per (speculative config, batch): CUDA graphs on CUDA, eager elsewhere;
    the prompts are already chat-templated. ``buckets``: "batch" captures graphs for the
    batch size only (quick to build: every iteration replays at the full batch, also the
    last ones of a round when few rows are left); "serving" the engine's default buckets
    up to the batch (powers of two and the batch), as a server would run."""
    from specloop.engine import EngineConfig  # noqa: PLC0415
    cuda = device == "cuda"
    return EngineConfig.from_dict({
        "model": {"name": MODEL, "device": device,
                  "dtype": "bfloat16" if cuda else "float32",
                  "max_seq_len": 1024, "chat_template": False},
        "scheduler": {"max_batch_size": batch}, "speculative": spec,
        "components": {"graph_cache": "cuda" if cuda else "eager"},
        "graphs": {"batch_buckets": [batch] if buckets == "batch"
                   else [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < batch] + [batch]}})


def device_sync(device: str):
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


async def generate_round(engine, prompts, n: int, consumer: str = "stream",
                         temperature: float = 0.0, times: list | None = None) -> None:
    """Every prompt at once: greedy (``temperature`` > 0: sampled, request i seeded i),
    ``n`` tokens each, EOS ignored. consumer "stream": one ``generate`` task per request
    (a server's path); "batch": one ``generate_batch`` for all (a batch job's path, like
    transformers' ``generate``). ``times`` (stream only): each request's
    (submitted, first output, last output) ``perf_counter`` seconds and its count of
    outputs appended."""
    from specloop.samplers import SamplingParams  # noqa: PLC0415

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True,
                              seed=i if temperature else None)
    if consumer == "batch":
        async for _ in engine.generate_batch(prompts, params(0)):
            pass
        return

    async def one(i, ids):
        submitted = first = last = time.perf_counter()
        outputs = 0
        async for _ in engine.generate(ids, params(i)):
            last = time.perf_counter()
            outputs += 1
            if outputs == 1:
                first = last
        if times is not None:
            times.append((submitted, first, last, outputs))

    async with anyio.create_task_group() as tg:
        for i, ids in enumerate(prompts):
            tg.start_soon(one, i, ids)


async def timed_round(engine, prompts, n: int, sync, temperature: float = 0.0,
                      times: list | None = None) -> float:
    """Wall seconds of one generate_round, the device synchronized on both sides.
    ``times``: each request's (submitted, first output, last output, outputs, the round's
    end)."""
    sync()
    start = time.perf_counter()
    mine: list | None = [] if times is not None else None
    await generate_round(engine, prompts, n, temperature=temperature, times=mine)
    sync()
    end = time.perf_counter()
    if times is not None:
        times.extend((*t, end) for t in mine)
    return end - start


async def timed_sets(engine, sets, n: int, sync, temperature: float = 0.0,
                     times: list | None = None) -> float:
    """Wall seconds of one timed_round per prompt set, one after another (``times``: as
    timed_round's, every round's)."""
    wall = 0.0
    for prompts in sets:
        wall += await timed_round(engine, prompts, n, sync, temperature, times)
    return wall


def request_times(times: list) -> dict:
    """Where a closed round's wall goes, per request, from timed_round's ``times``
    (medians, ms): ``ttft_ms`` submitted → first output (the front door, admission,
    prefill, the first iteration), ``ms_per_output`` first → last output over the outputs
    after the first (an output an iteration that committed tokens), ``end_ms`` last
    output → the round's end (the generator's close, the task group, the device sync).
    At batch 1 they add up to the round's wall: what a request pays beyond its steady
    iterations is ``ttft_ms`` + ``end_ms`` less about one ``ms_per_output``."""
    if not times:
        return {}
    med = statistics.median
    return {"ttft_ms": round(med(f - s for s, f, _, _, _ in times) * 1e3, 3),
            "ms_per_output": round(med((la - f) / max(n - 1, 1)
                                       for _, f, la, n, _ in times) * 1e3, 4),
            "end_ms": round(med(e - la for _, _, la, _, e in times) * 1e3, 3)}


async def steady_load(engine, prompts, n: int, in_flight: int, requests: int,
                      spread: float = 0.0, seed: int = 0, on_mark=None,
                      detokenize: bool = True) -> dict:
    """Steady load (a server's, as vLLM's ``benchmark_serving --max-concurrency``): greedy,
    ``n`` tokens each, EOS ignored, one ``generate`` task per request; ``in_flight``
    requests at all times, a new one submitted (``prompts`` cycled) whenever one finishes,
    until ``requests`` were submitted. ``spread``: request j asks for
    round(n * (1 - spread + 2 * spread * u_j)) tokens, u_j uniform in [0, 1) from
    ``seed`` (the same lengths for every engine): with equal lengths, an engine without
    speculation finishes its rows together and the load is closed rounds without a tail;
    a server's requests end apart. Measured over the window from the ``in_flight``-th
    finish (every request then was submitted into a full engine) to the last submission
    (after it the engine drains: a closed round's tail): -> {"tok_s": tokens delivered in
    the window / its seconds, "window_s", "window_tokens", "requests"}. ``on_mark``: an
    async callable, started (not awaited: the submissions go on) with "start" and "end" as
    the window opens and closes, for what a bench counts over the window only (the
    engine's counters: its iterations there, not the fill's and the drain's).
    ``detokenize`` False: the requests ask for token ids only (``SamplingParams``), which
    is all this client reads: the front door's host time an output ~30 % less, so the
    client keeps up with a larger, faster batch."""
    from specloop.samplers import SamplingParams  # noqa: PLC0415

    if requests <= 2 * in_flight:   # the last submission comes at finish requests - in_flight
        raise ValueError(f"steady load needs more than 2 x {in_flight} requests, got {requests}")
    rng = random.Random(seed)
    lengths = [max(1, round(n * (1 - spread + 2 * spread * rng.random()))) if spread else n
               for _ in range(requests)]
    params = {m: SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True,
                                detokenize=detokenize) for m in set(lengths)}
    produced = finished = submitted = 0
    marks: dict[str, tuple[float, int]] = {}

    async def one(ids, m: int) -> None:
        nonlocal produced, finished
        async for out in engine.generate(ids, params[m]):
            produced += len(out.token_ids)
        finished += 1
        if finished == in_flight:
            marks["start"] = (time.perf_counter(), produced)
            if on_mark is not None:
                tg.start_soon(on_mark, "start")
        if submitted < requests:
            submit()

    async with anyio.create_task_group() as tg:
        def submit() -> None:
            nonlocal submitted
            tg.start_soon(one, prompts[submitted % len(prompts)], lengths[submitted])
            submitted += 1
            if submitted == requests:
                marks["end"] = (time.perf_counter(), produced)
                if on_mark is not None:
                    tg.start_soon(on_mark, "end")

        for _ in range(in_flight):
            submit()
    (t0, p0), (t1, p1) = marks["start"], marks["end"]
    return {"tok_s": (p1 - p0) / (t1 - t0), "window_s": t1 - t0, "window_tokens": p1 - p0,
            "requests": requests}


def device_events(events, copies: bool = False) -> list:
    """A profile's device events: kernels (and memcpy / memset with ``copies``)."""
    out = []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        copy = "memcpy" in e.name.lower() or "memset" in e.name.lower()
        if copies or not copy:
            out.append(e)
    return out


def union_us(events) -> float:
    """The union of the events' time ranges (us): the device's busy time. Not the sum of
    their durations: with Programmatic Dependent Launch a kernel starts (and waits in
    griddepcontrol.wait) while the one before it runs, so kernel spans overlap."""
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in sorted((e.time_range.start, e.time_range.end) for e in events):
        if cur_e is None or s > cur_e:
            busy += 0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + (0 if cur_e is None else cur_e - cur_s)


def critical_path_us(events, per: int, name_len: int = 60) -> dict:
    """Where the device's busy time goes when kernels overlap (PDL): events (kernels and
    copies) in order of start; each adds to the busy time only what it runs past the
    latest end before it (a kernel launched early waits in griddepcontrol.wait inside
    the kernel before it: that part adds nothing), and an idle stretch before it is
    charged to it apart. -> {name: [launches, added us, idle us before it]} per
    iteration, by added time; the added times sum to ``union_us``. Self device time
    (``top_kernels_us_per_iter``) counts a kernel's wait too."""
    rows: dict[str, list[float]] = {}
    spans = sorted((e.time_range.start, e.time_range.end, e.name[:name_len]) for e in events)
    frontier = spans[0][0] if spans else 0.0        # the first event: no idle before it
    for s, e, name in spans:
        row = rows.setdefault(name, [0, 0.0, 0.0])
        row[0] += 1
        row[2] += max(0.0, s - frontier)
        row[1] += max(0.0, e - max(s, frontier))
        frontier = max(frontier, e)
    per = max(per, 1)
    return {name: [round(n / per, 2), round(added / per, 1), round(idle / per, 1)]
            for name, (n, added, idle) in sorted(rows.items(), key=lambda kv: -kv[1][1])}


# Fewer distinct prompts a timed run than this measure those prompts' acceptance, not the
# drafter's (batch 1 on the first held-out prompt: eagle3 K = 3 AL 2.34 against 1.82 over 16).
FEW_PROMPTS = 16


def prompt_rounds(min_prompts: int, batch: int, min_rounds: int = 1) -> int:
    """Rounds of ``batch`` distinct prompts a timed run goes through: ceil(min_prompts /
    batch), at least ``min_rounds`` (a round at batch 32-64 lasts ~0.1-0.2 s on the H200,
    and one round a run spread the runs by +-8 %); says so on stderr when a run sees fewer
    than FEW_PROMPTS prompts."""
    rounds = max(1, -(-min_prompts // batch), min_rounds)
    if batch * rounds < FEW_PROMPTS:
        print(f"note: batch {batch} runs {batch * rounds} prompt(s) a timed run, so its "
              f"acceptance is theirs, not the drafter's (--min-prompts {FEW_PROMPTS})",
              file=sys.stderr, flush=True)
    return rounds


def emit_row(row: dict, out_path: str) -> None:
    """Print a result row and append it to ``out_path`` (JSON lines)."""
    print(json.dumps(row), flush=True)
    with open(out_path, "a") as f:
        f.write(json.dumps(row) + "\n")


def add_round_args(ap, batches: str = "1,32") -> None:
    """The options of the benches that time rounds over held-out prompts, one engine a config."""
    ap.add_argument("--prompts", default=HELD_OUT,
                    help="held-out prompts, JSON lines with a split (default: the shipped "
                         "bench/prompts_heldout.jsonl, bench/held_out_prompts.py)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batches", default=batches)


def add_arrival_args(ap) -> None:
    """``--arrival`` and its steady-load options (``steady_setup`` reads them)."""
    ap.add_argument("--arrival", choices=("closed", "steady"), default="closed",
                    help="closed rounds of `batch` prompts, or `batch` requests kept in flight")
    ap.add_argument("--requests", type=int, default=0,
                    help="steady: requests per run (0: max(STEADY_ROUNDS x batch, 32))")
    ap.add_argument("--steady-rounds", type=int, default=4,
                    help="steady, without --requests: requests per run as a multiple of the "
                         "batch (the timed window spans the finishes between the batch-th and "
                         "the last submission: (rounds - 2) x batch of them; at 4 and batch "
                         "32 that was ~0.2 s on the H200, and runs spread +-9 %%)")
    ap.add_argument("--spread", type=float, default=0.5,
                    help="steady: request lengths uniform in tokens x (1 +- spread)")
    ap.add_argument("--steady-queue", type=float, default=0.25,
                    help="steady: requests kept waiting beyond the batch, as a share of it "
                         "(0.25 at batch 256: 64 more in flight), so a finished row is "
                         "replaced from the engine's queue at its next iteration, not when "
                         "this process has handed the finish to its client and submitted "
                         "another (on the H200 at 256 in flight the batch ran at 148-236 "
                         "rows without, and runs spread +-5 %%; with 0.25 on an H100 "
                         "252-253 rows, +-1 %%); 0: the load before the fifty-fifth session")
    ap.add_argument("--steady-text", choices=("on", "off"), default="off",
                    help="steady: whether the requests ask for text (off: token ids only, "
                         "SamplingParams.detokenize=False, all the client reads; on the "
                         "H200 at 256 in flight the client, detokenizing, fell behind on a "
                         "slow host draw: 162-253 rows, fifty-eighth session); on: the "
                         "load before the fifty-eighth session")


class SteadySetup(NamedTuple):
    """A steady run's load, as ``steady_load`` takes it."""

    prompts: list           # the chat prompts to cycle
    requests: int           # requests a run
    spread: float           # of the lengths
    in_flight: int          # the batch and ``--steady-queue``'s share of it
    detokenize: bool = True     # ``--steady-text``


def steady_setup(args, tokenizer, texts: list[str], batch: int) -> SteadySetup | None:
    """``--arrival steady``: the run's load; None for closed rounds."""
    if args.arrival != "steady":
        return None
    requests = steady_requests(args, batch)
    return SteadySetup(chat_prompts(tokenizer, texts, requests, cycle=True), requests,
                       args.spread, batch + math.ceil(args.steady_queue * batch),
                       args.steady_text == "on")


def steady_requests(args, batch: int) -> int:
    """Requests a steady run submits: ``--requests``, else max(STEADY_ROUNDS x batch, 32)."""
    return args.requests or max(args.steady_rounds * batch, 32)


def speed_row(batch: int, name: str, rates, base: float, al, tokens: int, device: str,
              **extra) -> dict:
    """One (batch, config) row: tokens/s per round, the median and its ratio to ``base``."""
    med = statistics.median(rates)
    return {"batch": batch, "config": name, "tok_s": [round(r, 1) for r in rates],
            "median": round(med, 1), "vs_none": round(med / base, 3),
            "al": round(al, 3) if al else None, "tokens": tokens, **extra,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}


def held_out_sets(args, cycle: bool = False, min_prompts: int | None = None,
                  min_rounds: int = 1):
    """SmolLM2 on ``args.device``, then for each size in ``args.batches``: (loaded, batch,
    sets), ``sets`` batches of distinct held-out chat prompts from ``args.prompts`` for a
    timed run to go through one after another: one, or with ``min_prompts``
    prompt_rounds' count (``min_rounds`` at least; a last set short of ``batch`` dropped
    unless it is the only one; without ``cycle`` no more sets than the prompts fill)."""
    loaded = load_smol(args.device)
    texts = held_out_texts(args.prompts)
    for batch in [int(b) for b in args.batches.split(",")]:
        rounds = 1 if min_prompts is None else prompt_rounds(min_prompts, batch, min_rounds)
        pool = chat_prompts(loaded.tokenizer, texts, batch * rounds, cycle)
        sets = [pool[i:i + batch] for i in range(0, len(pool), batch)]
        if len(sets) > 1 and len(sets[-1]) < batch:
            sets.pop()
        yield loaded, batch, sets


def held_out_batches(args, cycle: bool = False):
    """SmolLM2 on ``args.device``, then for each size in ``args.batches``:
    (loaded, batch, that many held-out chat prompts from ``args.prompts``)."""
    for loaded, batch, sets in held_out_sets(args, cycle):
        yield loaded, batch, sets[0]
