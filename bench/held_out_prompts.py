"""The benches' held-out chat prompts: ``bench/prompts_heldout.jsonl``, shipped.

The 400 prompts of ``build_prompts(5000, 400, 0)``'s eval split (specloop.train: Debian
fortunes turned into questions, instructions and rewrites; no head is trained on that
source), one JSON object a line as ``write_prompts`` writes them ({"split": "eval", "text",
"source", "form"}). Every GPU bench that times rounds over held-out prompts
(``profile_spec_gpu.py``, ``bench_adaptive_gpu.py``, ``scripts/h200_check.sh``) reads this
file by default, so a figure's prompts are the repository's, not a file carried from
elsewhere.

    python bench/held_out_prompts.py            # rebuild it (needs Debian's
                                                # wordnet-base and fortunes)
    python bench/held_out_prompts.py --check    # rebuild in memory, compare with the file
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

PATH = Path(__file__).resolve().parent / "prompts_heldout.jsonl"
NUM_TRAIN, NUM_EVAL, SEED = 5000, 400, 0


def build() -> list[dict]:
    """The eval split as JSON rows (the training split is built too: the held-out prompts
    are drawn after it from the same random stream)."""
    import attrs  # noqa: PLC0415

    from specloop.train._prompts import build_prompts  # noqa: PLC0415
    with warnings.catch_warnings():     # the docstring source imports deprecated modules
        warnings.simplefilter("ignore", DeprecationWarning)
        splits = build_prompts(NUM_TRAIN, NUM_EVAL, SEED)
    return [{"split": "eval", **attrs.asdict(p)} for p in splits["eval"]]


def read(path: Path = PATH) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="compare a rebuild with the shipped file instead of writing it")
    args = ap.parse_args()
    rows = build()
    if args.check:
        same = rows == read()
        print("same as the shipped file" if same else "DIFFERENT from the shipped file")
        sys.exit(0 if same else 1)
    PATH.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {PATH}")


if __name__ == "__main__":
    main()
