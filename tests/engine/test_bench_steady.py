"""bench/_common.py ``steady_load`` (bench_adaptive_gpu.py ``--arrival steady``) on the tiny
model, and the bench scripts' CPU smoke modes (slow: SmolLM2): bench_adaptive_gpu.py's
steady and closed modes, host_wait_gpu.py at a batch with eagle3 configs."""

import importlib
import importlib.util
import json
import statistics
from pathlib import Path

import pytest

from specloop.engine import AsyncEngine

from .conftest import make_config

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def common(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("_common")


async def test_steady_window_counts_the_windows_iterations(common, tiny_dir, tiny_loaded):
    """``steady_load``'s ``on_mark`` (bench_process_gpu.py ``Window``): the engine's
    counters as the window opens and closes, each once; the window's iterations are fewer
    than the run's (the fill and the drain are out), and each copy's lag is kept."""
    bench = importlib.import_module("bench_process_gpu")
    prompts = [[5, 17, 99, 3, 42], [200, 201, 202], [7, 8]]
    async with AsyncEngine(make_config(tiny_dir, max_batch_size=4), model=tiny_loaded) as engine:
        before = await engine.fetch_stats()
        window = bench.Window(engine)
        got = await common.steady_load(engine, prompts, 6, 3, 12, on_mark=window.mark)
        after = await engine.fetch_stats()
    seconds, (last, first) = window.span()
    assert set(window.marks) == set(window.lags_ms) == {"start", "end"}
    assert 0 < seconds and got["window_tokens"] > 0
    assert before.num_iterations <= first.num_iterations < last.num_iterations
    assert last.num_iterations - first.num_iterations < \
        after.num_iterations - before.num_iterations


async def test_steady_load_keeps_the_engine_full(common, tiny_dir, tiny_loaded):
    """``in_flight`` requests at all times (a new one as each finishes, prompts cycled),
    ``requests`` in all, each its ``n`` tokens; the window's rate is its tokens over its
    seconds, and holds fewer tokens than the whole run (the fill and the drain are out)."""
    n, in_flight, requests = 5, 2, 7
    prompts = [[5, 17, 99, 3, 42], [200, 201, 202], [7, 8]]
    async with AsyncEngine(make_config(tiny_dir, max_batch_size=4), model=tiny_loaded) as engine:
        generate, active, peak, seen, delivered = engine.generate, [0], [0], [], [0]

        async def counted(ids, params):
            seen.append(list(ids))
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            try:
                async for out in generate(ids, params):
                    delivered[0] += len(out.token_ids)
                    yield out
            finally:
                active[0] -= 1
        engine.generate = counted
        got = await common.steady_load(engine, prompts, n, in_flight, requests)
        with pytest.raises(ValueError, match="more than 2 x 2"):
            await common.steady_load(engine, prompts, n, in_flight, 2 * in_flight)
        # Lengths spread around n, the same for every call with the seed.
        before = delivered[0]
        again = await common.steady_load(engine, prompts, 8, in_flight, requests, spread=0.5)
        spread = delivered[0] - before
        await common.steady_load(engine, prompts, 8, in_flight, requests, spread=0.5)
    assert peak[0] == in_flight and len(seen) == 3 * requests
    assert delivered[0] == requests * n + 2 * spread
    assert spread != requests * 8 and requests * 4 <= spread <= requests * 12
    assert again["window_tokens"] > 0
    assert seen[:requests] == [prompts[i % len(prompts)] for i in range(requests)]
    assert got["requests"] == requests
    assert 0 < got["window_tokens"] < requests * n
    assert got["tok_s"] == pytest.approx(got["window_tokens"] / got["window_s"])


def _bench_rows(common, smollm2, tmp_path, monkeypatch, args):
    """bench_adaptive_gpu.py in-process on the CPU (4 tokens, 1 run, batch 1) on the
    session's SmolLM2 and three prompts, ``args`` added -> its rows."""
    bench = importlib.import_module("bench_adaptive_gpu")
    monkeypatch.setattr(common, "load_smol", lambda device: smollm2)
    monkeypatch.setattr(bench, "quiet_logs", lambda: None)     # global: other tests log
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t, "split": "eval"}) + "\n" for t in
                               ("Tell me about llamas.", "What is 2+2?", "Name a color.")))
    out = tmp_path / "rows.jsonl"
    bench.run(bench.parser().parse_args([
        "--prompts", str(prompts), "--out", str(out), "--tokens", "4", "--runs", "1",
        "--batches", "1", "--device", "cpu", *args]))
    return [json.loads(line) for line in out.read_text().splitlines()]



def test_critical_path_charges_each_kernel_what_it_adds(common):
    """bench/_common.py ``critical_path_us``: a kernel launched early (PDL) is charged
    only what it runs past the kernel before it, an idle stretch is charged apart to the
    event after it, and the added times sum to the union."""
    from types import SimpleNamespace as NS

    def ev(s, e, name):
        return NS(time_range=NS(start=s, end=e), name=name)

    # gemm [0, 10]; norm launched at 5, waits, ends at 12 (adds 2); gemm [12, 13] (adds
    # 1); idle 13 -> 20; copy [20, 25] (adds 5, idle 7); gemm inside it adds nothing.
    spans = [ev(0, 10, "gemm"), ev(5, 12, "norm"), ev(12, 13, "gemm"), ev(20, 25, "copy"),
             ev(21, 22, "gemm")]
    out = common.critical_path_us(spans, per=1)
    assert out == {"gemm": [3, 11.0, 0.0], "copy": [1, 5.0, 7.0], "norm": [1, 2.0, 0.0]}
    assert sum(added for _, added, _ in out.values()) == common.union_us(spans)
    assert list(out) == ["gemm", "copy", "norm"]        # by added time
    halved = common.critical_path_us(spans, per=2)      # per iteration
    assert halved["gemm"] == [1.5, 5.5, 0.0]

