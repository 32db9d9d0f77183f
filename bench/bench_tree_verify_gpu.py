"""What a draft tree's VERIFY costs at batch 1 against the chain's, on the real SmolLM2
weights: the premise of tree drafting on the H200 (docs/architecture.md, "Draft trees").

Each step runs on one prefilled held-out chat prompt and is captured in a CUDA graph
(``--device cuda``, bf16, the fused kernels) or run eagerly (``--device cpu``, fp32: the
same code, to check it without a GPU). Steps:

- ``T=1``: plain decoding's forward (one row) with its logits' argmax;
- ``chain K=k``: the same for the chain's k + 1 rows (VERIFY's forward; the greedy check
  itself adds two small kernels on CUDA);
- ``tree N=n``: ``engine/_verify.make_tree_verify_step`` for a tree of n nodes (its 1 + n
  rows' forward with the tree mask, the greedy walk, the accepted path's K/V moved);
- ``draft chain K=3`` and ``draft tree N=n``: the shipped eagle3 head's drafting after the
  catch-up (``MtpEagleDrafter.tree_from_root``: a head forward per depth and the ranks'
  top-k; the chain as the tree of its first choices, so both run the same code).

The steps take turns for ``--rounds`` rounds of ``--replays`` replays each (CUDA events
around each round: device time); prints each step's median time a replay, and its ratio
to T=1 and to the chain of the tree's depth.

``--kernels N`` (CUDA) then profiles N replays of each step (torch.profiler) and prints
its critical path a replay (``_common.critical_path_us``: under PDL each kernel charged
only what it runs past the ones before it), the top rows by added time, kept in --out:
where a tree's VERIFY or DRAFT spends what the chain's does not.

    python bench/bench_tree_verify_gpu.py [--device cuda] [--rounds 5] [--replays 200]
        [--trees 4,7,15] [--kernels 50] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (TREES, critical_path_us, device_events, device_seconds,  # noqa: E402
                     quiet_logs)
from held_out_prompts import PATH as HELD_OUT  # noqa: E402

def drafter_of(runner):
    """The shipped eagle3 head as the engine builds it, on the runner's page table."""
    from specloop.engine import EngineConfig  # noqa: PLC0415
    from specloop.models.drafters import DrafterDeps  # noqa: PLC0415
    from specloop.models.drafters._eagle3 import Eagle3Drafter  # noqa: PLC0415

    config = EngineConfig.from_dict({
        "model": {"name": "smollm2-135m-instruct", "max_seq_len": runner.max_seq_len},
        "speculative": {"method": "eagle3", "num_draft_tokens": 3,
                        "draft_weights": "smollm2-135m-instruct-eagle3"}})
    return Eagle3Drafter(config, DrafterDeps(runner.loaded, runner.cache, 2,
                                             runner.max_seq_len))


def build(device: str):
    from specloop.engine._runner import ModelRunner  # noqa: PLC0415
    from specloop.models import load_model  # noqa: PLC0415

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    loaded = load_model("smollm2-135m-instruct", dtype=dtype, device=device)
    runner = ModelRunner(loaded, num_slots=2, max_seq_len=1024, max_prefill_tokens=1024)
    text = json.loads(HELD_OUT.read_text().splitlines()[0])["text"]
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": text}])
    runner.pages.resize(0, len(ids) + 32)
    with torch.inference_mode():
        runner.model(torch.tensor([ids[:-1]], device=device), torch.tensor([0], device=device),
                     torch.tensor([0], device=device), runner.cache)
    return runner, ids


