"""CPU batch-1 greedy tokens/s with each shipped head vs n-gram, no speculation and
transformers' ``generate`` on the same SmolLM2 weights, in one process (the demo's
prompt, or ``--held-out N`` chat prompts one after another). ``--temperature T``: sampled
instead (seeded; transformers samples too), and each head's chains also verified by
rejection sampling ("K=k rejection"; the others strictly, as a tree's sampled rows).

Each configuration runs ``--repeats`` times, interleaved (this machine is shared and noisy);
prints min-max tokens/s and the ratio of medians to transformers, both per wall-clock second
and per process CPU second (with ``--threads 1`` the latter is what an idle core would do).

    python bench/bench_drafters_speed.py [--tokens 64] [--repeats 3] [--ks 2,3]
        [--tree '[[0], [1], [0, 0]]'] [--only transformers,none,eagle3] [--held-out 8]
        [--draft-dtypes float32]

``--tree``: also each eagle3 head with each of these draft trees (``speculative.tree``; its depth is
its K); ``--adaptive``: also each head's largest K, and each tree, under adaptive K;
``--only``: the configurations whose names contain one of these words (and transformers);
``--draft-dtypes float32``: each head's configurations also with its head computing in
that dtype (``speculative.draft_dtype``; the default, auto, is bf16 on a CPU with native
bf16 GEMMs), in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import anyio
import attrs
import torch

from _common import cpu_smol, quiet_logs
from bench_decode import make_config


def timed(fn):
    """-> (fn's result, wall seconds, process CPU seconds). With one torch thread the
    CPU time is what the run would take on an idle core: a shared machine's load
    deschedules the process (wall time) but adds little CPU time."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def transformers_rates(model, prompts, n, temperature=0.0):
    """Greedy (or sampled) ``generate`` of each prompt in turn (batch 1) -> (tokens per
    wall second, per process CPU second, None)."""
    tokens, wall, cpu = 0, 0.0, 0.0
    sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} \
        if temperature else {"do_sample": False}
    with torch.inference_mode():
        for ids in prompts:
            prompt = torch.tensor([ids])
            # An explicit mask: SmolLM2's pad id is <|im_end|>, which the chat prompt holds.
            mask = torch.ones_like(prompt)
            model.generate(prompt, attention_mask=mask, max_new_tokens=4, **sampling)
            torch.manual_seed(0)
            out, w, c = timed(lambda: model.generate(prompt, attention_mask=mask,
                                                     max_new_tokens=n, **sampling))
            tokens += out.shape[1] - prompt.shape[1]
            wall, cpu = wall + w, cpu + c
    return tokens / wall, tokens / cpu, None


async def specloop_rates(config, loaded, prompts, n, temperature=0.0):
    """Each prompt in turn (batch 1) through one engine -> (tokens per wall second, per
    process CPU second, AL over the timed requests)."""
    from specloop.engine import AsyncEngine  # noqa: PLC0415
    from specloop.samplers import SamplingParams  # noqa: PLC0415

    async with AsyncEngine(config, model=loaded) as engine:
        async for _ in engine.generate(prompts[0], SamplingParams(temperature=0,
                                                                   max_tokens=4)):
            pass
        engine.stats.__init__()
        tokens = 0
        wall, cpu = time.perf_counter(), time.process_time()
        for i, ids in enumerate(prompts):
            # Stops at EOS, as transformers does.
            params = SamplingParams(temperature=temperature, max_tokens=n,
                                    seed=i if temperature else None)
            async for out in engine.generate(ids, params):
                tokens += len(out.token_ids)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return tokens / wall, tokens / cpu, engine.stats.mean_acceptance_length


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ks", default="2,3", help="draft lengths for each head")
    ap.add_argument("--tree", default=None,
                    help="draft trees (JSON lists of paths, separated by ';')")
    ap.add_argument("--held-out", type=int, default=0,
                    help="run the first N held-out chat prompts (bench/prompts_heldout.jsonl) "
                         "in turn instead of the demo's prompt")
    ap.add_argument("--only", default=None,
                    help="comma-separated words: run the configurations naming one")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--adaptive", action="store_true")
    ap.add_argument("--draft-dtypes", default=None,
                    help="also each head's configurations with these speculative.draft_dtype "
                         "values (comma-separated, e.g. float32: the head as the target)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads for every configuration (0: torch's default)")
    args = ap.parse_args()
    quiet_logs()
    loaded, ids = cpu_smol(args.threads)
    prompts = [ids]
    if args.held_out:
        from held_out_prompts import read  # noqa: PLC0415
        texts = [row["text"] for row in read()]
        prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": t}])
                   for t in texts[:args.held_out]]
    from specloop.models.drafters._heads import heads_dir, shipped_heads  # noqa: PLC0415

    configs = {"none": make_config("none", "float32", batch=1),
               "ngram K=4": make_config("ngram", "float32", k=4, batch=1)}
    for head in shipped_heads():
        method = json.loads((heads_dir() / f"{head}.json").read_text()).get("method",
                                                                             "mtp_eagle")
        for k in map(int, args.ks.split(",")):
            configs[f"{head} K={k}"] = make_config(method, "float32", k=k, batch=1,
                                                   draft_weights=head)
            if args.temperature:
                configs[f"{head} K={k} rejection"] = make_config(
                    method, "float32", k=k, batch=1, draft_weights=head, rejection=True)
        if args.adaptive:
            k = max(map(int, args.ks.split(",")))
            configs[f"{head} adaptive<={k}"] = make_config(
                method, "float32", k=k, batch=1, draft_weights=head, adaptive=True)
        for text in args.tree.split(";") if args.tree and method == "eagle3" else ():
            tree = json.loads(text)
            depth = max(map(len, tree))
            configs[f"{head} tree N={len(tree)} D={depth}"] = make_config(
                method, "float32", k=depth, batch=1, draft_weights=head, tree=tree)
            if args.adaptive:
                configs[f"{head} adaptive tree N={len(tree)} D={depth}"] = make_config(
                    method, "float32", k=depth, batch=1, draft_weights=head, tree=tree,
                    adaptive=True)
    for dtype in args.draft_dtypes.split(",") if args.draft_dtypes else ():
        for name in [n for n in configs if n not in ("none", "ngram K=4")]:
            cfg = configs[name]
            configs[f"{name} draft {dtype}"] = attrs.evolve(
                cfg, speculative=attrs.evolve(cfg.speculative, draft_dtype=dtype))
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).eval()
    names = ["transformers", *configs]
    if args.only:
        words = args.only.split(",")
        # transformers always: the ratios are to it
        names = [n for n in names if n == "transformers" or any(w in n for w in words)]
    wall = {name: [] for name in names}
    cpu = {name: [] for name in wall}
    als = {}
    for _ in range(args.repeats):   # interleaved: each round runs every configuration
        for name in wall:
            if name == "transformers":
                w, c, al = transformers_rates(hf, prompts, args.tokens, args.temperature)
            else:
                w, c, al = anyio.run(specloop_rates, configs[name], loaded, prompts,
                                     args.tokens, args.temperature)
            wall[name].append(w)
            cpu[name].append(c)
            als[name] = al
    for label, rates in (("wall-clock", wall), ("per process CPU second", cpu)):
        base = statistics.median(rates["transformers"])
        print(f"tokens/s, {label}: min-max, median (ratio of medians to transformers)")
        for name, r in rates.items():
            med = statistics.median(r)
            al = f", AL {als[name]:.2f}" if als.get(name) else ""
            print(f"  {name:38s} {min(r):6.1f}-{max(r):6.1f}, median {med:6.1f} "
                  f"({med / base:.2f}x{al})")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