@pytest.mark.slow
def test_bench_adaptive_steady_smoke_on_cpu(common, smollm2, tmp_path, monkeypatch):
    """``bench_adaptive_gpu.py --device cpu --arrival steady`` in-process on the session's
    SmolLM2 (the shipped eagle3 head, tiny sizes: ~5 s): one row per config with the
    fields the H200 runs read."""
    learned = tmp_path / "learned.jsonl"
    rows = _bench_rows(common, smollm2, tmp_path, monkeypatch, [
        "--configs", "none,adaptive<=3", "--arrival", "steady", "--requests", "3",
        "--steady-queue", "0",
        "--spread", "0.5", "--learn-log", str(learned)])
    assert [r["config"] for r in rows] == ["none", "adaptive<=3"]
    # --learn-log: the adaptive config's choices with the times they saw, and a run mark.
    records = [json.loads(line) for line in learned.read_text().splitlines()]
    assert {r["c"] for r in records if r["ev"] != "run"} == {"adaptive<=3"}
    assert {r["ev"] for r in records} >= {"rule", "run"}
    for r in records:
        if r["ev"] == "rule":
            assert r["k"] in (0, 1, 2, 3) and set(r["t"]) == set(r["e"]) == {"0", "1", "2", "3"}
    for row in rows:
        assert row["arrival"] == "steady" and row["median"] > 0 and row["requests"] == 3
        (seconds, tokens), = row["window_s_tokens"]
        assert seconds > 0 and tokens > 0
    assert rows[1]["measured_ms"] and rows[1]["disturbed_ignored"] is not None
    for row in rows:    # the per-run trace: every iteration of the run, by K
        (traced,) = row["runs_traced"]
        assert traced["iterations"] == sum(n for n, _ in traced["ms_by_k"].values()) > 0
        assert traced["slowest"] and traced["slowest"][0]["ms"] > 0
        assert set(traced["state_median_ms_by_k"]) == set(traced["ms_by_k"])
    # The run's adaptive over the best other config of the same run.
    assert rows[1]["paired_vs_max"] == [rows[1]["vs_none"]]     # one run: the medians'
    # Iterations are counted at the K they ran (SYNC's choice, not the config's K).
    # (the config's K = 3 in SCHEDULE's event labelled the burn-in's K = 0 iterations 3).
    assert set(rows[1]["runs_traced"][0]["ms_by_k"]) <= set(rows[1]["iterations_per_k"])


def test_union_us_is_busy_time_not_summed_durations(common):
    """bench/_common.py ``union_us``: overlapping spans (kernels launched early under PDL)
    count once, gaps not at all; ``device_events`` keeps device kernels, copies on request."""
    from types import SimpleNamespace as NS

    import torch

    def ev(s, e, name="k", dev=torch.autograd.DeviceType.CUDA):
        return NS(time_range=NS(start=s, end=e), name=name, device_type=dev)

    spans = [ev(0, 10), ev(5, 12), ev(12, 13), ev(20, 25), ev(21, 22)]
    assert common.union_us(spans) == 18          # [0, 13] and [20, 25]
    assert common.union_us([]) == 0
    mixed = [ev(0, 1), ev(1, 2, "Memcpy DtoD"), ev(2, 3, dev=torch.autograd.DeviceType.CPU)]
    assert [e.name for e in common.device_events(mixed)] == ["k"]
    assert len(common.device_events(mixed, copies=True)) == 2


@pytest.mark.slow
def test_bench_adaptive_closed_min_prompts_on_cpu(common, smollm2, tmp_path, monkeypatch):
    """``--arrival closed --min-prompts 2 --min-rounds 3`` at batch 1: a run goes through 3
    rounds of distinct prompts (batch 1 on one prompt measured that prompt's acceptance,
    not the head's; --min-rounds raises the rounds past --min-prompts'), and a row says
    how many prompts a run used."""
    rows = _bench_rows(common, smollm2, tmp_path, monkeypatch,
                       ["--configs", "none,K=3", "--min-prompts", "2", "--min-rounds", "3"])
    assert [r["config"] for r in rows] == ["none", "K=3"]
    for row in rows:     # --min-rounds 3 over --min-prompts 2: 3 rounds of one prompt
        assert row["arrival"] == "closed" and row["prompts_per_run"] == 3
        assert row["median"] > 0


def test_prompt_rounds_say_when_a_run_sees_few_prompts(common, capsys):
    """ceil(min_prompts / batch) rounds, at least one; a note on stderr when a timed run
    sees fewer than FEW_PROMPTS distinct prompts (one prompt's acceptance is not the
    drafter's), none when it sees enough."""
    assert common.prompt_rounds(1, 1) == 1
    assert "1 prompt(s)" in capsys.readouterr().err
    assert common.prompt_rounds(16, 1) == 16 and common.prompt_rounds(16, 32) == 1
    assert common.prompt_rounds(17, 8) == 3
    # At least min_rounds: a batch the prompts fill in one round still runs several.
    assert common.prompt_rounds(16, 32, 4) == 4 and common.prompt_rounds(16, 1, 4) == 16
    assert capsys.readouterr().err == ""


