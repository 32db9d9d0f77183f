"""Render a specloop trace (``--trace FILE``) as a PNG timeline: one row per rank track.

    python bench/plot_trace.py trace.json trace.png [--from-ms 0 --to-ms 50]
    python bench/plot_trace.py --demo trace.png     # two LocalGroup ranks on a tiny model

Needs matplotlib. Perfetto (https://ui.perfetto.dev) opens the JSON itself.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

COLORS = {"SCHEDULE": "#9e9e9e", "SYNC": "#ff9800", "PICK_GRAPH_KEY": "#8bc34a",
          "DRAFT": "#03a9f4", "VERIFY": "#3f51b5", "RESCAN": "#e91e63"}


def plot(trace: dict, out: Path, start_ms: float, end_ms: float | None) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    slices = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    end_ms = end_ms if end_ms is not None else max(e["ts"] + e["dur"] for e in slices) / 1e3
    tracks = sorted({(e["pid"], e["tid"]) for e in slices})
    fig, ax = plt.subplots(figsize=(12, 0.6 + 0.55 * len(tracks)), dpi=110)
    for row, (pid, tid) in enumerate(tracks):
        for e in slices:
            if (e["pid"], e["tid"]) != (pid, tid):
                continue
            a, b = e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3
            if b < start_ms or a > end_ms:
                continue
            color = COLORS.get(e["name"], "#607d8b")
            ax.barh(row, max(b - a, 1e-3), left=a, height=0.8, color=color,
                    edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(tracks)),
                  [f"rank {p} {'iteration' if t == 0 else 'collectives'}" for p, t in tracks])
    ax.invert_yaxis()
    ax.set_xlim(start_ms, end_ms)
    ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, COLORS, ncol=6, fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, 1.25), frameon=False)
    fig.tight_layout()
    fig.savefig(out)


def demo_trace() -> dict:
    """Two LocalGroup ranks of the tiny test model, six mixed requests."""
    import anyio  # noqa: PLC0415

    from specloop.comm import LocalGroup  # noqa: PLC0415
    from specloop.engine import AsyncEngine, EngineConfig  # noqa: PLC0415
    from specloop.engine._trace import TraceRecorder  # noqa: PLC0415
    from specloop.models.testing import write_tiny_checkpoint  # noqa: PLC0415
    from specloop.samplers import SamplingParams  # noqa: PLC0415

    model = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", vocab_size=384)
    config = EngineConfig.from_dict({
        "model": {"name": str(model), "device": "cpu", "max_seq_len": 256,
                  "chat_template": False},
        "speculative": {"method": "ngram", "num_draft_tokens": 3},
        "parallel": {"world_size": 2, "attention_dp": True}})
    recorder = TraceRecorder()

    async def rank_main(comm):
        async with AsyncEngine(config, communicator=recorder.communicator(comm),
                               observers=(recorder,)) as engine:
            if comm.rank:
                await engine.wait_closed()
                return

            async def one(i):
                params = SamplingParams(temperature=0.7 * (i % 2), seed=i, max_tokens=24,
                                        ignore_eos=True)
                async for _ in engine.generate(f"request {i}: the quick brown fox", params):
                    pass

            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(one, i)

    anyio.run(LocalGroup(2).run, rank_main)
    return recorder.trace()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="TRACE.json OUT.png, or OUT.png with --demo")
    p.add_argument("--demo", action="store_true")
    p.add_argument("--from-ms", type=float, default=0.0)
    p.add_argument("--to-ms", type=float, default=None)
    args = p.parse_args()
    from _common import quiet_logs  # noqa: PLC0415
    quiet_logs()
    trace = demo_trace() if args.demo else json.loads(Path(args.paths[0]).read_text())
    plot(trace, Path(args.paths[-1]), args.from_ms, args.to_ms)


if __name__ == "__main__":
    main()
