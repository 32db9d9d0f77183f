"""``specloop train-draft --config FILE``: build prompts, self-distil, train, evaluate,
export a head and its model card. Rerunning with the same output directory resumes."""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
from pathlib import Path

HELP = "train a draft head: prompts, self-distilled answers, training, held-out acceptance"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="training TOML (see examples/train-*.toml)")
    p.add_argument("--out", help="run directory (default: output.dir of the config)")
    p.add_argument("--device", help="override target.device (cpu, cuda, auto)")
    p.add_argument("--prompts", help="a prebuilt prompts.jsonl (overrides data.prompts_file)")
    p.add_argument("--fresh", action="store_true", help="delete the run directory first")


def run(args: argparse.Namespace) -> int:
    import attrs  # noqa: PLC0415

    from ._config import TrainConfig  # noqa: PLC0415

    cfg = TrainConfig.from_toml(args.config)     # checked before the pipeline imports torch
    from ._pipeline import run as run_pipeline  # noqa: PLC0415

    if args.prompts:
        cfg = attrs.evolve(cfg, data=attrs.evolve(cfg.data, prompts_file=args.prompts))
    out = Path(args.out or cfg.output.dir)
    if args.fresh and out.exists():
        shutil.rmtree(out)
    command = "specloop train-draft " + " ".join(shlex.quote(a) for a in _argv(args))
    card = run_pipeline(cfg, command=command, out_dir=str(out), device=args.device)
    held = {k: {"al": v["al"], "per_position": v["per_position"]}
            for k, v in card["evaluation_held_out"].items()}
    print(json.dumps({"head": str(out / card["file"]), "sha256": card["sha256"],
                      "training": card["training"], "held_out": held}, indent=1))
    return 0


def _argv(args: argparse.Namespace) -> list[str]:
    out = ["--config", args.config]
    for flag in ("out", "device", "prompts"):
        if getattr(args, flag):
            out += [f"--{flag}", getattr(args, flag)]
    return out + (["--fresh"] if args.fresh else [])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specloop train-draft", description=HELP)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
