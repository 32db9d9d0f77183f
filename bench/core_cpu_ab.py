"""The ProcessEngine core's host time on the CPU, this tree against another commit's:
``bench_host_overhead.py``'s core path (the engine behind its pipe, the CPU's frozen graph
replays) run in turns, each tree in its own Python process, printing each run's
event-loop thread CPU µs an iteration and the medians' ratio.

    python bench/core_cpu_ab.py --base <commit> [--batch 256] [--method none|eagle3]
        [--rounds 3] [--runs 2] [--iterations 300]

The other commit is checked out with ``git worktree`` into a temporary folder; a package
folder of links (``specloop/engine`` -> its ``engine`` ...) put first on PYTHONPATH makes
its child process import that tree's ``specloop`` instead of this one's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "samplers", "comm", "graphs", "models", "serve", "train")


def measure(batch: int, method: str, runs: int, iterations: int) -> None:
    """One tree's runs (the child's entry): prints {"tree", "thread_us": [...]}."""
    import anyio  # noqa: PLC0415
    import attrs  # noqa: PLC0415
    import torch  # noqa: PLC0415

    sys.path.insert(0, str(ROOT / "bench"))
    import bench_host_overhead as host  # noqa: PLC0415
    import specloop.engine  # noqa: PLC0415
    from bench_chain_host import config  # noqa: PLC0415
    from specloop.models import load_model  # noqa: PLC0415
    from specloop.models.testing import write_tiny_checkpoint  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(tmp, vocab_size=384, num_layers=2, hidden=64, seed=1)
        loaded = load_model(path, dtype=torch.float32)
        cfg = config(path, method, 3, batch)
        cfg = attrs.evolve(cfg, parallel=attrs.evolve(cfg.parallel, freeze_gc="on"))
        threads = [anyio.run(host.core_path, cfg, loaded, batch, iterations)[1]
                   for _ in range(runs)]
    print(json.dumps({"tree": specloop.engine.__file__, "thread_us": threads}))


def run_tree(pythonpath: str | None, args) -> list[float]:
    """One child's runs; ``pythonpath``: the other tree's links (None: this tree)."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, __file__, "--child", "--batch", str(args.batch), "--method",
         args.method, "--runs", str(args.runs), "--iterations", str(args.iterations)],
        capture_output=True, text=True, env=env, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    imported = Path(got["tree"]).parent.parent
    expected = Path(pythonpath) / "specloop" if pythonpath else ROOT
    if imported != expected:     # the A/B would compare a tree with itself
        raise SystemExit(f"the child imported {imported}, not {expected}")
    return got["thread_us"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", help="the commit to compare against (required but in --child)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--method", default="none")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        measure(args.batch, args.method, args.runs, args.iterations)
        return
    if not args.base:
        ap.error("--base COMMIT is required")
    with tempfile.TemporaryDirectory() as tmp:
        tree, links = Path(tmp) / "tree", Path(tmp) / "links" / "specloop"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree),
                        args.base], check=True)
        try:
            links.mkdir(parents=True)
            for name in PACKAGES:
                if (tree / name).is_dir():
                    (links / name).symlink_to(tree / name)
            got: dict[str, list[float]] = {"base": [], "this": []}
            for _ in range(args.rounds):
                got["base"] += run_tree(str(links.parent), args)
                got["this"] += run_tree(None, args)
                print({k: [round(x) for x in v] for k, v in got.items()}, flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(tree)], check=False)
    ratio = statistics.median(got["this"]) / statistics.median(got["base"])
    print(f"batch {args.batch} {args.method}: event-loop thread CPU us an iteration, "
          f"{args.base} {min(got['base']):.0f}-{max(got['base']):.0f}, this tree "
          f"{min(got['this']):.0f}-{max(got['this']):.0f}; medians' ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
