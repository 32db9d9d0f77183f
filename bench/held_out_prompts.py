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
    python bench/held_out_prompts.py --check    # every shipped prompt is a fortune in
                                                # one of the forms (needs fortunes)

A rebuild is not the shipped file row for row in general: the held-out prompts are drawn
from the random stream after the training builders, whose draws depend on Debian's package
list at the last ``apt-get update`` (the package summaries) and on Python's docstrings. The
shipped file is the one every GPU figure since the sixth session read; ``--check`` checks
that it is made from the corpus (``fortune_prompt_forms``), which holds on any of those.
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


def not_from_corpus(rows: list[dict]) -> list[dict]:
    """The rows that are no fortune of the installed corpus in one of fortune_prompts'
    forms (``fortune_prompt_forms``; needs Debian's fortunes)."""
    from specloop.train._prompts import fortune_prompt_forms  # noqa: PLC0415
    forms = fortune_prompt_forms()
    return [r for r in rows if (r["text"], r["form"]) not in forms]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="check that every shipped prompt is a fortune of the installed "
                         "corpus in one of fortune_prompts' forms, instead of rebuilding")
    args = ap.parse_args()
    if args.check:
        missing = not_from_corpus(read())
        print(f"{len(missing)} of the shipped prompts are no fortune in one of the forms"
              if missing else "every shipped prompt is a fortune in one of the forms")
        sys.exit(1 if missing else 0)
    rows = build()
    PATH.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {PATH}")


if __name__ == "__main__":
    main()
