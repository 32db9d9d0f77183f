"""One GPU, real SmolLM2 weights: specloop against transformers in the same process.

specloop (paged cache, fused kernels, CUDA graphs) with and without n-gram speculation
(K=4) vs transformers with a static cache and ``torch.compile(mode="reduce-overhead")``:
bf16, greedy, chat prompts, N new tokens per request (EOS ignored), batch 1 / 8 / 64, each
measured ``--runs`` times, read by one ``generate`` per request and by one
``generate_batch`` (``--consumers``); a throughput curve over batch sizes; and torch.profiler's
kernels per layer, device syncs per iteration and GPU busy / wall at batch 1.

    python bench/bench_gpu_e2e.py --out results.json [--runs 3] [--tokens 256]

Every figure is appended to the JSON file as soon as it is measured (a run cut short
keeps what it had); ``bench/plot_curve.py`` draws the curve from it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import anyio
import torch

from _common import device_events, generate_round, quiet_logs, union_us

QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.",
             "Explain photosynthesis in two sentences.", "List three prime numbers.",
             "How do I reverse a list in Python?", "Tell me a fun fact about llamas.",
             "What causes rain?", "Give me a tip for learning guitar.")


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}],
            add_generation_prompt=True)
        out.append(tokenizer.encode(text))
    return out


DEVICE = "cuda"
STATE_TIMES = False
AHEAD_IN_GRAPH = True   # --ahead-copied: the step queued ahead copies its inputs in (A/B)


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def engine_config(name, batch, method="none", k=4):
    from specloop.engine import EngineConfig
    return EngineConfig.from_dict({
        "model": {"name": name, "dtype": "bfloat16", "device": DEVICE, "max_seq_len": 512},
        "scheduler": {"max_batch_size": batch, "max_num_tokens": 8192},
        "speculative": {"method": method, "num_draft_tokens": k if method != "none" else 4},
        "components": {"graph_cache": "cuda" if DEVICE == "cuda" else "eager"},
        "graphs": {"batch_buckets": [batch]}})




async def specloop_runs(name, loaded, prompts, tokens, runs, method="none", profile=None,
                        consumers=("stream",)):
    """{consumer: tok/s, ms/iteration and AL of ``runs`` timed rounds}, on one engine."""
    from specloop.engine import AsyncEngine
    by = {}
    async with AsyncEngine(engine_config(name, len(prompts), method), model=loaded) as engine:
        engine.worker.ahead.in_graph = AHEAD_IN_GRAPH
        await generate_round(engine, prompts, 8)  # warm-up
        for consumer in consumers:
            by[consumer] = await _timed(engine, prompts, tokens, runs, consumer)
        if profile is not None:
            profile.update(await _profile(engine, prompts, loaded.args.num_layers))
            # Issue 12's bar: the traced union of kernel spans (the device's busy time)
            # over each untraced run's iteration. The tracer slows the host, and more so
            # with PDL: on the H200 (2026-12-01) the device-only trace put a 300 us host gap
            # after each read-back with PDL launches and 9 us without, so its own wall
            # (gpu_busy_over_wall) measures the tracer. The summed kernel durations
            # (kernel_us_over_ms_iter) double-count under PDL, where a launched kernel
            # waits while the one before it runs.
            for key, traced in (("busy_over_untraced_ms_iter", "union_us_per_iteration"),
                                ("kernel_us_over_ms_iter", "kernel_us_per_iteration")):
                profile[key] = {
                    consumer: [round(profile[traced] / 1e3 / r["ms_iter"], 3) for r in rs]
                    for consumer, rs in by.items()}
    if profile is not None and STATE_TIMES:
        profile["state_us_per_iteration"] = await _state_times(name, loaded, prompts, method)
    return by


async def process_runs(name, prompts, tokens, runs):
    """``runs`` timed rounds (a ``generate`` task per request) on a ``ProcessEngine``: the
    engine core in a child process, which loads the model itself."""
    from specloop.engine import ProcessEngine
    out = []
    async with ProcessEngine(engine_config(name, len(prompts), "none")) as engine:
        await generate_round(engine, prompts, 8)  # warm-up
        for _ in range(runs):
            iterations = (await engine.fetch_stats()).num_iterations
            _sync()
            start = time.perf_counter()
            await generate_round(engine, prompts, tokens)
            _sync()
            wall = time.perf_counter() - start
            iterations = (await engine.fetch_stats()).num_iterations - iterations
            out.append({"tok_s": len(prompts) * tokens / wall,
                        "ms_iter": wall / max(iterations, 1) * 1e3})
    return out


class _StateTimes:
    """Each state's handler time summed over the iterations with requests (µs)."""

    def __init__(self):
        self.on, self.us, self.iterations = False, {}, 0

    def on_transition(self, event):
        if self.on and event.batch_size:
            self.us[event.state.value] = self.us.get(event.state.value, 0.0) + event.duration_us
            self.iterations += event.state.value == "RESCAN"


