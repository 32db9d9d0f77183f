"""The open issues' speed bars, judged from the rows one lease wrote (issue 12's n-gram row,
issue 13's batch-1, batch-32 and adaptive rows): each bar, the figure per process, and
whether it is met, in one table. The bars are the H200's; a row from another device is
marked as such (its figures say nothing about the bar's "met").

    python bench/open_bars.py ab_DEFAULT_1_1.jsonl ab_DEFAULT_2_1.jsonl process.jsonl

``scripts/h200_check.sh bars`` (batch 1 in two processes, then a server's load at
BARS_BATCHES) writes those files and prints this table; run it here over the files of
several calls (the device brings back one call's files at a time).

The rows: ``profile_spec_gpu.py``'s (batch 1, closed rounds; ``vs_none`` is the ratio
within that process), ``bench_process_gpu.py``'s (``kind`` set; a server's load, one
``ProcessEngine`` a config, medians of the runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

# (issue, measure, bar): what each open bar asks (the issues' tables).
BAR_BATCH1 = (13, "batch 1, best eagle3 ÷ no speculation", 1.6)
BAR_NGRAM = (12, "batch 1, n-gram K = 4 ÷ no speculation, over its AL", 0.8)
BAR_BATCH32 = (13, "batch 32, best fixed eagle3 ÷ no speculation (a server's load)", 1.0)
BAR_ADAPTIVE = (13, "adaptive ÷ max(no speculation, fixed K), each batch", 0.97)
NGRAM = "ngram K=4"
ADAPTIVE = "eagle3 adaptive<=3"    # the rule as shipped (adaptive{...} hold it to fewer K)


@dataclass
class Verdict:
    issue: int
    measure: str
    bar: float
    figures: list[float] = field(default_factory=list)
    devices: set[str] = field(default_factory=set)

    @property
    def median(self) -> float | None:
        return statistics.median(self.figures) if self.figures else None

    @property
    def met(self) -> str:
        if not self.figures:
            return "not run"
        met = "met" if self.median >= self.bar else "not met"
        if not all("H200" in d for d in self.devices):
            return f"{met} there; the bar is the H200's"
        return met

    def row(self) -> str:
        figures = ", ".join(f"{f:.3f}" for f in self.figures) or "—"
        median = "—" if self.median is None else f"{self.median:.3f}"
        return (f"| {self.issue} | {self.measure} | ≥ {self.bar} | {figures} | {median} | "
                f"{', '.join(sorted(self.devices)) or '—'} | {self.met} |")


def is_fixed_eagle3(config: str) -> bool:
    """A fixed eagle3 config the bars take the best of (an adaptive one, or a fixed one's
    twin, judged as a rule is, is not)."""
    return config.startswith("eagle3") and "adaptive" not in config and "twin" not in config


def judge(files: Iterable[tuple[str, list[dict]]]) -> list[Verdict]:
    """The verdicts over ``files`` ((name, rows) each; one process's rows a file for the
    batch-1 bars, whose ratios are within a process)."""
    batch1, ngram, batch32 = Verdict(*BAR_BATCH1), Verdict(*BAR_NGRAM), Verdict(*BAR_BATCH32)
    adaptive: dict[int, Verdict] = {}
    for _, rows in files:
        served = [r for r in rows if "kind" in r]
        closed = [r for r in rows if "kind" not in r and r["batch"] == 1]
        eagle = [r["vs_none"] for r in closed if is_fixed_eagle3(r["config"])]
        if eagle:
            batch1.figures.append(max(eagle))
            batch1.devices.update(r["device"] for r in closed)
        for r in closed:
            if r["config"] == NGRAM and r.get("al"):
                ngram.figures.append(r["vs_none"] / r["al"])
                ngram.devices.add(r["device"])
        for b in sorted({r["batch"] for r in served}):
            at = {r["config"]: r for r in served if r["batch"] == b}
            fixed = [r["median"] for c, r in at.items() if is_fixed_eagle3(c)]
            if b == 32 and fixed and "none" in at:
                batch32.figures.append(max(fixed) / at["none"]["median"])
                batch32.devices.add(at["none"]["device"])
            best = fixed + ([at["none"]["median"]] if "none" in at else [])
            rule = at.get(ADAPTIVE)
            if rule is not None and best:
                v = adaptive.setdefault(b, Verdict(BAR_ADAPTIVE[0], f"{BAR_ADAPTIVE[1]}: {b}",
                                                   BAR_ADAPTIVE[2]))
                v.figures.append(rule["median"] / max(best))
                v.devices.add(rule["device"])
    return [batch1, ngram, batch32, *(adaptive[b] for b in sorted(adaptive))]


def table(verdicts: list[Verdict]) -> str:
    head = ("| issue | measure | bar | figures (one a process or call) | median | device | "
            "verdict |\n|---|---|---|---|---|---|---|")
    return "\n".join([head, *(v.row() for v in verdicts)])


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="jsonl rows of profile_spec_gpu.py or "
                        "bench_process_gpu.py")
    args = parser.parse_args()
    print(table(judge((p, read_rows(p)) for p in args.files)))


if __name__ == "__main__":
    main()
