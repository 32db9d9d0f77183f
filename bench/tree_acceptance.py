"""How much a static draft TREE would accept over the chain, for the shipped eagle3 head on
SmolLM2 (CPU, fp32, real weights, greedy), offline: the planning figure for batch 1, where
VERIFY's GEMMs cost about the same for 4 rows as for 16 (one-tile ``tl.dot``: rows pad to
16) and a chain of K drafts uses K + 1 of them.

Greedy verification of a tree accepts the longest root-to-node path whose tokens are the
target's greedy tokens. So what decides acceptance at a start is, at each depth j along
the TRUE path, the rank r_j of the target's token among the head's draft logits given the
true tokens before it (its ancestors in a tree are exactly those): a tree accepts j tokens
where (r_1, ..., r_j) is one of its nodes (a node: the tuple of ranks from the root, the
chain of K being (0), (0, 0), ...). The head's teacher-forced unroll
(``TrainableEagle3Head.unroll``, the chain the engine drafts token for token:
tests/train/test_eagle3.py) feeds the true tokens at every step, so it gives every r_j at
every start in one pass. A token outside the draft vocabulary has no rank (no tree holds
it).

The best static tree of N nodes for a set of starts holds the N rank tuples that most
starts' true paths begin with (``specloop.samplers._tree.best_tree``); its acceptance
length is 1 + the sum of those tuples' shares. The tree is chosen on even
prompts and measured on odd ones (and the reverse), so it is not fitted to what it
measures. Starts: every start in the first ``--tokens`` answer tokens (``every``) and
the engine's own starts (``walk``: draft, accept n, move n + 1; what greedy decoding
through the engine would measure, train/_evaluate.py), as the card's figures.

    python bench/tree_acceptance.py [--prompts 48] [--tokens 96] [--depth 5]
        [--nodes 3,4,7,8,11,15] [--skip 0] [--fit "15,3;7,3"]
        [--out bench/results/cpu_tree_acceptance.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import quiet_logs  # noqa: E402
from held_out_prompts import read as held_out  # noqa: E402

from specloop.samplers._tree import DraftTree, best_tree  # noqa: E402

NAME, HEAD = "smollm2-135m-instruct", "smollm2-135m-instruct-eagle3"
NO_RANK = 1 << 30      # a true token outside the draft vocabulary


def greedy_answers(loaded, texts: list[str], tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids with the chat template, greedy answer ids) per prompt, through the
    engine without speculation."""
    import anyio  # noqa: PLC0415

    from specloop.engine import AsyncEngine, EngineConfig  # noqa: PLC0415
    from specloop.samplers import SamplingParams  # noqa: PLC0415

    ids = [loaded.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    config = EngineConfig.from_dict({
        "model": {"name": NAME, "dtype": "float32", "device": "cpu",
                  "max_seq_len": max(map(len, ids)) + tokens + 8, "chat_template": False},
        "scheduler": {"max_batch_size": 16, "max_num_tokens": 4096},
        "speculative": {"method": "none"}})
    out: dict[int, list[int]] = {}

    async def main() -> None:
        async with AsyncEngine(config, model=loaded) as engine:
            async def one(i: int) -> None:
                params = SamplingParams(temperature=0.0, max_tokens=tokens)
                out[i] = [t async for o in engine.generate(ids[i], params)
                          for t in o.token_ids]
            async with anyio.create_task_group() as tg:
                for i in range(len(ids)):
                    tg.start_soon(one, i)

    anyio.run(main)
    return [(ids[i], out[i]) for i in range(len(ids))]


def load_head(loaded, max_len: int):
    """The shipped eagle3 head as the trainable module (fp32), for its unroll."""
    from safetensors.torch import load_file  # noqa: PLC0415

    from specloop.models.drafters._heads import heads_dir  # noqa: PLC0415
    from specloop.train import TrainableEagle3Head  # noqa: PLC0415

    path = heads_dir() / f"{HEAD}.safetensors"
    state = load_file(str(path))
    from safetensors import safe_open  # noqa: PLC0415
    with safe_open(str(path), "pt") as f:
        layers = tuple(int(x) for x in f.metadata()["feature_layers"].split(","))
    model = loaded.model
    head = TrainableEagle3Head(loaded.args, model.embed_tokens, model.lm_head_weight,
                               state["d2t"], max_len, layers)
    head.load_state_dict({k: v.float() if v.is_floating_point() else v
                          for k, v in state.items()}, strict=True)
    return head.eval()


def rank_paths(loaded, head, answers, depth: int) -> list[list[tuple[int, ...]]]:
    """Per answer, per start p (from the prompt's end, the engine's first DRAFT at P - 2,
    while all ``depth`` targets are answer tokens): the true path's ranks (r_1..r_depth,
    up to the first token outside the draft vocabulary)."""
    from specloop.train._distill import Sequence as Answer  # noqa: PLC0415
    from specloop.train._trainer import Teacher, pad_batch  # noqa: PLC0415

    vocab = loaded.args.vocab_size
    t2d = torch.full((vocab,), -1, dtype=torch.int64)
    t2d[head.d2t] = torch.arange(head.d2t.numel())
    width = max(len(p) + len(a) for p, a in answers)
    teacher = Teacher(loaded.model, 1, width + depth + 1, head.feature_layers)
    paths = []
    with torch.no_grad():
        for prompt, answer in answers:
            seq = Answer(tuple(prompt + answer), len(prompt), "eval", "greedy")
            tokens, _ = pad_batch([seq], "cpu")
            steps = head.unroll(tokens, teacher.both(tokens)[1], depth)
            # step j at start p predicts token p + 2 + j
            n = tokens.shape[1]
            first, last = len(prompt) - 2, n - 2 - depth       # all targets in the answer
            ranks = []
            for j, logits in enumerate(steps):
                idx = torch.arange(first, last + 1)
                true = tokens[0, idx + 2 + j]
                d = t2d[true]
                row = logits[0, idx]
                score = row.gather(1, d.clamp(min=0)[:, None])
                r = (row > score).sum(1)
                ranks.append(torch.where(d >= 0, r, torch.full_like(r, NO_RANK)))
            starts = []
            for i in range(last - first + 1):
                path = tuple(int(ranks[j][i]) for j in range(depth))
                # a rank the drafter cannot offer ends the path
                cut = next((j for j, r in enumerate(path) if r >= NO_RANK), depth)
                starts.append(path[:cut])
            paths.append(starts)
    return paths


def accepted(path: tuple[int, ...], nodes: set[tuple[int, ...]]) -> int:
    n = 0
    while n < len(path) and path[:n + 1] in nodes:
        n += 1
    return n


def figures(per_answer: list[list[tuple[int, ...]]], tree: DraftTree,
            window: int) -> dict[str, float]:
    """AL over every start in the window, and over the engine's walk through it."""
    nodes = set(tree.paths)
    every, walked = [], []
    for paths in per_answer:
        span = paths[:window]
        every += [accepted(p, nodes) for p in span]
        p = 0
        while p < len(span):
            n = accepted(span[p], nodes)
            walked.append(n)
            p += n + 1
    return {"every": round(1 + sum(every) / max(len(every), 1), 3),
            "walk": round(1 + sum(walked) / max(len(walked), 1), 3),
            "walk_starts": len(walked)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=96, help="answer tokens generated")
    ap.add_argument("--depth", type=int, default=5, help="the deepest tree (draft steps)")
    ap.add_argument("--nodes", default="3,4,5,7,8,11,15")
    ap.add_argument("--skip", type=int, default=0,
                    help="start at this held-out prompt (the benches read the first ones: "
                         "fit a tree to ship on others)")
    ap.add_argument("--fit", default=None, metavar="N,DEPTH[;N,DEPTH...]",
                    help="also print the tree of N nodes at most DEPTH deep fitted on all "
                         "these prompts' starts (as a speculative.tree value)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    quiet_logs()
    from specloop.models import load_model  # noqa: PLC0415

    start = time.perf_counter()
    loaded = load_model(NAME, dtype=torch.float32, device="cpu")
    texts = [row["text"] for row in held_out()]
    answers = greedy_answers(loaded, texts[args.skip:args.skip + args.prompts],
                             args.tokens + args.depth + 1)
    print(f"{len(answers)} greedy answers in {time.perf_counter() - start:.0f} s", flush=True)
    head = load_head(loaded, max(len(p) + len(a) for p, a in answers) + args.depth + 2)
    per_answer = rank_paths(loaded, head, answers, args.depth)
    halves = [per_answer[0::2], per_answer[1::2]]
    rows = []
    for k in range(1, args.depth + 1):
        f = [figures(h, DraftTree.chain(k), args.tokens) for h in halves]
        rows.append({"shape": f"chain K={k}", "nodes": k, "depth": k,
                     "every": [x["every"] for x in f], "walk": [x["walk"] for x in f]})
    for nodes in (int(x) for x in args.nodes.split(",")):
        for depth in sorted({3, args.depth}):
            f, trees = [], []
            for fit, held in ((0, 1), (1, 0)):
                tree = best_tree([p for a in halves[fit] for p in a], nodes, depth)
                trees.append(tree.paths)
                f.append(figures(halves[held], tree, args.tokens))
            rows.append({"shape": f"tree N={nodes} depth<={depth}", "nodes": nodes,
                         "depth": max(len(t) for t in trees[0]),
                         "every": [x["every"] for x in f], "walk": [x["walk"] for x in f],
                         "tree_fit_on_even": [list(t) for t in trees[0]]})
    top1 = [p[0] if p else NO_RANK for a in per_answer for p in a[:args.tokens]]
    share = {r: round(sum(x == r for x in top1) / len(top1), 3) for r in range(4)}
    print(f"rank of the true first token (share of starts): {share}")
    print(f"{'shape':26s} {'verify rows':>11s} {'AL every (halves)':>20s} "
          f"{'AL walk (halves)':>20s}")
    for r in rows:
        print(f"{r['shape']:26s} {r['nodes'] + 1:11d} {str(r['every']):>20s} "
              f"{str(r['walk']):>20s}")
    fitted = {}
    for fit in args.fit.split(";") if args.fit else ():
        size, depth = (int(x) for x in fit.split(","))
        starts = [p[:args.tokens] for p in per_answer]
        tree = [list(p) for p in best_tree([p for a in starts for p in a], size, depth).paths]
        fitted[fit] = tree
        print(f"tree of {size} nodes, depth <= {depth}, fitted on all {len(answers)} "
              f"prompts' starts: {json.dumps(tree)}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "prompts": args.prompts, "skip": args.skip, "answer_tokens": args.tokens,
            "head": HEAD, "first_rank_share": share, "rows": rows, "fitted": fitted},
            indent=1))


if __name__ == "__main__":
    main()
