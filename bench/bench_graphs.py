"""GPU: SmolLM2-shaped decode iteration, CUDA-graph replay / eager, batch 1, 8, 64; and
speculative tokens/s / no speculation, same engine (n-gram, early exit, mtp_eagle).

Timing only: weights are random in SmolLM2's shape (30 layers, d=576, vocab 49152) unless
--model names a checkpoint. Run on the H200 machine:

    python bench/bench_graphs.py [--model smollm2-135m-instruct] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time

import anyio
import torch

from _common import quiet_logs

SMOLLM2_SHAPE = dict(vocab_size=49152, num_layers=30, hidden=576, num_heads=9,
                     num_kv_heads=3, intermediate=1536)


def config(path, dtype, batch, graphs, method="none", k=4, rejection=False):
    from specloop.engine import EngineConfig
    return EngineConfig.from_dict({
        "model": {"name": str(path), "dtype": dtype, "device": "cuda", "max_seq_len": 1024,
                  "chat_template": False},
        "scheduler": {"max_batch_size": batch},
        "speculative": {"method": method, "num_draft_tokens": k,
                        "use_rejection_sampling": rejection},
        "components": {"graph_cache": "cuda" if graphs else "eager"},
        "graphs": {"batch_buckets": [1, 8, 64]}})


async def tokens_per_s(cfg, loaded, batch, new_tokens, *, repetitive):
    from specloop.engine import AsyncEngine
    from specloop.samplers import SamplingParams
    base = [11, 12, 13, 14, 15, 16, 17, 18] * 8 if repetitive else list(range(100, 164))
    async with AsyncEngine(cfg, model=loaded) as engine:
        async def one(i, n):
            async for _ in engine.generate(base + [i], SamplingParams(
                    temperature=0.0, max_tokens=n, ignore_eos=True)):
                pass
        async with anyio.create_task_group() as tg:      # warm-up
            for i in range(batch):
                tg.start_soon(one, i, 4)
        torch.cuda.synchronize()
        start = time.perf_counter()
        it0 = engine.stats.num_iterations
        async with anyio.create_task_group() as tg:
            for i in range(batch):
                tg.start_soon(one, i, new_tokens)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        iters = engine.stats.num_iterations - it0
        al = engine.stats.mean_acceptance_length
    return batch * new_tokens / elapsed, elapsed / iters * 1e3, al


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    quiet_logs()
    from specloop.models import load_model
    from specloop.models.testing import write_tiny_checkpoint
    tmp = tempfile.mkdtemp()
    path = args.model or write_tiny_checkpoint(tmp, **SMOLLM2_SHAPE, seed=0)
    what = args.model or "random weights in SmolLM2's shape"
    loaded = load_model(path, dtype=getattr(torch, args.dtype), device="cuda")
    print(f"model: {what}, {args.dtype}, {torch.cuda.get_device_name()}")
    for batch in (1, 8, 64):
        run = functools.partial(tokens_per_s, repetitive=False)
        eager = anyio.run(run, config(path, args.dtype, batch, False), loaded, batch,
                          args.tokens)
        graph = anyio.run(run, config(path, args.dtype, batch, True), loaded, batch,
                          args.tokens)
        print(f"decode batch {batch:3d}: eager {eager[1]:.2f} ms/iter, graph {graph[1]:.2f} "
              f"ms/iter, replay/eager speed {eager[1] / graph[1]:.2f}x "
              f"({graph[0]:.0f} tok/s)", flush=True)
    for batch in (1, 8):
        run = functools.partial(tokens_per_s, repetitive=True)
        base = anyio.run(run, config(path, args.dtype, batch, True), loaded, batch,
                         args.tokens)
        for method in ("ngram", "early_exit", "mtp_eagle"):
            spec = anyio.run(run, config(path, args.dtype, batch, True, method),
                             loaded, batch, args.tokens)
            print(f"batch {batch}: {method:10s} {spec[0]:7.0f} tok/s vs no speculation "
                  f"{base[0]:7.0f} tok/s = {spec[0] / base[0]:.2f}x (AL {spec[2]:.2f}; "
                  "repetitive prompt, random weights)", flush=True)


if __name__ == "__main__":
    main()
