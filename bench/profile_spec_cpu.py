"""Where a speculative iteration's time goes on the CPU (batch 1, SmolLM2 fp32).

Two views, one process:
- ops: the pieces timed directly (median of N): the target's forward for 1 and K+1
  tokens, its LM head, one transformers decode step on the same weights, and each part
  of an eagle3 draft step (fc3 over the features, the head's layer, the reduced LM head;
  in the dtype the engine's head computes in, speculative.draft_dtype's auto). Timed in
  a loop, a piece's weights stay in the CPU's caches: in the engine the target's forward
  evicts the head's, and its steps take ~1.5-2x these.
- engine: time per iteration state (SCHEDULE ... RESCAN) through the engine's observers,
  for no speculation and eagle3 K=3, plus tokens/s.

    python bench/profile_spec_cpu.py [--tokens 64] [--k 3] [--reps 20] [--threads 1]
        [--skip-ops] [--repeats 3 --compare-packing]
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import anyio
import torch

from _common import cpu_smol, median_seconds, quiet_logs
from bench_decode import make_config

HEAD = "smollm2-135m-instruct-eagle3"


def timed(fn, reps):
    """``fn()``'s median ms over ``reps`` calls."""
    return median_seconds(fn, reps) * 1e3


def op_times(loaded, ids, k, reps):
    from specloop.models import KVCache  # noqa: PLC0415
    from specloop.models.drafters._eagle3 import Eagle3Head  # noqa: PLC0415
    from specloop.models.drafters._heads import resolve_head  # noqa: PLC0415
    from specloop.models.drafters._lm_head import DraftHead  # noqa: PLC0415
    from specloop.models.drafters._mtp import draft_dtype  # noqa: PLC0415

    model = loaded.model
    cache = KVCache(model.args, 2, 1024, dtype=model.dtype, device="cpu")
    pos = len(ids) + 64
    prompt = torch.tensor([list(ids) * 4])[:, :pos]
    slot = torch.tensor([0])
    rows = {}
    with torch.inference_mode():
        model(prompt, torch.tensor([0]), slot, cache)
        one, many = torch.tensor([[ids[-1]]]), torch.tensor([[ids[-1]] * (k + 1)])
        at = torch.tensor([pos])
        rows["target fwd T=1"] = timed(lambda: model(one, at, slot, cache), reps)
        rows[f"target fwd T={k + 1}"] = timed(lambda: model(many, at, slot, cache), reps)
        layers = (1, 14, 26)
        rows[f"target fwd T={k + 1} + capture"] = timed(
            lambda: model(many, at, slot, cache, capture=layers), reps)
        h1 = model(one, at, slot, cache)
        hk = model(many, at, slot, cache)
        rows["target LM head 1 row"] = timed(lambda: model.logits(h1), reps)
        rows[f"target LM head {k + 1} rows"] = timed(lambda: model.logits(hk), reps)
        dtype = draft_dtype("auto", model)      # what the engine's head computes in
        head = Eagle3Head(model, dtype=dtype, device="cpu", feature_layers=layers)
        path, _ = resolve_head(HEAD)
        head.load(str(path))
        hcache = KVCache(head.block.args, 2, 1024, dtype=dtype, device="cpu")
        feats = torch.randn(1, k + 1, 3 * model.args.hidden_size)
        head(prompt[:, 1:], torch.randn(1, pos - 1, 3 * model.args.hidden_size),
             torch.tensor([0]), slot, hcache)
        rows["head fc3 project (1 row)"] = timed(lambda: head.project(feats[:, :1]), reps)
        rows[f"head catch-up ({k + 1} rows, features)"] = timed(
            lambda: head(many, feats, at, slot, hcache), reps)
        hid = torch.randn(1, 1, model.args.hidden_size)
        rows["head step (1 row)"] = timed(lambda: head(one, hid, at, slot, hcache), reps)
        lm = DraftHead(model.lm_head_weight, lm_head_tp=False, max_rows=1, d2t=head.d2t,
                       dtype=dtype)
        rows[f"draft LM head ({head.d2t.numel()} rows, {str(dtype)[6:]}) -> full V"] = timed(
            lambda: lm.logits(hid[:, 0]), reps)
        rows["  + argmax over V"] = timed(lambda: lm.logits(hid[:, 0]).argmax(-1), reps)
    rows.update(transformers_step(loaded.path, ids, pos, reps))
    return rows


def transformers_step(path, ids, pos, reps):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        prompt = torch.tensor([list(ids) * 4])[:, :pos]
        out = model(prompt, use_cache=True)
        past = out.past_key_values
        one = torch.tensor([[ids[-1]]])

        def step():
            model(one, cache=past, use_cache=True)
            past.crop(-1)

        return {"transformers decode step (1 token)": timed(step, reps)}


class StateTimes:
    def __init__(self):
        self.us = collections.defaultdict(list)

    def on_transition(self, event):
        self.us[event.state.value].append(event.duration_us)


async def engine_states(config, loaded, ids, n):
    from specloop.engine import AsyncEngine  # noqa: PLC0415
    from specloop.samplers import SamplingParams  # noqa: PLC0415

    obs = StateTimes()
    params = SamplingParams(temperature=0.0, max_tokens=n)
    async with AsyncEngine(config, model=loaded, observers=[obs]) as engine:
        async for _ in engine.generate(ids, SamplingParams(temperature=0, max_tokens=4)):
            pass
        obs.us.clear()
        engine.stats.__init__()
        start = time.perf_counter()
        toks = 0
        async for out in engine.generate(ids, params):
            toks += len(out.token_ids)
        elapsed = time.perf_counter() - start
        al = engine.stats.mean_acceptance_length
    iters = len(obs.us.get("VERIFY", obs.us.get("verify", []))) or 1
    per = {s: sum(v) / iters / 1e3 for s, v in obs.us.items()}
    return toks / elapsed, al, per, elapsed * 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--skip-ops", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--compare-packing", action="store_true",
                    help="also run each configuration with PackedLinear off (F.linear only)")
    args = ap.parse_args()
    quiet_logs()
    loaded, ids = cpu_smol(args.threads)
    if not args.skip_ops:
        for name, ms in op_times(loaded, ids, args.k, args.reps).items():
            print(f"{name:42s} {ms:8.2f} ms")
    configs = {"none": make_config("none", "float32", batch=1),
               f"eagle3 K={args.k}": make_config("eagle3", "float32", k=args.k, batch=1,
                                                 draft_weights=HEAD)}
    import specloop.models._linear as linear  # noqa: PLC0415

    available = linear.packing_available
    for _ in range(args.repeats):
        for packing in (True, False) if args.compare_packing else (True,):
            # Off: every PackedLinear built from here on (the head's) and the target's.
            linear.packing_available = available if packing else (lambda: False)
            loaded.model.linear.enabled = packing and available()
            for name, config in configs.items():
                tps, al, per, it_ms = anyio.run(engine_states, config, loaded, ids, args.tokens)
                states = " ".join(f"{s}={ms:.2f}" for s, ms in per.items())
                tag = "" if not args.compare_packing else (" packed" if packing else " plain")
                print(f"{name + tag:20s} {tps:6.1f} tok/s AL {al:.2f} iteration {it_ms:.2f} ms:"
                      f" {states}", flush=True)
    linear.packing_available = available
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
