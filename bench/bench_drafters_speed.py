"""CPU batch-1 greedy tokens/s with each shipped head vs n-gram, no speculation and
transformers' ``generate`` on the same SmolLM2 weights, in one process.

Each configuration runs ``--repeats`` times, interleaved (this machine is shared and noisy);
prints min-max tokens/s and the ratio of medians to transformers.

    python bench/bench_drafters_speed.py [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import anyio
import torch

from _common import quiet_logs
from bench_decode import make_config, specloop_tps, transformers_tps

PROMPT = "Tell me about llamas."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ks", default="2,3", help="draft lengths for each head")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads for every configuration (0: torch's default)")
    args = ap.parse_args()
    quiet_logs()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    from specloop.engine import EngineConfig  # noqa: PLC0415
    from specloop.models import load_model  # noqa: PLC0415
    from specloop.models.drafters._heads import heads_dir, shipped_heads  # noqa: PLC0415

    loaded = load_model("smollm2-135m-instruct", dtype=torch.float32)
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    configs = {"none": make_config("none", "float32", batch=1),
               "ngram K=4": make_config("ngram", "float32", k=4, batch=1)}
    for head in shipped_heads():
        method = json.loads((heads_dir() / f"{head}.json").read_text()).get("method",
                                                                             "mtp_eagle")
        for k in map(int, args.ks.split(",")):
            data = make_config(method, "float32", k=k, batch=1).to_dict()
            data["speculative"]["draft_weights"] = head
            configs[f"{head} K={k}"] = EngineConfig.from_dict(data)
    tps = {name: [] for name in ["transformers", *configs]}
    als = {}
    for _ in range(args.repeats):
        tps["transformers"].append(transformers_tps(loaded.path, ids, args.tokens,
                                                    torch.float32)[0])
        for name, config in configs.items():
            rate, _, al = anyio.run(specloop_tps, config, loaded, [ids], args.tokens)
            tps[name].append(rate)
            als[name] = al
    base = statistics.median(tps["transformers"])
    for name, rates in tps.items():
        med = statistics.median(rates)
        al = f", AL {als[name]:.2f}" if name in als else ""
        print(f"{name:38s} {min(rates):6.1f}-{max(rates):6.1f} tok/s, median {med:6.1f} "
              f"({med / base:.2f}x transformers{al})")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
