"""H200, real SmolLM2 (bf16, CUDA graphs): tokens/s with speculation / without, batch 1 and
32, greedy, held-out chat prompts (Debian fortunes split of a prompts.jsonl), EOS ignored.
Each config builds one engine, warms up, then runs ``--runs`` timed rounds; prints min-max
tokens/s, the ratio of medians to no speculation, and AL; appends rows to --out (JSON lines).

    python bench/bench_heads_gpu.py --prompts prompts.jsonl --out rows.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import anyio
import torch

from _common import quiet_logs

CONFIGS = {"none": {"method": "none"},
           "ngram K=4": {"method": "ngram", "num_draft_tokens": 4},
           "eagle3 K=2": {"method": "eagle3", "num_draft_tokens": 2,
                          "draft_weights": "smollm2-135m-instruct-eagle3"},
           "eagle3 K=3": {"method": "eagle3", "num_draft_tokens": 3,
                          "draft_weights": "smollm2-135m-instruct-eagle3"}}


async def measure(spec, loaded, prompts, tokens, runs, device):
    from specloop.engine import AsyncEngine, EngineConfig
    from specloop.samplers import SamplingParams
    batch = len(prompts)
    cfg = EngineConfig.from_dict({
        "model": {"name": "smollm2-135m-instruct", "device": device,
                  "dtype": "bfloat16" if device == "cuda" else "float32",
                  "max_seq_len": 1024, "chat_template": False},
        "scheduler": {"max_batch_size": batch}, "speculative": spec,
        "components": {"graph_cache": "cuda" if device == "cuda" else "eager"},
        "graphs": {"batch_buckets": [batch]}})
    rates = []
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    async with AsyncEngine(cfg, model=loaded) as engine:
        async def one(ids, n):
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            async for _ in engine.generate(ids, params):
                pass

        async def round_(n):
            async with anyio.create_task_group() as tg:
                for ids in prompts:
                    tg.start_soon(one, ids, n)
        await round_(8)
        for _ in range(runs):
            sync()
            start = time.perf_counter()
            await round_(tokens)
            sync()
            rates.append(batch * tokens / (time.perf_counter() - start))
        al = engine.stats.mean_acceptance_length
    return rates, al


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    args = ap.parse_args()
    quiet_logs()
    from specloop.models import load_model
    cuda = args.device == "cuda"
    loaded = load_model("smollm2-135m-instruct", device=args.device,
                        dtype=torch.bfloat16 if cuda else torch.float32)
    texts = [json.loads(x)["text"] for x in open(args.prompts)
             if json.loads(x)["split"] == "eval"]
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": t}])[:400]
                   for t in texts[:batch]]
        base = None
        for name, spec in CONFIGS.items():
            rates, al = anyio.run(measure, spec, loaded, prompts, args.tokens, args.runs,
                                  args.device)
            med = statistics.median(rates)
            base = base or med
            row = {"batch": batch, "config": name, "tok_s": [round(r, 1) for r in rates],
                   "median": round(med, 1), "vs_none": round(med / base, 3),
                   "al": round(al, 3) if al else None, "tokens": args.tokens,
                   "device": torch.cuda.get_device_name() if cuda else "cpu"}
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
