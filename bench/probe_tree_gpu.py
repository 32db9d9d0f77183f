"""H100/H200, real SmolLM2 (bf16): does every node of a draft tree get the chance the
offline study gives it? Per node of each tree, through the engine at batch 1 over held-out
chat prompts (greedy, EOS ignored, as profile_spec_gpu.py's rows):

- ``al``: the acceptance length with CUDA graphs (the bench's figure) and eager;
- per node (eager, VERIFY's inputs read at each call): ``tries``, iterations where its
  parent was accepted; ``hits``, of them where its token was the target's after the
  parent; ``dup``, where its token repeated a sibling's (a drafter's siblings differ);
- ``kernel_mismatch``: iterations where the greedy tree kernel's path differs from the
  torch reference's (``samplers/_tree.accept_tree`` on the logits' argmax);
- the draft top-k kernel at the trees' widths against torch.topk, straight and into
  node columns.

A node that is tried but never hits while the offline study (bench/tree_acceptance.py)
gives it a share drafts the wrong token. Output: JSON lines, one a (tree, mode).

    python bench/probe_tree_gpu.py --trees 31,47 --out tree_probe.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys

import anyio
import attrs
import torch

from _common import (HELD_OUT, TREES, chat_prompts, engine_config, held_out_texts,
                     load_smol, quiet_logs)
from profile_spec_gpu import CONFIGS


class NodeCounts:
    """VERIFY's tokens and the target's argmax, counted per node at each call."""

    def __init__(self, tree):
        from specloop.samplers._tree import TreeTables  # noqa: PLC0415
        self.tree = tree
        self.tables = TreeTables.of(tree, "cpu")
        n = tree.size + 1
        self.tries = torch.zeros(n, dtype=torch.int64)
        self.hits = torch.zeros(n, dtype=torch.int64)
        self.dup = torch.zeros(n, dtype=torch.int64)
        self.mismatch = 0
        self.calls = 0

    def add(self, tokens, target, num_accepted, path) -> None:
        """One VERIFY: tokens [B, 1 + N], target [B, 1 + N] (the target's token after each
        row), the engine's accepted count [B] and path [B, D + 1]."""
        from specloop.samplers._tree import accept_tree  # noqa: PLC0415
        tokens, target = tokens.cpu(), target.cpu()
        want = accept_tree(self.tables, tokens, target)
        d = self.tables.ancestors.shape[1] - 1
        if not (torch.equal(num_accepted.cpu(), want.num_accepted)
                and torch.equal(path.cpu(), want.path)):
            self.mismatch += 1
        self.calls += 1
        parents = self.tables.parents
        match = tokens == target.index_select(1, parents)
        match[:, 0] = True
        on_path = match[:, self.tables.ancestors.flatten()].view(
            *match.shape, d + 1).all(dim=2)
        parent_ok = on_path.index_select(1, parents)
        parent_ok[:, 0] = False
        self.tries += parent_ok.sum(0)
        self.hits += (parent_ok & match).sum(0)
        for c, kids in self.tree.children().items():
            for a in kids:
                same = torch.zeros(tokens.shape[0], dtype=torch.bool)
                for b in kids:
                    if b != a:
                        same |= tokens[:, a] == tokens[:, b]
                self.dup[a] += int(same.sum())

    def row(self) -> dict:
        paths = [()] + list(self.tree.paths)
        return {"calls": self.calls, "kernel_mismatch": self.mismatch,
                "nodes": [{"path": list(p), "tries": int(t), "hits": int(h), "dup": int(u)}
                          for p, t, h, u in zip(paths, self.tries, self.hits, self.dup)][1:]}


async def run_engine(config, loaded, prompts, tokens: int) -> float:
    from specloop.engine import AsyncEngine  # noqa: PLC0415
    from specloop.samplers import SamplingParams  # noqa: PLC0415
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    async with AsyncEngine(config, model=loaded) as engine:
        for ids in prompts:
            async for _ in engine.generate(ids, params):
                pass
        return engine.stats.mean_acceptance_length


