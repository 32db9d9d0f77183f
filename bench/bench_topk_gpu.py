"""A draft tree's top-k calls (``_kernels.topk_map``) per tree, this tree's kernel against
another's (``--against``: a copy of an older models/_kernels.py), taking turns.

The fitted trees' depths (bench/_common.TREES) each rank the rows with children of the
draft vocabulary (16,384 logits a row, bf16, the shipped heads' increasing ``d2t``) and
write each pick into its node's column (``dest``): the 15-node tree's calls are 1 row x top
6, 3 rows x top 3, 3 rows x top 2. Each tree's calls run ``--calls`` times in one CUDA
graph (PDL as in the engine); prints µs a tree (all of its depths), medians of
``--repeats`` timings, and checks that both kernels write the same columns.

    python bench/bench_topk_gpu.py [--against .dev/old/models/_kernels.py] [--trees 7,15,31]
    python bench/bench_topk_gpu.py --device cpu --trees 7 --calls 1 --repeats 1  # smoke
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TREES  # noqa: E402

from specloop.models import _kernels  # noqa: E402
from specloop.models.drafters._mtp import _tree_levels  # noqa: E402
from specloop.samplers._tree import DraftTree  # noqa: E402

VOCAB, DRAFT_VOCAB = 49152, 16384


def depth_calls(paths: list[list[int]]) -> list[tuple[int, int, torch.Tensor]]:
    """Per depth with children: (rows ranked, top k, dest [rows, k]), the drafter's own
    levels (``_TreeLevel``: the rows up to the depth's last with children, as the CUDA
    path ranks them, each pick's node column or -1)."""
    levels = _tree_levels(DraftTree([tuple(p) for p in paths]), torch.device("cpu"))
    return [(lv.end - lv.first, lv.width, lv.dest_depth) for lv in levels]


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("kernels_against", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--trees", default="7,15,31")
    ap.add_argument("--against", default="")
    ap.add_argument("--calls", type=int, default=20, help="trees a graph")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    mods = {"this": _kernels}
    if args.against:
        mods["against"] = load_module(args.against)
    gen = torch.Generator().manual_seed(0)
    d2t = torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values.to(dev)
    rows_out = []
    for n in (int(x) for x in args.trees.split(",")):
        calls = depth_calls(TREES[n])
        logits = [torch.randn(r, DRAFT_VOCAB, generator=gen).to(dev, torch.bfloat16)
                  for r, _, _ in calls]
        dests = [d.to(dev) for _, _, d in calls]
        outs = {name: torch.full((1, n + 1), -1, dtype=torch.int64, device=dev)
                for name in mods}

        def tree(mod, out):
            for x, (_, k, _), dest in zip(logits, calls, dests):
                mod.topk_map(x, k, d2t, increasing=True, out=out, dest=dest)

        for name, mod in mods.items():
            tree(mod, outs[name])
        if len(mods) > 1:
            assert torch.equal(outs["this"], outs["against"]), outs
        us: dict[str, list[float]] = {name: [] for name in mods}
        if dev.type == "cuda":
            graphs = {}
            for name, mod in mods.items():
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(2):
                        tree(mod, outs[name])
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(args.calls):
                        tree(mod, outs[name])
                graphs[name] = g
            for _ in range(args.repeats):
                for name, g in graphs.items():  # taking turns
                    g.replay()
                    torch.cuda.synchronize()
                    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    start.record()
                    for _ in range(args.replays):
                        g.replay()
                    end.record()
                    end.synchronize()
                    us[name].append(start.elapsed_time(end) * 1e3 /
                                    (args.replays * args.calls))
        row = {"tree": n, "calls": [(r, k) for r, k, _ in calls],
               "us_a_tree": {name: [round(v, 2) for v in vals] for name, vals in us.items()},
               "median": {name: round(statistics.median(vals), 2) if vals else None
                          for name, vals in us.items()}}
        rows_out.append(row)
        print(f"tree {n}: calls (rows, k) {row['calls']}: µs a tree {row['median']} "
              f"(runs {row['us_a_tree']})")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": str(dev), "rows": rows_out},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
