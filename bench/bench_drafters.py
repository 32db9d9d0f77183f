"""Acceptance per draft position: each trained head against n-gram, on held-out prompts.

Runs the held-out prompts (chat template applied) through the engine for every method x K x
sampling mode, counts per VERIFY row how many drafts were accepted (an iteration observer),
and prints acceptance per position and AL = 1 + accepted / verify rows. Saves a PNG of
acceptance per position (head against head and against n-gram) beside this script.

    python bench/bench_drafters.py [--prompts 16] [--tokens 96] [--device cpu]
    python bench/bench_drafters.py --from-cards     # no run: the heads' cards' engine
                                                    # figures (held-out, from training)
    python bench/bench_drafters.py --only eagle3 --ks 3 --trees 7,15 --strict

``--trees``: also each eagle3 head with these draft trees (``bench/_common.TREES`` by node
count; depth 3, so K = 3 only), verified strictly at every temperature (a tree's sampled
rows: samplers/_tree.py). ``--strict``: also the chains at T > 0 verified strictly (point-
mass drafts, ``use_rejection_sampling = false``), the tree's verification, beside rejection
sampling. ``--only``: the methods whose label contains one of these words.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from _common import TREES, quiet_logs

HELD_OUT_FALLBACK = [   # used when Debian fortunes is not installed
    "Tell me about llamas.", "What does this saying mean? \"A rolling stone gathers no moss.\"",
    "Write a short story about a lighthouse keeper.", "Why is the sky blue?",
    "Rewrite this in formal English: gonna grab food, back in 5",
    "Give me three tips for learning a new language.",
    "Explain what a hash table is to a beginner.", "Do you agree that honesty is always the "
    "best policy? Why or why not?"]


def held_out_prompts(n: int) -> list[str]:
    """The demo's prompt, then the held-out (fortunes) prompts the heads never saw."""
    import random  # noqa: PLC0415

    from specloop.train._prompts import FORTUNES, fortune_prompts  # noqa: PLC0415
    if not FORTUNES.is_dir():
        return HELD_OUT_FALLBACK[:n]
    held = fortune_prompts(random.Random(0))
    random.Random(1).shuffle(held)
    return ["Tell me about llamas."] + [p.text for p in held[:n - 1]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ks", default="3,5")
    ap.add_argument("--png", default=None, help="default: drafters_acceptance[_cards].png "
                    "beside this script")
    ap.add_argument("--from-cards", action="store_true",
                    help="plot the engine figures the shipped heads' model cards hold")
    ap.add_argument("--temperatures", default="0.0,0.7")
    ap.add_argument("--trees", default="", help="node counts from bench/_common.TREES")
    ap.add_argument("--strict", action="store_true",
                    help="also chains at T > 0 verified strictly")
    ap.add_argument("--only", default=None, help="comma-separated words a label contains")
    args = ap.parse_args()
    here = Path(__file__).parent
    if args.from_cards:
        results = _from_cards()
        png = args.png or str(here / "drafters_acceptance_cards.png")
        for r in results:
            print(f"{r['method']:42s} K={r['k']} T={r['temperature']:.1f}  AL {r['al']:.3f}  "
                  f"per position {' '.join(f'{a:.3f}' for a in r['per_position'])}  "
                  f"({r['verify_rows']} verify rows, {r['prompts']} prompts x "
                  f"{r['max_tokens']} tokens)")
        _ratios(results)
        _plot(results, png)
        Path(png).with_suffix(".json").write_text(json.dumps(results, indent=1))
        return
    args.png = args.png or str(here / "drafters_acceptance.png")
    quiet_logs()
    from specloop.engine._runner import DTYPES  # noqa: PLC0415
    from specloop.models import load_model  # noqa: PLC0415
    from specloop.models.drafters._heads import shipped_heads  # noqa: PLC0415
    from specloop.train import engine_acceptance  # noqa: PLC0415

    name = "smollm2-135m-instruct"
    loaded = load_model(name, dtype=DTYPES[args.dtype], device=args.device)
    texts = held_out_prompts(args.prompts)
    ids = [loaded.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    methods = {"ngram": {"method": "ngram"}}
    for head in shipped_heads():
        method = _card(head).get("method", "mtp_eagle")
        methods[f"{head} ({method})"] = {"method": method, "draft_weights": head}
    trees = [int(n) for n in args.trees.split(",") if n]
    temps = [float(t) for t in args.temperatures.split(",")]
    words = args.only.split(",") if args.only else None
    results = []
    for k in [int(x) for x in args.ks.split(",")]:
        runs = []   # (label, speculative, temperature)
        for label, spec in methods.items():
            for temp in temps:
                runs.append((label, {**spec, "num_draft_tokens": k}, temp))
                if args.strict and temp > 0:
                    runs.append((f"{label} strict", {**spec, "num_draft_tokens": k,
                                                     "use_rejection_sampling": False}, temp))
            for n in trees if spec["method"] == "eagle3" and k == 3 else ():
                for temp in temps:
                    runs.append((f"{label} tree N={n}", {
                        **spec, "num_draft_tokens": k, "tree": TREES[n],
                        "use_rejection_sampling": False}, temp))
        for label, spec, temp in runs:
            if words and not any(w in label for w in words):
                continue
            start = time.perf_counter()
            r = engine_acceptance(loaded, name, ids, spec,
                                  temperature=temp, top_p=1.0, max_tokens=args.tokens,
                                  device=args.device, dtype=args.dtype, batch_size=8)
            r.update(method=label, seconds=round(time.perf_counter() - start, 1))
            results.append(r)
            print(f"{label:42s} K={k} T={temp:.1f}  AL {r['al']:.3f}  per position "
                  f"{' '.join(f'{a:.3f}' for a in r['per_position'])}  "
                  f"({r['verify_rows']} verify rows, {r['seconds']} s)", flush=True)
    _ratios(results)
    _plot(results, args.png)
    Path(args.png).with_suffix(".json").write_text(json.dumps(results, indent=1))


def _card(head: str) -> dict:
    from specloop.models.drafters._heads import heads_dir  # noqa: PLC0415
    return json.loads((heads_dir() / f"{head}.json").read_text())


def _from_cards() -> list[dict]:
    """The engine runs recorded in each shipped head's card (n-gram from whichever card ran
    it on the same prompts: the eagle3 card), as this script's result rows."""
    from specloop.models.drafters._heads import shipped_heads  # noqa: PLC0415

    cards = [_card(head) for head in shipped_heads()]
    results, seen = [], set()
    for card in cards:
        for name, r in card["evaluation_held_out"].items():
            if not name.startswith("engine_"):
                continue
            label = ("ngram" if name.startswith("engine_ngram_")
                     else f"{card['name']} ({card['method']})")
            key = (label, r["k"], r["temperature"])
            if key not in seen:
                seen.add(key)
                results.append({**r, "method": label})
    return sorted(results, key=lambda r: (r["k"], r["method"] != "ngram", r["method"],
                                          r["temperature"]))


def _ratios(results) -> None:
    for r in results:
        if r["method"] == "ngram":
            continue
        base = next((b for b in results if b["method"] == "ngram" and b["k"] == r["k"]
                     and b["temperature"] == r["temperature"]), None)
        if base is None:
            continue
        print(f"{r['method']} K={r['k']} T={r['temperature']}: AL / n-gram AL = "
              f"{r['al'] / base['al']:.2f}")


def _plot(results, path: str) -> None:
    try:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    # One colour per method, line style per temperature, marker per K (12+ lines would
    # wrap matplotlib's 10-colour cycle and give two methods one colour).
    methods = list(dict.fromkeys(r["method"] for r in results))
    markers = dict(zip(sorted({r["k"] for r in results}), "os^vD"))
    for r in results:
        style = "-" if r["temperature"] == 0 else "--"
        xs = range(1, len(r["per_position"]) + 1)
        ax.plot(xs, r["per_position"], style, marker=markers.get(r["k"], "o"),
                color=f"C{methods.index(r['method']) % 10}",
                label=f"{r['method']} K={r['k']} T={r['temperature']} (AL {r['al']:.2f})")
    ax.set_xticks(range(1, max(len(r["per_position"]) for r in results) + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction of verify rows accepting it")
    ax.set_title("SmolLM2-135M-Instruct, held-out prompts: acceptance per position",
                 fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    main()
