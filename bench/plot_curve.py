"""Draw bench_gpu_e2e.py's throughput curve (tokens/s over batch size) as a PNG.

    python bench/plot_curve.py results.json curve.png      (needs matplotlib)
"""

from __future__ import annotations

import json
import sys


def curve_points(results: dict) -> dict[str, list[tuple[int, float]]]:
    """(batch, best tok/s) per system over every no-speculation row."""
    lines: dict[str, dict[int, float]] = {}
    for row in results["rows"]:
        if "runs" not in row or row["method"] not in ("none", "compiled"):
            continue
        best = max(r["tok_s"] for r in row["runs"])
        points = lines.setdefault(row["system"], {})
        points[row["batch"]] = max(points.get(row["batch"], 0.0), best)
    return {name: sorted(p.items()) for name, p in lines.items()}


def main() -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = json.load(open(sys.argv[1]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in curve_points(results).items():
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (requests)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"SmolLM2-135M bf16, greedy, {results['tokens']} new tokens, "
                 f"{results['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=120)


if __name__ == "__main__":
    main()
