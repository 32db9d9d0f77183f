"""H200, real SmolLM2 (bf16, CUDA graphs): where a speculative iteration's time goes.

For each batch and configuration (no speculation, eagle3 K=2/3), in one process: tokens/s
over ``--runs`` timed rounds (ratio of medians to no speculation), time per iteration
state through the engine's observers, and one profiled round (torch.profiler, CPU + CUDA):
kernels, GPU busy time, graph launches, copies and host waits per iteration, and the top
kernels. Greedy, held-out chat prompts, EOS ignored. Rows go to --out (JSON lines).

    python bench/profile_spec_gpu.py --prompts prompts.jsonl --out rows.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import anyio
import torch

from _common import quiet_logs

HEAD = "smollm2-135m-instruct-eagle3"
CONFIGS = {"none": {"method": "none"},
           "eagle3 K=2": {"method": "eagle3", "num_draft_tokens": 2, "draft_weights": HEAD},
           "eagle3 K=3": {"method": "eagle3", "num_draft_tokens": 3, "draft_weights": HEAD}}
RUNTIME = ("cudaGraphLaunch", "cudaLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize",
           "cudaEventSynchronize", "cudaDeviceSynchronize", "cuLaunchKernel")


class StateTimes:
    def __init__(self):
        self.us = collections.defaultdict(float)
        self.iterations = 0

    def on_transition(self, event):
        self.us[event.state.value] += event.duration_us
        self.iterations += event.state.value.upper() == "VERIFY"


def summarize_profile(prof, iterations):
    per = max(iterations, 1)
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    calls = {e.key: e.count for e in prof.key_averages() if e.key in RUNTIME}
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]
    return {"kernels_per_iter": round(sum(e.count for e in kernels) / per, 1),
            "gpu_busy_ms_per_iter": round(gpu_us / per / 1e3, 3),
            "runtime_calls_per_iter": {k: round(v / per, 2) for k, v in calls.items()},
            "top_kernels_us_per_iter": {e.key[:60]: round(e.self_device_time_total / per, 1)
                                        for e in top}}


async def measure(spec, loaded, prompts, tokens, runs, trace, device="cuda"):
    from specloop.engine import AsyncEngine, EngineConfig  # noqa: PLC0415
    from specloop.samplers import SamplingParams  # noqa: PLC0415

    batch, cuda = len(prompts), device == "cuda"
    cfg = EngineConfig.from_dict({
        "model": {"name": "smollm2-135m-instruct", "device": device,
                  "dtype": "bfloat16" if cuda else "float32",
                  "max_seq_len": 1024, "chat_template": False},
        "scheduler": {"max_batch_size": batch}, "speculative": spec,
        "components": {"graph_cache": "cuda" if cuda else "eager"},
        "graphs": {"batch_buckets": [batch]}})
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    obs = StateTimes()
    async with AsyncEngine(cfg, model=loaded, observers=[obs]) as engine:
        async def round_(n):
            async def one(ids):
                params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                async for _ in engine.generate(ids, params):
                    pass
            async with anyio.create_task_group() as tg:
                for ids in prompts:
                    tg.start_soon(one, ids)

        await round_(8)
        rates, walls = [], []
        obs.us.clear()
        obs.iterations = 0
        for _ in range(runs):
            sync()
            start = time.perf_counter()
            await round_(tokens)
            sync()
            walls.append(time.perf_counter() - start)
            rates.append(batch * tokens / walls[-1])
        iters = max(obs.iterations, 1)
        states = {s: round(us / iters / 1e3, 3) for s, us in obs.us.items()}
        wall_ms = sum(walls) * 1e3 / iters
        al = engine.stats.mean_acceptance_length
        obs.iterations = 0
        from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            await round_(32)
            sync()
        prof_summary = summarize_profile(prof, obs.iterations)
        if trace:
            prof.export_chrome_trace(trace)
    return rates, al, {"iteration_ms": round(wall_ms, 3), "states_ms": states,
                       **prof_summary}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    ap.add_argument("--trace-dir", default="", help="chrome traces of eagle3 K=3 here")
    args = ap.parse_args()
    quiet_logs()
    from specloop.models import load_model  # noqa: PLC0415

    cuda = args.device == "cuda"
    loaded = load_model("smollm2-135m-instruct", device=args.device,
                        dtype=torch.bfloat16 if cuda else torch.float32)
    texts = [json.loads(x)["text"] for x in open(args.prompts)
             if json.loads(x)["split"] == "eval"]
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": t}])[:400]
                   for t in texts[:batch]]
        base = None
        for name in args.configs.split(","):
            trace = f"{args.trace_dir}/trace_b{batch}_{name.replace(' ', '').replace('=', '')}.json" \
                if args.trace_dir and batch == 1 else ""
            rates, al, prof = anyio.run(measure, CONFIGS[name], loaded, prompts, args.tokens,
                                        args.runs, trace, args.device)
            med = statistics.median(rates)
            base = base or med
            row = {"batch": batch, "config": name, "tok_s": [round(r, 1) for r in rates],
                   "median": round(med, 1), "vs_none": round(med / base, 3),
                   "al": round(al, 3) if al else None, "tokens": args.tokens, **prof,
                   "device": torch.cuda.get_device_name() if cuda else "cpu"}
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