def test_state_times_by_move(monkeypatch):
    """bench/profile_spec_gpu.py ``StateTimes.by_move``: an iteration pairs with the one
    before (and, with ``then``, the one after) only when they ran the same requests; the
    host time is the states less the read-back's wait."""
    monkeypatch.syspath_prepend(str(BENCH))
    times = importlib.import_module("profile_spec_gpu").StateTimes()
    ks = [0, 0, 0, 4, 4] * 4
    times.rows = [(k, {"VERIFY": 100.0 + k + i, "wait": 10.0}, ("a",)) for i, k in enumerate(ks)]
    times.rows.append((0, {"VERIFY": 999.0}, ("b",)))     # a new request: no move into it
    moves = times.by_move(least=1)
    assert {m: v["n"] for m, v in moves.items()} == {"0>0": 8, "0>4": 4, "4>0": 3, "4>4": 4}
    then = times.by_move(least=1, then=True)
    # The leaving iteration: the second K = 0 after one, then K = 4 (i = 2, 7, 12, 17).
    assert then["0>0>4"]["n"] == 4 and then["0>0>4"]["VERIFY"] == 100.0 + 9.5
    assert then["0>0>4"]["host"] == then["0>0>4"]["VERIFY"] - 10.0
    assert {m: v["n"] for m, v in then.items()} == {
        "0>0>0": 4, "0>0>4": 4, "0>4>4": 4, "4>0>0": 3, "4>4>0": 3}


@pytest.mark.slow
def test_host_wait_bench_at_a_batch_with_eagle3_on_cpu(common, smollm2, tmp_path, monkeypatch):
    """``host_wait_gpu.py --device cpu --batch 2 --configs "eagle3 adaptive<=3" --profile``
    in-process: a row per pass (unprofiled, then profiled) with the wall and the
    read-back wait an iteration, and the profiled row's text with the engine's functions
    by cumulative time."""
    bench = importlib.import_module("host_wait_gpu")
    monkeypatch.setattr(common, "load_smol", lambda device: smollm2)
    monkeypatch.setattr(bench, "quiet_logs", lambda: None)     # global: other tests log
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t, "split": "eval"}) + "\n" for t in
                               ("Tell me about llamas.", "What is 2+2?")))
    out = tmp_path / "host_wait.json"
    args = bench.argparse.Namespace(
        prompts=str(prompts), sets=2, tokens=4, device="cpu", profile=True, out=str(out),
        batch=2, configs="eagle3 adaptive<=3")
    bench.anyio.run(bench.main_async, args)
    rows = json.loads(out.read_text())
    assert [(r["config"], r["profiled"]) for r in rows] == [
        ("eagle3 adaptive<=3", False), ("eagle3 adaptive<=3", True)]
    for row in rows:
        assert row["batch"] == 2 and row["iterations"] > 0
        assert row["wall_ms_per_iteration"] > 0 and row["wait_ms_per_iteration"] >= 0
        assert (row["profile"] is not None) == row["profiled"]
    assert "cumulative" in rows[1]["profile"] and "specloop" in rows[1]["profile"]


def test_host_overhead_core_path_smoke(common, capsys):
    """``bench_host_overhead.py --gpu-path --consumers core``: the ProcessEngine core behind
    its pipe (PipeFrontDoor, the parent played by a thread that reads every message) on
    the CPU's frozen graph replays: it runs, every iteration's outputs reach the pipe, and
    a thread times the core's loop (which never yields while it has work)."""
    import argparse

    bench = importlib.import_module("bench_host_overhead")
    sent = []
    original = bench.PipeParent._drain

    def counting(self):
        original(self)
        sent.append(self.messages)
    bench.PipeParent._drain = counting
    try:
        bench.gpu_path_main(argparse.Namespace(
            methods="none", batch="3", k=3, runs=1, iterations=20, consumers="core",
            profile="", uvloop=False))
    finally:
        bench.PipeParent._drain = original
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("none K=0 batch 3 core")]
    wall = float(line.split("wall ")[1].split("-")[0])
    assert wall > 0
    # One "out" message an iteration at least (warm-up, the timed 20, the shutdown's).
    assert sent and sent[0] >= 20


def test_adaptive_sim_runs_the_real_rule(common):
    """bench/adaptive_sim.py drives engine/_adaptive.py's AdaptiveK on a simulated clock: a
    noiseless clock where K = 2 is clearly best lets the rule find it, and ``--set``
    changes a constant for the run only."""
    from specloop.engine import _adaptive

    sim = importlib.import_module("adaptive_sim")
    recent = _adaptive.RECENT
    (row,) = sim.main(["--iterations", "400", "--seeds", "1", "--sigma", "0", "--dwell", "0",
                       "--times", "1.0,1.1,1.2,3.0", "--accept", "0.9,0.9,0.1",
                       "--set", "RECENT=7"])
    assert _adaptive.RECENT == recent
    assert row["best_k"] == 2 and row["chosen"][2] > 300
    assert 0.9 < row["vs_best"] <= 1.0



def test_adaptive_sim_module_runs_another_rule_for_the_run_only(common, tmp_path):
    """``--module``: the rule of another engine/_adaptive.py (a commit's, to set beside
    this tree's) runs in place of this tree's, with ``--set`` applied to it, and the
    tree's module is back afterwards. The other file here always drafts K = 0 (its
    ``choose_by_rate`` patched), which this tree's rule never does on this clock."""
    import specloop.engine
    from specloop.engine import _adaptive

    other = tmp_path / "other_adaptive.py"
    other.write_text(Path(_adaptive.__file__).read_text() +
                     "\n\ndef choose_by_rate(candidates, expected, times):\n"
                     "    return candidates[0]\n")
    sim = importlib.import_module("adaptive_sim")
    args = ["--iterations", "400", "--seeds", "1", "--sigma", "0", "--dwell", "0",
            "--times", "1.0,1.1,1.2,3.0", "--accept", "0.9,0.9,0.1"]
    (row,) = sim.main([*args, "--module", str(other), "--set", "RECENT=7"])
    assert row["chosen"][0] > 300
    assert specloop.engine._adaptive is _adaptive and _adaptive.RECENT != 7
    (row,) = sim.main(args)
    assert row["chosen"].get(0, 0) < 100