def check_topk(widths) -> dict:
    """topk_map on CUDA against torch.topk (bf16 logits over the draft vocabulary)."""
    from specloop.models import _kernels  # noqa: PLC0415
    out = {}
    torch.manual_seed(0)
    x = torch.randn(24, 16384, device="cuda", dtype=torch.bfloat16)
    d2t = torch.randperm(49152, device="cuda")[:16384]
    inverse = torch.full((49152,), -1, dtype=torch.int64, device="cuda")
    inverse[d2t] = torch.arange(16384, device="cuda")
    for split in (False, True):
        for k in widths:
            got = _kernels.topk_map(x, k, d2t, split=split)
            # bf16 ties are common: the values picked must be the top k, in order (the
            # kernel breaks ties by id, torch.topk as it likes).
            picked = inverse[got]
            ok = bool((picked >= 0).all()) and torch.equal(
                x.float().gather(1, picked.clamp(min=0)), x.float().topk(k).values)
            # 24 rows as 8 requests x 3 parents, each parent's picks into its own columns
            # (one pick dropped: a rank without a node).
            dest = torch.arange(3 * k, device="cuda").view(3, k).clone()
            dest[1, -1] = -1
            placed = torch.full((8, 3 * k), -7, dtype=torch.int64, device="cuda")
            _kernels.topk_map(x, k, d2t, out=placed, dest=dest, split=split)
            flat = dest.flatten()
            cols = placed[:, flat[flat >= 0]]
            src = got.view(8, 3, k).flatten(1)[:, (flat >= 0).nonzero().flatten()]
            out[f"split={split} k={k}"] = bool(ok) and torch.equal(cols, src)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default=HELD_OUT)
    ap.add_argument("--count", type=int, default=16, help="held-out prompts, one at a time")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--trees", default="31,47")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    ap.add_argument("--kernels-only", action="store_true", help="the top-k check alone")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    quiet_logs()
    import specloop.engine._verify as verify  # noqa: PLC0415
    from specloop.samplers._tree import DraftTree  # noqa: PLC0415
    loaded = load_smol(args.device)
    prompts = chat_prompts(loaded.tokenizer, held_out_texts(args.prompts), args.count)
    rows = []
    if args.device == "cuda":
        widths = sorted({max(p[-1] for p in TREES[int(n)]) + 1 for n in args.trees.split(",")})
        rows.append({"topk_kernel": check_topk(widths)})
    original, reference = verify.tree_greedy_verify, verify.accept_tree
    for n in [] if args.kernels_only else [int(t) for t in args.trees.split(",")]:
        # The bench's own config of the tree (profile_spec_gpu.py's rows).
        config = engine_config(CONFIGS[f"eagle3 tree{n}"], 1, args.device)
        al_graphs = anyio.run(run_engine, config, loaded, prompts, args.tokens)
        eager = attrs.evolve(config, components=attrs.evolve(config.components,
                                                             graph_cache="eager"))
        counts = NodeCounts(DraftTree([tuple(p) for p in TREES[n]]))

        def on_kernel(tokens, logits, *a, counts=counts, **kw):   # CUDA, all greedy
            packed, path = original(tokens, logits, *a, **kw)
            counts.add(tokens, logits.float().argmax(-1), packed[:, -1], path)
            return packed, path

        def on_torch(tables, tokens, target, counts=counts):        # elsewhere
            result = reference(tables, tokens, target)
            counts.add(tokens, target, result.num_accepted, result.path)
            return result
        verify.tree_greedy_verify, verify.accept_tree = on_kernel, on_torch
        try:
            al_eager = anyio.run(run_engine, eager, loaded, prompts, args.tokens)
        finally:
            verify.tree_greedy_verify, verify.accept_tree = original, reference
        row = {"tree": n, "al_graphs": round(al_graphs, 4), "al_eager": round(al_eager, 4),
               **counts.row()}
        rows.append(row)
        never = [x["path"] for x in row["nodes"] if x["tries"] >= 20 and x["hits"] == 0]
        print(f"tree{n}: AL graphs {al_graphs:.3f} eager {al_eager:.3f}; kernel "
              f"mismatches {counts.mismatch}/{counts.calls}; tried >= 20 times, never hit: "
              f"{never}", flush=True)
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    if rows and "topk_kernel" in rows[0]:
        print("topk kernel:", rows[0]["topk_kernel"], flush=True)


if __name__ == "__main__":
    sys.exit(main())