async def _state_times(name, loaded, prompts, method, tokens=64):
    """Where an iteration's wall time goes, per state, on a separate engine (an observer
    costs a little per transition), read by one ``generate_batch``: VERIFY's time is its
    queueing, the consumer's turn (the loop runs other tasks once) and the wait for the
    GPU that the host's work did not cover; the other states are the engine's host work."""
    from specloop.engine import AsyncEngine
    times = _StateTimes()
    config = engine_config(name, len(prompts), method)
    async with AsyncEngine(config, model=loaded, observers=[times]) as engine:
        await generate_round(engine, prompts, 8)
        times.on = True
        await generate_round(engine, prompts, tokens, "batch")
    return {k: round(v / max(1, times.iterations), 1) for k, v in times.us.items()}


async def _timed(engine, prompts, tokens, runs, consumer):
    out = []
    for _ in range(runs):
        _sync()
        it0, acc0 = engine.stats.num_iterations, engine.stats.num_accepted_tokens
        rows0 = engine.stats.num_verify_rows
        chain = engine.worker.chain     # DRAFT + VERIFY chained on the device, or None
        taken0 = chain.taken_steps if chain is not None else 0
        ahead = engine.worker.ahead     # steps queued ahead with inputs the graph wrote
        in_graph0 = ahead.in_graph_steps
        start = time.perf_counter()
        await generate_round(engine, prompts, tokens, consumer)
        _sync()
        wall = time.perf_counter() - start
        iters = engine.stats.num_iterations - it0
        al = 1 + (engine.stats.num_accepted_tokens - acc0) / max(
            1, engine.stats.num_verify_rows - rows0)
        chained = (chain.taken_steps - taken0) / iters if chain is not None else 0.0
        out.append({"tok_s": len(prompts) * tokens / wall, "ms_iter": wall / iters * 1e3,
                    "al": al, "chained": round(chained, 3),
                    "ahead_in_graph": round((ahead.in_graph_steps - in_graph0) / iters, 3)})
    return out


async def _profile(engine, prompts, num_layers, tokens=64):
    """Kernels per layer and syncs per iteration (torch.profiler, CPU and CUDA), then GPU
    busy / wall and where the GPU idles, from a second round traced on the device only
    (recording every CPU op slows the host by ~20%, which shows as GPU idle time)."""
    from torch.profiler import ProfilerActivity
    full, wall, iters = await _traced(engine, prompts, tokens,
                                      [ProfilerActivity.CPU, ProfilerActivity.CUDA])
    events = full.events()
    kernels = device_events(events)
    sync_names = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                  "cudaMemcpy")
    syncs = sum(1 for e in events if e.name in sync_names)
    out = {"iterations": iters, "kernels_per_iteration": len(kernels) / iters,
           "kernels_per_layer": len(kernels) / iters / num_layers,
           "syncs_per_iteration": syncs / iters,
           "gpu_busy_over_wall_cpu_traced": union_us(kernels) / 1e6 / wall,
           "ms_iter_cpu_traced": wall / iters * 1e3,
           "top_kernels": _top(kernels, iters)}
    # On the CPU (the script's smoke) there is no device to trace: the keys come out 0.
    lean, wall, iters = await _traced(engine, prompts, tokens, [
        ProfilerActivity.CUDA if DEVICE == "cuda" else ProfilerActivity.CPU])
    out.update(_idle(lean.events(), wall, iters))
    return out