def test_adaptive_sim_closed_rounds_end_with_their_slowest_row(common):
    """``--closed``: rounds of rows that end after their tokens. Per iteration K = 3 and
    K = 1 give the same tokens per ms here (1 + 0.9 + 0.81 + 0.729 = 3.439 in 2.0 ms
    against 1.9 in 1.105), but rows whose acceptance is spread (1 +- 0.8) end far apart,
    and a round lasts until its slowest row is done: K = 3's extra drafts help that row
    least, so K = 1 serves more over the rounds; steady rows (no ends) keep them level."""
    sim = importlib.import_module("adaptive_sim")
    common = ["--iterations", "2000", "--seeds", "1", "--sigma", "0", "--dwell", "0",
              "--batch", "16", "--times", "0.8,1.105,1.6,2.0", "--accept", "0.9,0.9,0.9"]
    (closed,) = sim.main(common + ["--closed", "64", "--spread", "0.8"])
    (steady,) = sim.main(common)
    assert closed["fixed"][1] > 1.05 * closed["fixed"][3], closed
    assert abs(steady["fixed"][1] / steady["fixed"][3] - 1) < 0.05, steady


def test_adaptive_sim_the_tail_drafts_for_the_slowest_rows(common):
    """The H200's batch-32 closed rounds (its fixed engines' iteration times and the
    eagle3 head's acceptance, spread 1 +- 0.5 a row): K = 1 serves the rounds best while
    per iteration K = 1 and K = 3 run level. The rule with the batch's tail (the
    default) finds K = 1; with pooled counts (``--pooled``) it drafts K = 3 half the time
    and loses. ``--first-bias``: each K's first samples 1.3x dear, as on the H200: the
    rule still finds K = 1, and without pricing a K not well measured from the anchor
    (``WELL_MEASURED=0``), without near runs (``EXPLORE_NEAR``: they try K = 1 as a
    contender every 32 choices) and without pricing a K not running from the running one
    (``FRESH_SPAN=0``: no K's window is ever fresh, so none is running) it never drafts
    K = 1 again. ``--refill`` (each row replaced
    as it ends: steady load) keeps the rule level with the best fixed K."""
    sim = importlib.import_module("adaptive_sim")
    common = ["--iterations", "1500", "--seeds", "1", "--sigma", "0", "--dwell", "0",
              "--batch", "32", "--times", "0.811,1.008,1.196,1.254",
              "--accept", "0.524,0.5,0.458", "--spread", "0.5"]
    (tail,) = sim.main(common + ["--closed", "128"])
    (pooled,) = sim.main(common + ["--closed", "128", "--pooled"])
    # (three seeds, their median: one seed's closed rounds move it by +-0.01 at this bar)
    biased = sim.main(common + ["--closed", "128", "--first-bias", "1.3", "--seeds", "3"])
    (stuck,) = sim.main(common + ["--closed", "128", "--first-bias", "1.3",
                                  "--set", "WELL_MEASURED=0", "--set", "EXPLORE_NEAR=100000",
                                  "--set", "FRESH_SPAN=0"])
    (steady,) = sim.main(common + ["--refill", "128"])
    assert tail["best_k"] == 1 and tail["vs_best"] > 0.97, tail
    assert pooled["vs_best"] < tail["vs_best"] - 0.03, pooled
    assert statistics.median(b["vs_best"] for b in biased) > 0.97, biased
    assert all(b["chosen"][1] > 1000 for b in biased), biased
    assert stuck["vs_best"] < 0.92 and stuck["chosen"][1] < 50, stuck
    assert steady["vs_best"] > 0.97, steady


def test_adaptive_sim_the_tail_waits_for_the_batch_to_drain(common):
    """A server's load at batch 64 where a row's acceptance rises through its answer
    (``--rise 0.5``; the shipped head on held-out prompts: E(3) 1.93 over an answer's first
    16 positions, 3.0 from 192 on). The tail (most tokens left) is then the newest rows,
    which accept least: the rule that prices E(k) from it at every iteration
    (``TAIL_QUIET=0``, the biased twin) drafts K = 1 for about half the run and loses to
    fixed K = 3; with the tail only while the batch drains (no join for TAIL_QUIET
    iterations: never here) it drafts K = 3 as the pooled counts do."""
    sim = importlib.import_module("adaptive_sim")
    args = ["--iterations", "1500", "--seeds", "1", "--sigma", "0", "--dwell", "0",
            "--batch", "64", "--refill", "128", "--lengths", "0.5", "--rise", "0.5",
            "--times", "1.0,1.25,1.4,1.4", "--accept", "0.55,0.45,0.40"]
    (every,) = sim.main(args + ["--set", "TAIL_QUIET=0"])
    (drained,) = sim.main(args)
    (pooled,) = sim.main(args + ["--pooled"])
    assert every["best_k"] == 3 and every["vs_best"] < 0.98 and every["chosen"][1] > 400, every
    assert drained["vs_best"] > 0.99 and drained["chosen"][3] > 1200, drained
    assert abs(drained["vs_best"] - pooled["vs_best"]) < 0.005, (drained, pooled)


def test_adaptive_sim_drain_objective_is_the_slowest_rows_rate(common):
    """``--drain-objective``'s E(k): one row (no slowest of several) keeps E(k); K = 0
    (no variance) keeps 1; with rows, a larger K's spread costs it more: here K = 1's
    rate stays ahead of K = 3's, which per iteration is 1.25x."""
    sim = importlib.import_module("adaptive_sim")
    expected = {0: 1.0, 1: 1.524, 2: 1.786, 3: 1.906}
    assert sim.drain_expected(expected, 128, 1) == pytest.approx(expected)
    many = sim.drain_expected(expected, 128, 32)
    assert many[0] == 1.0 and 1.40 < many[1] < 1.524 and many[3] < 1.906
    assert many[3] / many[1] < expected[3] / expected[1]
    assert sim.expected_max(32) == pytest.approx(2.07, abs=0.2)


