"""The Perfetto timeline: valid trace-event JSON, one slice per state per iteration per rank,
in order and non-overlapping on each rank's track, collectives on their own track."""

from __future__ import annotations

import json
from collections import defaultdict

import anyio

from specloop.comm import LocalGroup
from specloop.engine import AsyncEngine
from specloop.engine._trace import COLLECTIVES_TID, ITERATION_TID, TraceRecorder
from specloop.samplers import SamplingParams

from .conftest import PROMPTS, collect, make_config

CYCLE = ["SCHEDULE", "SYNC", "PICK_GRAPH_KEY", "DRAFT", "VERIFY", "RESCAN"]


async def _two_ranks(config, loaded, recorder):
    group = LocalGroup(2, timeout=5.0)

    async def rank_main(comm):
        async with AsyncEngine(config, communicator=recorder.communicator(comm),
                               model=loaded, observers=(recorder,)) as engine:
            if comm.rank != 0:
                await engine.wait_closed()
                return None
            results = []

            async def one(i):
                params = SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=10,
                                        ignore_eos=True)
                results.append(await collect(engine, PROMPTS[i], params))

            async with anyio.create_task_group() as tg:
                for i in range(len(PROMPTS)):
                    tg.start_soon(one, i)
            return results

    return await group.run(rank_main)


async def test_trace_of_two_local_ranks(tiny_dir, tiny_loaded, tmp_path):
    config = make_config(tiny_dir, method="ngram", k=3,
                         parallel={"world_size": 2, "attention_dp": True})
    recorder = TraceRecorder()
    results = await _two_ranks(config, tiny_loaded, recorder)
    assert [len(r) for r in results[0]] == [10] * len(PROMPTS)
    path = tmp_path / "trace.json"
    recorder.write(path)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert all({"name", "ts", "dur", "pid", "tid", "args"} <= e.keys() for e in slices)
    assert all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in slices)
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M"
             and e["name"] == "thread_name"}
    assert names == {(0, ITERATION_TID): "iteration", (0, COLLECTIVES_TID): "collectives",
                     (1, ITERATION_TID): "iteration", (1, COLLECTIVES_TID): "collectives"}

    states = defaultdict(list)
    for e in slices:
        if e["tid"] == ITERATION_TID:
            states[e["pid"]].append(e)
    assert sorted(states) == [0, 1]
    iterations = {}
    for rank, track in states.items():
        # Non-overlapping and in order on the track.
        for a, b in zip(track, track[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)
        by_iteration = defaultdict(list)
        for e in track:
            by_iteration[e["args"]["iteration"]].append(e["name"])
        assert sorted(by_iteration) == list(range(len(by_iteration)))
        for names_ in by_iteration.values():
            # One slice per state; an idle group's iteration ends after SYNC.
            assert names_ in (CYCLE, CYCLE[:2]), names_
        assert any(n == CYCLE for n in by_iteration.values())
        iterations[rank] = by_iteration
        verify = [e for e in track if e["name"] == "VERIFY" and e["args"]["batch_size"]]
        assert all(len(e["args"]["accepted"]) == e["args"]["batch_size"] for e in verify)
        assert {e["args"]["k"] for e in track} == {3}
    # ADP ranks run in lockstep: the same iterations, the same states in each.
    assert iterations[0] == iterations[1]

    # Collectives: their own track, each inside the state that issued it.
    for rank in (0, 1):
        colls = [e for e in slices if e["pid"] == rank and e["tid"] == COLLECTIVES_TID]
        syncs = [e for e in states[rank] if e["name"] == "SYNC"]
        # One all-gather per iteration: SCHEDULE's exchange, carrying SYNC's facts.
        assert sum(e["name"] == "all_gather_bytes" for e in colls) >= len(syncs)
        for c in colls:
            assert any(s["ts"] - 1e-3 <= c["ts"] and c["ts"] + c["dur"] <= s["ts"] + s["dur"]
                       + 1e-3 for s in states[rank]), c