async def _traced(engine, prompts, tokens, activities):
    """One round of ``tokens`` steps under torch.profiler -> (profile, wall s, iterations)."""
    from torch.profiler import profile
    await generate_round(engine, prompts, 8)
    _sync()
    it0 = engine.stats.num_iterations
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        await generate_round(engine, prompts, tokens)
        _sync()
        wall = time.perf_counter() - start
    return prof, wall, engine.stats.num_iterations - it0


GAP_BUCKETS_US = (1, 2, 5, 20, 100)


def _idle(events, wall, iters):
    """GPU busy / wall (kernels; kernels and copies) and the device's idle gaps between
    consecutive events, by size (per iteration) and the largest by the kernels around
    them: short gaps inside a captured graph are its launch latency, long ones a wait for
    the host."""
    kernels, every = device_events(events), device_events(events, copies=True)
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in every)
    counts = [0] * (len(GAP_BUCKETS_US) + 1)
    totals = [0.0] * (len(GAP_BUCKETS_US) + 1)
    pairs: dict[tuple[str, str], list[float]] = {}
    end, before = None, ""
    for s, e, name in spans:
        if end is not None and s > end:
            gap = s - end
            i = next((i for i, b in enumerate(GAP_BUCKETS_US) if gap < b),
                     len(GAP_BUCKETS_US))
            counts[i] += 1
            totals[i] += gap
            if gap >= 5:
                pairs.setdefault((before[:50], name[:50]), []).append(gap)
        if end is None or e > end:
            end, before = e, name
    labels = [f"<{b}us" for b in GAP_BUCKETS_US] + [f">={GAP_BUCKETS_US[-1]}us"]
    largest = sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:8]
    return {"gpu_busy_over_wall": union_us(kernels) / 1e6 / wall,
            "gpu_busy_over_wall_with_copies": union_us(every) / 1e6 / wall,
            "ms_iter_profiled": wall / iters * 1e3,
            "union_us_per_iteration": union_us(kernels) / iters,
            "kernel_us_per_iteration": sum(e.time_range.elapsed_us() for e in kernels) / iters,
            "gaps_per_iteration": {lab: [round(c / iters, 1), round(t / iters, 1)]
                                   for lab, c, t in zip(labels, counts, totals)},
            "largest_gaps": [{"after": a, "before": b, "per_iter": len(g) / iters,
                              "us_per_iter": round(sum(g) / iters, 1)}
                             for (a, b), g in largest]}


def _top(kernels, iters, n=12):
    by = {}
    for e in kernels:
        c, t = by.get(e.name, (0, 0.0))
        by[e.name] = (c + 1, t + e.time_range.elapsed_us())
    rows = sorted(by.items(), key=lambda kv: -kv[1][1])[:n]
    return [{"name": k[:80], "per_iter": c / iters, "us_per_iter": t / iters}
            for k, (c, t) in rows]


def _ratios(none, ngram):
    """Per consumer: n-gram tok/s over no speculation's (medians of the runs, and the
    range of run-by-run ratios), and the same over n-gram's AL (the bar: >= 0.8 x AL)."""
    out = {}
    for consumer, runs in ngram.items():
        base = statistics.median(r["tok_s"] for r in none[consumer])
        rates = [r["tok_s"] / n["tok_s"] for r, n in zip(runs, none[consumer])]
        al = statistics.mean(r["al"] for r in runs)
        ratio = statistics.median(r["tok_s"] for r in runs) / base
        out[consumer] = {"ratio": round(ratio, 3), "al": round(al, 3),
                         "ratio_over_al": round(ratio / al, 3),
                         "run_ratios_over_al": [round(x / al, 3) for x in rates]}
    return out


def _system(consumer):
    return "specloop" if consumer == "stream" else f"specloop ({consumer} consumer)"