@pytest.mark.slow
def test_core_cpu_ab_runs_both_trees(common, capsys):
    """bench/core_cpu_ab.py: the ProcessEngine core's host time, this tree against a commit
    checked out beside it (HEAD here), each in its own process importing its own tree;
    the worktree is removed afterwards."""
    import subprocess
    import sys

    bench = importlib.import_module("core_cpu_ab")
    worktrees = subprocess.run(["git", "-C", str(BENCH.parent), "worktree", "list"],
                               capture_output=True, text=True).stdout
    saved = sys.argv
    sys.argv = ["core_cpu_ab.py", "--base", "HEAD", "--batch", "2", "--rounds", "1",
                "--runs", "1", "--iterations", "20"]
    try:
        bench.main()
    finally:
        sys.argv = saved
    out = capsys.readouterr().out
    assert "batch 2 none: event-loop thread CPU us an iteration, HEAD" in out
    assert subprocess.run(["git", "-C", str(BENCH.parent), "worktree", "list"],
                          capture_output=True, text=True).stdout == worktrees


def test_chain_host_bench_holds_adaptive_k_in_closed_rounds_and_steady_load(common, tmp_path):
    """bench_chain_host.py ``--adaptive-at K`` holds adaptive K's one-rank path at K in
    closed rounds too (it ran the rule free there, unchained, until the twentieth
    session), and ``--steady`` is a server's load: requests end and others join while
    every iteration takes the chained step."""
    import anyio

    from specloop.models import load_model
    from specloop.models.testing import write_tiny_checkpoint

    bench = importlib.import_module("bench_chain_host")
    path = write_tiny_checkpoint(tmp_path / "t", vocab_size=384, num_layers=2, hidden=64,
                                 seed=1)
    loaded = load_model(path)
    cfg = bench.config(path, "eagle3", 3, 4, adaptive=True)
    rounds, per_k = anyio.run(bench.closed_rounds, cfg, loaded, 4, 1, False, 2)
    assert len(rounds) == 1 and per_k and set(per_k) == {2}, per_k
    wall, states, share, _, _, ended, _ = anyio.run(bench.measure, cfg, loaded, 4, 80, None,
                                                     2, True)
    # Requests of 20-80 tokens, 3 a row an iteration, over 80 iterations: several ended
    # (and others took their places), most iterations took the chained step.
    assert wall > 0 and "SCHEDULE" in states and ended >= 4 and share > 0.5, (ended, share)


def test_host_timers_time_methods_and_static_ones_and_restore_them(monkeypatch):
    """bench/_host_timers.py (``bench_process_gpu.py --timers``): every call set names a
    method that exists; installed, a method's and a staticmethod's calls are timed (the
    staticmethod still called without an instance); uninstalled, the originals are back."""
    monkeypatch.syspath_prepend(str(BENCH))
    timers_mod = importlib.import_module("_host_timers")
    for module, cls, name in timers_mod.ADAPTIVE_CALLS + timers_mod.CHAIN_CALLS + \
            timers_mod.CORE_CALLS:
        assert name in vars(getattr(importlib.import_module(module), cls)), (cls, name)
    from specloop.engine._chain import DeviceChain, in_order

    rows = DeviceChain.__dict__["_rows"]
    timers = timers_mod.HostTimers((("specloop.engine._chain", "DeviceChain", "_rows"),))
    timers.install()
    try:
        import torch
        out = {"packed": torch.zeros(2, 3, dtype=torch.int64), "hidden": torch.zeros(2, 2, 4)}
        out["token_ids"], out["num_accepted"] = out["packed"][:, :-1], out["packed"][:, -1]
        before = timers.snapshot()
        assert DeviceChain._rows(out, [0, 1], 2, 2) is out and in_order([0, 1])
        assert timers.since(before)["DeviceChain._rows"] > 0
    finally:
        timers.uninstall()
    assert DeviceChain.__dict__["_rows"] is rows


def test_process_pinned_kind_pins_the_core_and_leaves_the_others(common):
    """``bench_process_gpu.py --kinds process-pinned``: that ProcessEngine's config has
    ``parallel.pin_host_cores = "on"`` (its core pins its loop thread); the other kinds
    keep the config as given."""
    bench = importlib.import_module("bench_process_gpu")
    config = common.engine_config({"method": "none"}, 2, "cpu")
    assert config.parallel.pin_host_cores == "auto"
    pinned = bench._pinned(config, "process-pinned")
    assert pinned.parallel.pin_host_cores == "on" and pinned.model == config.model
    assert bench._pinned(config, "process") is config


def test_adaptive_host_bench_times_two_modules_call_by_call(common, capsys):
    """``bench_adaptive_host.py --against``: this tree's rule and another file's take turns
    (here the same file twice), each with a total and every call of the one-rank path, so
    a host-time change can be read per call on a shared box (the twenty-third session's
    hold: ``next_k``)."""
    bench = importlib.import_module("bench_adaptive_host")
    this = Path(__file__).parents[2] / "engine" / "_adaptive.py"
    bench.main(["--tail-batch", "8", "--iterations", "400", "--runs", "2",
                "--against", str(this)])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["tail, batch 8, this",
                                                      "tail, batch 8, other"]
    for line in lines:
        for call in ("total",) + bench.CALLS:
            assert f"; {call} [" in line or f": {call} [" in line, (call, line)
    with pytest.raises(SystemExit):
        bench.main(["--against", str(this)])    # the head's rule needs --tail-batch


