"""SmolLM2 batch-1 greedy decode on this CPU: specloop vs transformers, one process.

Prints tokens/s and ratios against transformers' greedy ``generate`` on the same weights
and dtype, run in the same process (machines here are noisy), and the roofline: weight
bytes read per token / measured copy bandwidth. Also continuous batching, batch 8 / 1.

    python bench/bench_decode.py [--tokens 64] [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

import anyio
import torch

from _common import copy_bandwidth_gbs, quiet_logs, weight_bytes

# Prompts where prompt lookup can help (the answer repeats the prompt's text) and one
# open-ended prompt where it mostly cannot.
PROMPTS = {
    "repeat": "Repeat this text exactly: The quick brown fox jumps over the lazy dog. "
              "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over "
              "the lazy dog.",
    "code": "Rewrite this Python function with type hints and keep the body unchanged:\n"
            "def add_numbers(first_number, second_number):\n"
            "    result = first_number + second_number\n"
            "    return result\n",
    "open": "Tell me about llamas.",
}


DRAFTERS = (("none", {}), ("ngram", {"k": 2}), ("ngram", {"k": 4}),
            ("early_exit", {"k": 2, "early_exit_layers": 15}))


def transformers_tps(path, prompt_ids, n, dtype):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ids = torch.tensor([prompt_ids])
    # An explicit mask: SmolLM2's pad id is <|im_end|>, which the chat prompt contains.
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
        elapsed = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) / elapsed, out[0, ids.shape[1]:].tolist()


async def specloop_tps(config, loaded, prompts_ids, n):
    from specloop.engine import AsyncEngine
    from specloop.samplers import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=n)   # stops at EOS, as transformers
    async with AsyncEngine(config, model=loaded) as engine:
        async for _ in engine.generate(prompts_ids[0], SamplingParams(temperature=0, max_tokens=4)):
            pass
        engine.stats.__init__()
        outs = {}
        start = time.perf_counter()

        async def one(i, ids):
            toks = []
            async for out in engine.generate(ids, params):
                toks.extend(out.token_ids)
            outs[i] = toks

        async with anyio.create_task_group() as tg:
            for i, ids in enumerate(prompts_ids):
                tg.start_soon(one, i, ids)
        elapsed = time.perf_counter() - start
        al = engine.stats.mean_acceptance_length
    total = sum(len(t) for t in outs.values())
    return total / elapsed, [outs[i] for i in range(len(prompts_ids))], al


def make_config(method, dtype, k=4, batch=8, early_exit_layers=None, draft_weights=None,
                tree=None, rejection=False, adaptive=False):
    from specloop.engine import EngineConfig
    spec = {"method": method, "num_draft_tokens": k, "use_rejection_sampling": rejection,
            "adaptive": adaptive}
    if tree:
        spec["tree"] = tree
    if early_exit_layers:
        spec["early_exit_layers"] = early_exit_layers
    if draft_weights:
        spec["draft_weights"] = draft_weights
    return EngineConfig.from_dict({
        "model": {"name": "smollm2-135m-instruct", "dtype": dtype, "max_seq_len": 1024},
        "scheduler": {"max_batch_size": batch}, "speculative": spec})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    quiet_logs()
    from specloop.models import load_model
    dtype = getattr(torch, args.dtype)
    loaded = load_model("smollm2-135m-instruct", dtype=dtype)
    tok = loaded.tokenizer
    bw = copy_bandwidth_gbs()
    wbytes = weight_bytes(loaded.model)
    roofline = bw * 1e9 / wbytes
    print(f"copy bandwidth {bw:.1f} GB/s; weights {wbytes / 1e6:.0f} MB; "
          f"roofline (weights read once per token) {roofline:.1f} tok/s at batch 1")
    n = args.tokens
    for name, text in PROMPTS.items():
        ids = tok.encode_chat([{"role": "user", "content": text}])
        hf, hf_tokens = transformers_tps(loaded.path, ids, n, dtype)
        row = [f"{name:7s} transformers {hf:6.1f} tok/s"]
        for method, extra in DRAFTERS:
            tps, outs, al = anyio.run(specloop_tps, make_config(method, args.dtype, **extra),
                                      loaded, [ids], n)
            same = "same tokens" if outs[0] == hf_tokens else "DIFF"
            label = method + "".join(f" {k}={v}" for k, v in extra.items())
            row.append(f"{label} {tps:5.1f} ({tps / hf:.2f}x, AL {al:.2f}, {same})")
        print("\n    ".join(row), flush=True)
    ids = [tok.encode_chat([{"role": "user", "content": t}]) for t in PROMPTS.values()]
    batch8 = [ids[i % len(ids)] for i in range(8)]
    one, _, _ = anyio.run(specloop_tps, make_config("none", args.dtype), loaded, batch8[:1], n)
    eight, _, _ = anyio.run(specloop_tps, make_config("none", args.dtype), loaded, batch8, n)
    print(f"continuous batching (no speculation): batch 1 {one:.1f} tok/s, batch 8 "
          f"{eight:.1f} tok/s, ratio {eight / one:.2f}x")


if __name__ == "__main__":
    main()