def steps(runner, ids, trees: list[int]):
    """name -> (step, inputs): each a callable over static tensors."""
    from specloop.engine._verify import make_tree_verify_step  # noqa: PLC0415
    from specloop.samplers import DefaultSampler, SamplingBatch  # noqa: PLC0415
    from specloop.samplers._tree import DraftTree  # noqa: PLC0415

    dev = runner.device
    gen = torch.Generator().manual_seed(0)
    vocab = runner.args.vocab_size
    greedy = SamplingBatch.padding(1, all_greedy=True, device=dev)   # one greedy row

    def inputs(rows: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, vocab, (1, rows), generator=gen)
        tokens[0, 0] = ids[-1]
        return {"tokens": tokens.to(dev), "start_pos": torch.tensor([len(ids) - 1], device=dev),
                "slots": torch.tensor([0], device=dev), **greedy.columns()}

    def forward(inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden, _ = runner.forward(inp["tokens"], inp["start_pos"], inp["slots"],
                                   kv_len=runner.max_seq_len)
        return {"argmax": runner.model.logits(hidden).argmax(dim=-1)}

    drafter = drafter_of(runner)
    root = {"root": torch.randn(1, runner.args.hidden_size, generator=gen).to(
        dev, runner.dtype), "seq_lens": torch.tensor([len(ids)], device=dev),
        "slots": torch.tensor([0], device=dev)}

    def drafting(tree):
        return lambda inp: {"tokens": drafter.tree_from_root(
            inp["root"], inp["seq_lens"], inp["slots"], tree, runner.max_seq_len)}

    out = {"T=1": (forward, inputs(1))}
    for k in sorted({len(max(TREES[n], key=len)) for n in trees} | {3}):
        out[f"chain K={k}"] = (forward, inputs(k + 1))
    for n in trees:
        tree = DraftTree([tuple(p) for p in TREES[n]])
        out[f"tree N={n}"] = (make_tree_verify_step(runner, DefaultSampler(), greedy, tree,
                                                    kv_len=runner.max_seq_len),
                              inputs(n + 1))
    out["draft chain K=3"] = (drafting(DraftTree.chain(3)), root)
    for n in trees:
        out[f"draft tree N={n}"] = (drafting(DraftTree([tuple(p) for p in TREES[n]])), root)
    return out


def timer(device: str, fn, replays: int) -> float:
    """Seconds per call of ``fn`` over ``replays`` calls (device time on CUDA)."""
    if device == "cuda":
        return device_seconds(fn, replays)
    t = time.perf_counter()
    for _ in range(replays):
        fn()
    return (time.perf_counter() - t) / replays


def kernel_path(call, replays: int) -> dict:
    """The critical path of ``replays`` replays of ``call``, a replay (us, launches)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            call()
        torch.cuda.synchronize()
    return critical_path_us(device_events(prof.events(), copies=True), replays)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--trees", default="4,7,15")
    ap.add_argument("--kernels", type=int, default=0,
                    help="CUDA: profile this many replays of each step (critical path)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    quiet_logs()
    runner, ids = build(args.device)
    trees = [int(x) for x in args.trees.split(",")]
    calls = {}
    with torch.inference_mode():
        for name, (step, inp) in steps(runner, ids, trees).items():
            if args.device == "cuda":
                from specloop.graphs._cuda import capture_graph  # noqa: PLC0415
                graph, _ = capture_graph(lambda step=step, inp=inp: step(inp), warmups=2)
                calls[name] = graph.replay
            else:
                step(inp)       # warm, as capture_graph's warm-up calls
                calls[name] = lambda step=step, inp=inp: step(inp)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                times[name].append(timer(args.device, call, args.replays))
        paths = {name: kernel_path(call, args.kernels) for name, call in calls.items()} \
            if args.kernels and args.device == "cuda" else {}
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"{args.device}, prompt of {len(ids)} tokens, {args.rounds} rounds x "
          f"{args.replays} replays; median us a step (range), x T=1, x the chain of its depth")
    rows = []
    for name, t in times.items():
        depth = len(max(TREES[int(name.split("=")[1])], key=len)) \
            if name.startswith(("tree", "draft tree")) else None
        prefix = "draft chain" if name.startswith("draft") else "chain"
        chain = med.get(f"{prefix} K={depth}") if depth else None
        rows.append({"step": name, "us": [round(x * 1e6, 1) for x in t],
                     "median_us": round(med[name] * 1e6, 1),
                     "vs_t1": round(med[name] / med["T=1"], 3),
                     "vs_chain": round(med[name] / chain, 3) if chain else None})
        r = rows[-1]
        print(f"  {name:12s} {r['median_us']:9.1f} ({min(r['us']):.1f}-{max(r['us']):.1f})  "
              f"x{r['vs_t1']:.3f}" + (f"  x{r['vs_chain']:.3f} chain" if chain else ""))
    for name, path in paths.items():
        print(f"  {name}: critical path a replay, us (launches): " + ", ".join(
            f"{k[:40]} {v[1]} ({v[0]:g})" for k, v in list(path.items())[:8]))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": args.device, "prompt_tokens": len(ids),
                                              "rows": rows, "critical_path_us": paths},
                                             indent=1))


if __name__ == "__main__":
    main()