def test_profile_records_what_adaptive_k_observes(monkeypatch):
    """bench/profile_spec_gpu.py ``record_observations`` on a real ``AdaptiveK`` (it
    wraps the rule's private ``_choose`` and the table's ``observe``: a rename in
    engine/_adaptive.py broke the bench before): each choice's last iteration is seen as
    (bucket, K, seconds, disturbed), and what the table made of each learned time."""
    from specloop.engine._adaptive import FIRST_SAMPLES, AdaptiveK, CostTable

    monkeypatch.syspath_prepend(str(BENCH))
    profile = importlib.import_module("profile_spec_gpu")
    adaptive = AdaptiveK((0, 3), CostTable({(1, 0): 1.0, (1, 3): 1.0}))
    record = profile.record_observations(adaptive)
    for i in range(FIRST_SAMPLES + 2):
        adaptive.commit(3)
        adaptive.choose_committed(1)
        adaptive.measured(0.002 + i * 0.001)
        if i == FIRST_SAMPLES:
            adaptive.disturb()
    assert len(record["seen"]) == FIRST_SAMPLES + 1     # the first choice had no iteration
    assert record["seen"][0] == (1, 3, 0.002, False)
    assert record["seen"][-1][:3] == (1, 3, 0.002 + FIRST_SAMPLES * 0.001)
    assert record["seen"][-1][3] is True
    kinds = [kind for k, kind, seconds, t in record["learned"]]
    assert kinds[:FIRST_SAMPLES] == ["first"] * FIRST_SAMPLES and kinds[-1] == "ignored"
    assert adaptive.cost.tried(1, 3)


def test_serve_bench_default_config_is_a_file_with_ngram(monkeypatch):
    """bench/bench_serve.py with no --config reads a config that exists (its default was
    the package's engine/defaults/smollm2-ngram.toml, gone since c141830: the server quit
    with "config file ... not found"); the direct engine's config comes from the same
    file, n-gram as the benched method."""
    from specloop.engine import EngineConfig

    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("bench_serve")
    seen = []
    monkeypatch.setattr(bench, "bench_method",
                        lambda args, method, levels, run: seen.append(args) or [])
    monkeypatch.setattr("sys.argv", ["bench_serve.py", "--methods", "ngram"])
    bench.main()
    config = Path(seen[0].config)
    assert config.is_file(), config
    assert EngineConfig.from_toml(str(config)).speculative.method == "ngram"


async def test_ttft_probe_splits_each_request_into_parts_that_add_up(common, tiny_dir,
                                                                    tiny_loaded):
    """bench/probe_ttft_gpu.py's ``Timeline`` on a tiny n-gram engine at batch 1: one
    admission a request, paired in order; its parts (door, hops, the target's and the
    drafter's prefill, the first iteration) add up to the request's ttft."""
    probe = importlib.import_module("probe_ttft_gpu")
    prompts = [[[5, 17, 99, 3, 42]], [[200, 201, 202, 200, 201]], [[7, 8, 9]]]
    timeline = probe.Timeline(cuda=False)
    async with AsyncEngine(make_config(tiny_dir, method="ngram", max_batch_size=1),
                           model=tiny_loaded, observers=[timeline]) as engine:
        timeline.watch(engine.worker)
        times: list = []
        await common.timed_sets(engine, prompts, 4, lambda: None, 0.0, times)
    assert [a["prompt"] for a in timeline.admits] == [5, 5, 3]
    got = probe.split(timeline, times)
    parts = ("door", "hop_in", "target", "drafter", "hop_out", "first_iter")
    assert all(got[p] >= 0 for p in parts)
    # Medians of parts need not add up to the median's sum: check one request's.
    single = probe.Timeline(cuda=False)
    single.admits, single.transitions = timeline.admits[:1], timeline.transitions
    first = probe.split(single, times[:1])
    assert sum(first[p] for p in parts) == pytest.approx(first["ttft"], abs=0.5)
    assert first["states"]["VERIFY"] > 0 and first["states"]["SCHEDULE"] > 0
    with pytest.raises(RuntimeError, match="3 admissions for 2 requests"):
        probe.split(timeline, times[:2])


def test_acceptance_by_position_counts_a_chain_per_band(common):
    """bench/acceptance_by_position.py: a chain of k accepts the leading zero ranks of a
    start's true path, at most k (a path cut by a token outside the draft vocabulary ends
    there); each band's E(k) is 1 + the mean over its starts, the last band open."""
    study = importlib.import_module("acceptance_by_position")
    assert [study.chain_accepted((0, 0, 1), k) for k in (1, 2, 3)] == [1, 2, 2]
    assert study.chain_accepted((2, 0, 0), 3) == 0 and study.chain_accepted((0,), 3) == 1
    answers = [[(0, 0, 0), (1,), (0, 1, 0), (0, 0, 0)],
               [(0, 0, 0), (0, 0, 0), (3, 0, 0)]]
    bands = study.by_band(answers, [0, 2])
    assert [b["band"] for b in bands] == [[0, 2], [2, None]]
    assert [b["starts"] for b in bands] == [4, 3]
    # Band 0..1: starts (0,0,0), (1,), (0,0,0), (0,0,0): chains of 3 accept 3, 0, 3, 3.
    assert bands[0]["E1"] == 1.75 and bands[0]["E3"] == 3.25
    # Band 2..: (0,1,0), (0,0,0), (3,0,0): chains of 2 accept 1, 2, 0.
    assert bands[1]["E2"] == 2.0 and bands[1]["E3/E2"] == round((1 + 4 / 3) / 2.0, 4)