def hf_model(path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    if DEVICE == "cuda":
        # generate() compiles the forward itself with a static cache; its CompileConfig's
        # mode is "reduce-overhead" (CUDA graphs). Wrapping forward in torch.compile by hand
        # instead trips over cudagraph-owned outputs.
        from transformers import CompileConfig
        model.generation_config.compile_config = CompileConfig(mode="reduce-overhead")
    else:
        model.generation_config.disable_compile = True
    return model


def hf_runs(model, prompts, tokens, runs):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts], device=DEVICE)
    mask = (torch.arange(width, device=DEVICE)[None] >= torch.tensor(
        [width - len(p) for p in prompts], device=DEVICE)[:, None]).long()
    kw = dict(attention_mask=mask, do_sample=False, cache_implementation="static")
    with torch.inference_mode():
        for _ in range(2):  # compile + capture for this shape
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
        out = []
        for _ in range(runs):
            _sync()
            start = time.perf_counter()
            gen = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
            _sync()
            wall = time.perf_counter() - start
            assert gen.shape[1] - width == tokens
            out.append({"tok_s": len(prompts) * tokens / wall})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--curve", default="1,2,4,16,32,128,256")
    ap.add_argument("--hf-curve", default="256")
    ap.add_argument("--process-curve", default="",
                    help="batch sizes the curve also runs on a ProcessEngine (the engine core "
                    "in its own process; system specloop-process)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--profile-batches", default="1",
                    help="batch sizes profiled (kernels, syncs, GPU busy)")
    ap.add_argument("--state-times", action="store_true",
                    help="at the profiled batch sizes, also each state's time per iteration")
    ap.add_argument("--hf-batches", default=None,
                    help="batch sizes transformers runs at (default: --batches)")
    ap.add_argument("--consumers", default="stream,batch",
                    help="stream: a generate task per request; batch: one generate_batch")
    ap.add_argument("--methods", default="none,ngram", help="none and/or ngram (K=4)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    ap.add_argument("--ahead-copied", action="store_true",
                    help="the step queued ahead always copies its inputs in (as before the "
                    "K = 0 graph wrote them itself): an A/B of that change")
    args = ap.parse_args()
    global DEVICE, STATE_TIMES, AHEAD_IN_GRAPH
    DEVICE, STATE_TIMES = args.device, args.state_times
    AHEAD_IN_GRAPH = not args.ahead_copied
    quiet_logs()
    from specloop.models import load_model, resolve_model_path
    path = resolve_model_path(args.model)
    loaded = load_model(path, dtype=torch.bfloat16, device=DEVICE)
    results = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
               "tokens": args.tokens, "runs": args.runs, "ahead_copied": args.ahead_copied,
               "rows": []}

    def record(**row):
        results["rows"].append(row)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(json.dumps(row), flush=True)

    hf = None if args.skip_hf else hf_model(path)
    consumers = tuple(args.consumers.split(","))
    hf_batches = {int(b) for b in (args.hf_batches or args.batches).split(",") if b}
    profile_batches = {int(b) for b in args.profile_batches.split(",") if b}
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = chat_prompts(loaded.tokenizer, batch)
        measured = {}
        for method in args.methods.split(","):
            prof = {} if batch in profile_batches else None
            by = measured[method] = anyio.run(specloop_runs, args.model, loaded, prompts,
                                              args.tokens, args.runs, method, prof, consumers)
            for consumer, runs in by.items():
                record(system=_system(consumer), method=method, batch=batch, runs=runs)
            if prof is not None:
                record(system="specloop", method=method, batch=batch, profile=prof)
        if "none" in measured and "ngram" in measured:
            record(system="summary", method="ngram / none", batch=batch,
                   ratios=_ratios(measured["none"], measured["ngram"]))
        if hf is not None and batch in hf_batches:
            record(system="transformers", method="compiled", batch=batch,
                   runs=hf_runs(hf, prompts, args.tokens, args.runs))
    for batch in [int(b) for b in args.curve.split(",") if b]:
        prompts = chat_prompts(loaded.tokenizer, batch)
        record(system="specloop", method="none", batch=batch, curve=True,
               runs=anyio.run(specloop_runs, args.model, loaded, prompts, args.tokens, 1)[
                   "stream"])
    for batch in [int(b) for b in args.process_curve.split(",") if b]:
        prompts = chat_prompts(loaded.tokenizer, batch)
        record(system="specloop-process", method="none", batch=batch, curve=True,
               runs=anyio.run(process_runs, args.model, prompts, args.tokens, 1))
    for batch in [int(b) for b in args.hf_curve.split(",") if b]:
        if hf is not None:
            prompts = chat_prompts(loaded.tokenizer, batch)
            record(system="transformers", method="compiled", batch=batch, curve=True,
                   runs=hf_runs(hf, prompts, args.tokens, 1))


if __name__ == "__main__":
    main()
