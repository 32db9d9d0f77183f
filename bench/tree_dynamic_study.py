"""Would a tree chosen per iteration from the head's confidence (EAGLE-2's dynamic tree)
accept more than the static trees of the same size? An offline estimate on the CPU
(SmolLM2 fp32, the shipped eagle3 head, greedy, held-out chat prompts).

The engine drafts and verifies one large static CANDIDATE tree (every path with ranks
r1 < 7; r1 < 4, r2 < 5; r1 < 3, r2 < 3, r3 < 3: 54 nodes of depth 3), and this script
records, per iteration and row, each node's draft log-probability (the head's
log-softmax over its draft vocabulary at the node's parent, at the node's rank) and
whether the node is on the target's greedy path (its token is the target's argmax after
its parent, and so is its parent's). A selection rule that keeps a subset of the nodes
(closed under ancestors) would then have accepted the deepest correct node it kept:

- static: the fitted trees of ``bench/_common.TREES`` (4 to 23 nodes, all inside the
  candidate tree; fitted on held-out prompts 200-263, measured here on others);
- dynamic (EAGLE-2's reranking): the N nodes with the largest path score, the sum of
  the log-probabilities along the path (a child never scores above its parent);
- oracle: the deepest correct node at any size (what the candidate tree accepts).

Both are evaluated at the same starts (where the candidate tree's walk left the
engine), so the comparison is fair though the starts are not the engine's own for
either rule.

    python bench/tree_dynamic_study.py [--prompts 16] [--tokens 64] [--batch 8]
        [--out bench/results/cpu_tree_dynamic_study.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TREES, quiet_logs  # noqa: E402
from held_out_prompts import read as held_out  # noqa: E402

NAME, HEAD = "smollm2-135m-instruct", "smollm2-135m-instruct-eagle3"
CANDIDATES = sorted(
    [(a,) for a in range(7)] + [(a, b) for a in range(4) for b in range(5)]
    + [(a, b, c) for a in range(3) for b in range(3) for c in range(3)],
    key=lambda p: (len(p), p))
SIZES = (4, 7, 11, 15, 23)


class Recorder:
    """Per VERIFY of a tree iteration: (node log-probs [B, N], correct [B, N]) on the
    host, from the drafter's top-k calls since the last VERIFY and VERIFY's targets."""

    def __init__(self, drafter, tree) -> None:
        from specloop.samplers._tree import TreeTables  # noqa: PLC0415
        self.drafter, self.tree = drafter, tree
        self.tables = TreeTables.of(tree, "cpu")
        self.levels = drafter._tree_plan(tree, torch.device("cpu"))
        self.stash: list[torch.Tensor] = []
        self.samples: list[tuple[torch.Tensor, torch.Tensor]] = []

    def top(self, head, hidden: torch.Tensor, k: int) -> torch.Tensor:
        logp = head._matmul(hidden).float().log_softmax(dim=-1)
        values, ids = logp.topk(k, dim=-1)
        self.stash.append(values)
        return ids if head.d2t is None else head.d2t[ids]

    def verified(self, tokens: torch.Tensor, target: torch.Tensor) -> None:
        rows, n = tokens.shape[0], self.tree.size
        logp = torch.zeros(rows, n + 1)
        stash, self.stash = self.stash, []
        assert len(stash) == len(self.levels), "one top-k a depth"
        for level, values in zip(self.levels, stash):
            level.place(logp, values)
        t = self.tables
        match = tokens == target.index_select(1, t.parents)
        match[:, 0] = True
        correct = match[:, t.ancestors.flatten()].view(rows, n + 1, -1).all(dim=2)
        self.samples.append((logp[:, 1:], correct[:, 1:]))


def accepted_static(correct: torch.Tensor, keep: torch.Tensor, depths: torch.Tensor
                    ) -> torch.Tensor:
    """[S]: the deepest correct node among those kept (a tree: ancestor-closed)."""
    return torch.where(correct & keep, depths, 0).amax(dim=1)


def accepted_dynamic(logp: torch.Tensor, correct: torch.Tensor, n: int,
                     ancestors: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """[S]: the deepest correct node among the ``n`` best by path score whose ancestors
    are kept too."""
    score = torch.zeros_like(logp)
    for node in range(logp.shape[1]):
        # The path's nodes (``ancestors`` repeats a row past its own depth).
        path = sorted({a - 1 for a in ancestors[node + 1].tolist() if a})
        score[:, node] = logp[:, path].sum(dim=1)
    order = score.argsort(dim=1, descending=True, stable=True)[:, :n]
    keep = torch.zeros_like(correct).scatter_(1, order, True)
    # Ancestor-closed: a node counts only where its whole path was kept.
    closed = keep.clone()
    for node in range(logp.shape[1]):
        for a in ancestors[node + 1].tolist():
            if a and a != node + 1:
                closed[:, node] &= keep[:, a - 1]
    return torch.where(correct & closed, depths, 0).amax(dim=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    quiet_logs()
    import anyio  # noqa: PLC0415

    from specloop.engine import AsyncEngine, EngineConfig  # noqa: PLC0415
    from specloop.engine import _verify  # noqa: PLC0415
    from specloop.models import load_model  # noqa: PLC0415
    from specloop.samplers import SamplingParams  # noqa: PLC0415
    from specloop.samplers._tree import DraftTree  # noqa: PLC0415

    start = time.perf_counter()
    loaded = load_model(NAME, dtype=torch.float32, device="cpu")
    ids = [loaded.tokenizer.encode_chat([{"role": "user", "content": row["text"]}])
           for row in held_out()[:args.prompts]]
    tree = DraftTree(CANDIDATES)
    for n in SIZES:
        assert set(map(tuple, TREES[n])) <= set(tree.paths), n
    config = EngineConfig.from_dict({
        "model": {"name": NAME, "dtype": "float32", "device": "cpu",
                  "max_seq_len": max(map(len, ids)) + args.tokens + tree.size + 4,
                  "chat_template": False},
        "scheduler": {"max_batch_size": args.batch, "max_num_tokens": 4096},
        "speculative": {"method": "eagle3", "draft_weights": HEAD, "num_draft_tokens": 3,
                        "tree": [list(p) for p in tree.paths],
                        "tree_max_batch": args.batch}})
    recorder: Recorder | None = None
    real_accept = _verify.accept_tree

    def accept(tables, tokens, target):
        assert recorder is not None
        recorder.verified(tokens, target)
        return real_accept(tables, tokens, target)

    async def run() -> None:
        nonlocal recorder
        async with AsyncEngine(config, model=loaded) as engine:
            drafter = engine.worker.drafter
            recorder = Recorder(drafter, tree)
            head = drafter.lm
            head.top = lambda hidden, k, **_: recorder.top(head, hidden, k)
            _verify.accept_tree = accept
            params = SamplingParams(temperature=0.0, max_tokens=args.tokens,
                                    ignore_eos=True)

            async def one(prompt):
                async for _ in engine.generate(prompt, params):
                    pass
            async with anyio.create_task_group() as tg:
                for prompt in ids:
                    tg.start_soon(one, prompt)

    try:
        anyio.run(run)
    finally:
        _verify.accept_tree = real_accept
    assert recorder is not None
    logp = torch.cat([s[0] for s in recorder.samples])
    correct = torch.cat([s[1] for s in recorder.samples])
    depths = torch.tensor(tree.depths[1:])
    ancestors = torch.tensor(tree.ancestors)
    index = {p: i for i, p in enumerate(tree.paths)}
    rows = {"samples": int(logp.shape[0]), "seconds": round(time.perf_counter() - start),
            "candidate_nodes": tree.size,
            "oracle_al": round(1 + torch.where(correct, depths, 0).amax(1).float().mean()
                               .item(), 3),
            "chain_k3_al": None, "static": {}, "dynamic": {}}
    chain = torch.zeros(tree.size, dtype=torch.bool)
    chain[[index[(0,) * d] for d in (1, 2, 3)]] = True
    rows["chain_k3_al"] = round(1 + accepted_static(correct, chain, depths).float().mean()
                                .item(), 3)
    for n in SIZES:
        keep = torch.zeros(tree.size, dtype=torch.bool)
        keep[[index[tuple(p)] for p in TREES[n]]] = True
        rows["static"][n] = round(1 + accepted_static(correct, keep, depths).float().mean()
                                  .item(), 3)
        rows["dynamic"][n] = round(1 + accepted_dynamic(logp, correct, n, ancestors, depths)
                                   .float().mean().item(), 3)
    print(f"{rows['samples']} (iteration, row) samples at the candidate tree's starts, "
          f"{rows['seconds']} s; AL (1 + accepted drafts):")
    print(f"  chain K=3 {rows['chain_k3_al']}   all {tree.size} candidates "
          f"{rows['oracle_al']}")
    for n in SIZES:
        print(f"  {n:2d} nodes: static {rows['static'][n]}   dynamic {rows['dynamic'][n]}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