def test_probe_tree_counts_tries_hits_and_siblings(common):
    """bench/probe_tree_gpu.py's ``NodeCounts`` on one hand-made VERIFY of the tree
    ((0), (1), (0, 0)): a node is tried where its parent is on the accepted path and hits
    where its token is then the target's after the parent; siblings drafting one token
    count as duplicates; a path that differs from ``accept_tree``'s is a mismatch."""
    import torch

    from specloop.samplers._tree import DraftTree, accept_tree

    probe = importlib.import_module("probe_tree_gpu")
    counts = probe.NodeCounts(DraftTree([(0,), (1,), (0, 0)]))
    # Columns: root, (0), (1), (0, 0). Row 0: (0) hits (target after the root is 7), then
    # (0, 0) misses; row 1: (1) hits, (0) and (1) hold one token (duplicates).
    tokens = torch.tensor([[5, 7, 8, 9], [5, 6, 6, 2]])
    target = torch.tensor([[7, 4, 0, 0], [6, 1, 3, 0]])
    want = accept_tree(counts.tables, tokens, target)
    counts.add(tokens, target, want.num_accepted, want.path)
    row = counts.row()
    assert row["calls"] == 1 and row["kernel_mismatch"] == 0
    by = {tuple(n["path"]): (n["tries"], n["hits"], n["dup"]) for n in row["nodes"]}
    assert by[(0,)] == (2, 2, 1) and by[(1,)] == (2, 1, 1)
    assert by[(0, 0)] == (2, 0, 0)
    counts.add(tokens, target, want.num_accepted + 1, want.path)     # a wrong count
    assert counts.row()["kernel_mismatch"] == 1


@pytest.mark.slow
async def test_core_timers_ride_the_stats_a_process_engine_hands_over(common, tiny_dir):
    """``bench_process_gpu.py --core-timers``: the core builds ``CoreTimers`` from its
    config (the bench's folder is on the spawned process's path), times its own calls and
    states there, and the parent reads their growth off the stats it fetches: over a
    stretch of requests (speculative: the draft path too) the core's commit, its rows to
    the pipe and every state's time grew, per iteration. Without ``--core-timers`` the
    config is the one given (no observer: the core times nothing)."""
    from specloop.engine import ProcessEngine
    from specloop.samplers import SamplingParams

    from .conftest import PROMPTS

    bench = importlib.import_module("bench_process_gpu")
    timers = importlib.import_module("_host_timers")
    config = make_config(tiny_dir, method="ngram", k=2)
    assert bench._core_timed(config, False) is config
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def serve(engine):
        for prompt in PROMPTS[:3]:
            async for _ in engine.generate(prompt, params):
                pass

    async with ProcessEngine(bench._core_timed(config, True)) as engine:
        await serve(engine)
        before = await engine.fetch_stats()
        await serve(engine)
        after = await engine.fetch_stats()
    key, pair = ("ngram", "process", 0), ("ngram", "process")
    calls, states, moves = bench.core_totals([key], {key: [(after, before)]}, pair)
    iterations = after.num_iterations - before.num_iterations
    per_call = timers.per_iteration(calls, iterations, 1e6)
    assert iterations > 10 and per_call["Outputs.commit"] > 0, per_call
    assert per_call["PipeFrontDoor.deliver_rows"] > 0, per_call
    per_state = timers.per_iteration(states, iterations)
    assert {"SCHEDULE", "SYNC", "DRAFT", "VERIFY", "RESCAN"} <= set(per_state), per_state
    # Every iteration with rows is one move of K at its rows' class (fixed K = 2, one
    # request at a time: "2>2@1", the first "None>2@1"), its wall the sum of its states'
    # and its wait for the read-back a part of it.
    per_move = bench.per_move(moves, least=1)
    assert set(per_move) <= {"2>2@1", "None>2@1"} and per_move["2>2@1"]["n"] > 10, per_move
    assert 0 <= per_move["2>2@1"]["wait"] < per_move["2>2@1"]["wall"], per_move
    # The share of its iterations whose read-back waited < HOST_BOUND_US (on this CPU
    # nearly all; a loaded box can stretch a read-back call past it).
    assert 0.5 <= per_move["2>2@1"]["host_bound"] <= 1.0, per_move
    assert sum(m["n"] for m in per_move.values()) == iterations, (per_move, iterations)


def test_open_bars_judges_each_bar_from_one_lease_rows(monkeypatch):
    """bench/open_bars.py: batch 1's bars from each process's own ratios (the best fixed
    eagle3 config; n-gram over its AL), batch 32's and adaptive K's from a server's load
    (the medians), each judged against its bar; a row from another device is not the H200
    bar's "met"."""
    monkeypatch.syspath_prepend(str(BENCH))
    bars = importlib.import_module("open_bars")
    h200, h100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"

    def ab(device, tree, ngram):
        return [{"batch": 1, "config": "none", "vs_none": 1.0, "al": 1.0, "device": device},
                {"batch": 1, "config": "ngram K=4", "vs_none": ngram, "al": 1.4,
                 "device": device},
                {"batch": 1, "config": "eagle3 K=3", "vs_none": 1.3, "al": 1.9,
                 "device": device},
                {"batch": 1, "config": "eagle3 tree31", "vs_none": tree, "al": 2.6,
                 "device": device}]

    def served(batch, none, k2, k3, adaptive, device=h200):
        return [{"batch": batch, "config": c, "median": m, "kind": "process", "device": device}
                for c, m in (("none", none), ("eagle3 K=2", k2), ("eagle3 K=3", k3),
                             ("eagle3 adaptive<=3", adaptive),
                             ("eagle3 adaptive{2+3}", 10 * k3),      # not the shipped rule
                             ("eagle3 K=2 twin", 10 * k2))]     # judged, not among the best

    verdicts = bars.judge([("a", ab(h200, 1.62, 1.12)), ("b", ab(h200, 1.58, 1.15)),
                           ("p", served(32, 100.0, 120.0, 110.0, 118.0)
                            + served(128, 100.0, 110.0, 112.0, 106.0))])
    by = {v.measure: v for v in verdicts}
    first = by[bars.BAR_BATCH1[1]]
    assert first.figures == [1.62, 1.58] and first.met == "met"          # median 1.60
    assert by[bars.BAR_NGRAM[1]].figures == pytest.approx([0.8, 1.15 / 1.4])
    assert by[bars.BAR_NGRAM[1]].met == "met"
    assert by[bars.BAR_BATCH32[1]].figures == pytest.approx([1.2])
    at32, at128 = (by[f"{bars.BAR_ADAPTIVE[1]}: {b}"] for b in (32, 128))
    assert at32.figures == pytest.approx([118 / 120]) and at32.met == "met"
    assert at128.figures == pytest.approx([106 / 112]) and at128.met == "not met"
    # The biased twins: a batch-1 ratio under its bar, and the same rows from an H100.
    low = bars.judge([("a", ab(h200, 1.55, 1.05))])
    assert [v.met for v in low[:2]] == ["not met", "not met"]
    other = bars.judge([("a", ab(h100, 1.7, 1.2))])
    assert other[0].met == "met there; the bar is the H200's"
    assert "| 13 | batch 1" in bars.table(verdicts) and "not run" in bars.table(low)


