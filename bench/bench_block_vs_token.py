"""Mean acceptance length, token-wise vs block verification, SmolLM2 at temperature 0.7.

Same engine, same prompts and seeds; only speculative.verification differs. Drafters:
n-gram (point-mass drafts) and early exit (sampled drafts with q).

    python bench/bench_block_vs_token.py [--tokens 48] [--prompts 8]
"""

from __future__ import annotations

import argparse

import anyio

from _common import quiet_logs

PROMPTS = [
    "Repeat this sentence twice: the cat sat on the mat and looked at the hat.",
    "Write a Python function that returns the sum of a list of numbers.",
    "List the days of the week, one per line.",
    "Tell me about llamas.",
    "Count from one to twenty in words.",
    "Explain what a hash table is.",
    "Write the alphabet in capital letters separated by commas.",
    "What is the capital of France? Answer in one sentence.",
]


async def run(config, loaded, prompts, tokens):
    from specloop.engine import AsyncEngine
    from specloop.samplers import SamplingParams
    async with AsyncEngine(config, model=loaded) as engine:
        async def one(i):
            params = SamplingParams(temperature=0.7, seed=1000 + i, max_tokens=tokens,
                                    ignore_eos=True)
            async for _ in engine.generate(prompts[i % len(prompts)], params):
                pass
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return engine.stats.mean_acceptance_length, engine.stats.acceptance_rate


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=8)
    args = ap.parse_args()
    quiet_logs()
    import torch
    from specloop.engine import EngineConfig
    from specloop.models import load_model
    loaded = load_model("smollm2-135m-instruct", dtype=torch.float32)
    prompts = (PROMPTS * 4)[:args.prompts]
    for method, extra in (("ngram", {}), ("early_exit", {"early_exit_layers": 8})):
        row = []
        for verification in ("token", "block"):
            config = EngineConfig.from_dict({
                "model": {"name": "smollm2-135m-instruct", "max_seq_len": 512},
                "scheduler": {"max_batch_size": 8},
                "speculative": {"method": method, "num_draft_tokens": 4,
                                "use_rejection_sampling": True,
                                "verification": verification, **extra}})
            al, rate = anyio.run(run, config, loaded, prompts, args.tokens)
            row.append((verification, al, rate))
        (_, al_t, r_t), (_, al_b, r_b) = row
        print(f"{method:10s} K=4 T=0.7: token AL {al_t:.3f} (accept {r_t:.3f}), block AL "
              f"{al_b:.3f} (accept {r_b:.3f}), block/token {al_b / al_t:.3f}", flush=True)


if __name__ == "__main__":
    main()