def test_host_timers_skip_an_optional_call_that_is_missing(monkeypatch):
    """bench/_host_timers.py: Triton's compile (COMPILE_CALLS) is timed where it exists and
    skipped where it does not; a missing call of the engine's own is an error (a renamed
    method would otherwise drop out of every table unseen)."""
    monkeypatch.syspath_prepend(str(BENCH))
    timers_mod = importlib.import_module("_host_timers")
    missing = ("specloop.engine._outputs", "Outputs", "no_such_method")
    monkeypatch.setattr(timers_mod, "OPTIONAL", timers_mod.OPTIONAL | {missing})
    timers = timers_mod.HostTimers(timers_mod.CORE_CALLS + (missing,)
                                   + timers_mod.COMPILE_CALLS)
    timers.install()
    try:
        labels = {f"{cls.__name__}.{name}" for cls, name, _ in timers._originals}
        assert "Outputs.no_such_method" not in labels and "PipeFrontDoor.send" in labels
        if importlib.util.find_spec("triton") is not None:
            assert "JITFunction._do_compile" in labels
    finally:
        timers.uninstall()
    required = timers_mod.HostTimers((("specloop.engine._outputs", "Outputs", "nope"),))
    with pytest.raises(KeyError):
        required.install()


def test_adaptive_samples_are_grouped_by_k_kind_place_and_disturbance(common, tmp_path):
    """bench/adaptive_samples_host.py: ``group`` puts each learned sample of one bucket
    under (K, own / switch / leave, its place in its run of that K, capped, disturbed);
    ``recorded_samples`` sees a real rule's ``observe`` calls and puts the method back."""
    bench = importlib.import_module("adaptive_samples_host")
    from specloop.engine._adaptive import CostTable

    samples = [(8, 3, 1e-3, False, False, False), (8, 3, 2e-3, True, False, False),
               (8, 3, 3e-3, False, False, True), (4, 1, 9e-3, False, False, False),
               (8, 2, 4e-3, False, True, False), (8, 2, 5e-3, False, False, False),
               (8, 2, 6e-3, False, False, False), (8, 2, 7e-3, False, False, False)]
    grouped = bench.group(samples, 8, cap=3)
    assert grouped == {(3, "own", 1, False): [1.0], (3, "own", 2, True): [2.0],
                       (3, "leave", 3, False): [3.0], (2, "switch", 1, False): [4.0],
                       (2, "own", 2, False): [5.0], (2, "own", 3, False): [6.0, 7.0]}
    original = CostTable.observe
    with bench.recorded_samples() as seen:
        cost = CostTable({(1, 0): 1e-3, (1, 1): 2e-3})
        cost.observe(1, 1, 3e-3, disturbed=True)
    assert seen == [(1, 1, 3e-3, True, False, False)] and cost.samples[(1, 1)] == 1
    assert CostTable.observe is original


def test_steady_setup_keeps_a_queue_beyond_the_batch(common):
    """``--steady-queue``: the requests in flight are the batch and that share of it more
    (rounded up), waiting in the engine's queue so a finished row is replaced there at
    once; 0 keeps the batch alone, and closed rounds have no steady setup."""
    import argparse

    ap = argparse.ArgumentParser()
    common.add_arrival_args(ap)

    def in_flight(*argv, batch=256):
        args = ap.parse_args(["--arrival", "steady", "--steady-rounds", "8", *argv])
        prompts, requests, spread, flight, _ = common.steady_setup(
            args, _Tokenizer(), ["a", "b"], batch)
        assert requests == max(8 * batch, 32) and spread == 0.5 and len(prompts) == requests
        return flight
    assert in_flight() == 256 + 64                  # the default, 0.25
    assert in_flight("--steady-queue", "0") == 256
    assert in_flight("--steady-queue", "0.25", batch=3) == 4
    assert common.steady_setup(ap.parse_args([]), _Tokenizer(), ["a"], 8) is None


class _Tokenizer:
    """A chat encoder, as ``chat_prompts`` takes it."""

    def encode_chat(self, messages):
        return [len(m["content"]) for m in messages]


def test_parent_outputs_bench_delivers_every_output(common, smollm2_dir):
    """``bench_parent_outputs.py`` feeds a ``ProcessEngine``'s parent as a core would, with
    no core: every output of every request reaches its consumer, as rank 0's rows and as
    another rank's block (its own assertion), and a time comes back. It rotted once
    unnoticed (the parent's core facts gained ``verify_drafts``)."""
    import anyio  # noqa: PLC0415

    bench = importlib.import_module("bench_parent_outputs")
    for blocks, detokenize in ((False, True), (False, False), (True, True)):
        assert anyio.run(bench.run, 4, 3, blocks, detokenize) > 0
