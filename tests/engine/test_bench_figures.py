"""What the H200 benches' figures are made of, checked on the CPU: how many requests a
steady run submits (bench/_common.py; the timed window is the finishes between the
batch-th and the last submission, so the requests set how long a run measures), and
bench_process_gpu.py's adaptive-over-its-K-mix ratio."""

import argparse
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def common(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("_common")


def _args(common, *argv):
    ap = argparse.ArgumentParser()
    common.add_arrival_args(ap)
    return ap.parse_args(list(argv))


def test_steady_rounds_scale_the_requests_with_the_batch(common):
    # The default keeps the figures before --steady-rounds comparable: 4 batches a run.
    assert common.steady_requests(_args(common), 32) == 128
    assert common.steady_requests(_args(common), 1) == 32          # never below 32
    assert common.steady_requests(_args(common, "--steady-rounds", "16"), 32) == 512
    assert common.steady_requests(_args(common, "--steady-rounds", "16"), 1) == 32
    # --requests wins over the rounds.
    assert common.steady_requests(_args(common, "--steady-rounds", "16", "--requests", "70"),
                                  32) == 70


def test_steady_requests_ask_for_token_ids_unless_text_is_on(common):
    """``--steady-text`` (default off): a steady run's requests ask for token ids only
    (``SamplingParams.detokenize=False``), all its client reads; on: text as before."""
    import anyio

    asked = []

    class Engine:
        async def generate(self, ids, params):
            asked.append(params.detokenize)
            yield type("Out", (), {"token_ids": (1,) * params.max_tokens})()

    class Tokenizer:
        def encode_chat(self, messages):
            return [1, 2]

    for argv, want in (((), False), (("--steady-text", "on"), True)):
        args = _args(common, "--arrival", "steady", *argv)
        steady = common.steady_setup(args, Tokenizer(), ["a question"], 2)
        assert steady.detokenize is want
        asked.clear()
        anyio.run(common.steady_load, Engine(), steady.prompts, 4, 2, 6, 0.0, 0, None,
                  steady.detokenize)
        assert asked and set(asked) == {want}


def test_request_times_split_a_closed_rounds_wall(common):
    """``timed_round``'s per-request times: the wait for the first output, the pace after
    it (per output, not per token: an output may carry several), and the round's end
    after the last output; they add up to the round's wall at batch 1."""
    import anyio

    class Engine:   # a request: 3 ms to the first output, then 4 outputs 1 ms apart
        async def generate(self, ids, params):
            await anyio.sleep(0.003)
            for _ in range(4):
                yield [1]
                await anyio.sleep(0.001)

    times: list = []
    wall = anyio.run(common.timed_round, Engine(), [[1, 2]], 8, lambda: None, 0.0, times)
    [(submitted, first, last, outputs, end)] = times
    assert outputs == 4 and submitted < first < last <= end
    got = common.request_times(times)
    assert 2.5 <= got["ttft_ms"] < 300 and 0.8 <= got["ms_per_output"] < 100
    assert got["end_ms"] >= 0.8          # the sleep after the last output
    # Short of the wall by the task's start only (submitted - the round's start).
    parts = got["ttft_ms"] + 3 * got["ms_per_output"] + got["end_ms"]
    assert -0.01 <= wall * 1e3 - parts < 20
    assert common.request_times([]) == {}


def test_adaptive_vs_mix_prices_each_k_at_its_fixed_engine(common):
    """``vs_mix``: adaptive's wall per iteration over the same K mix at the fixed configs'
    walls (K = 0 at "none"'s); None when a K it ran has no fixed config beside it."""
    bench = importlib.import_module("bench_process_gpu")
    fixed = {"none": 1.0, "eagle3 K=1": 2.0, "eagle3 K=3": 3.0, "ngram K=4": 9.0}
    # 1 iteration at K = 0, 1 at K = 1, 2 at K = 3: mix (1 + 2 + 6) / 4 = 2.25 ms.
    per_k = {"0": 1, "1": 1, "2": 0, "3": 2}
    assert bench.adaptive_vs_mix("eagle3 adaptive<=3", per_k, 2.7, fixed) == \
        pytest.approx(1.2)
    # K = 2 ran, no fixed K = 2 beside it (another method's K does not stand in).
    assert bench.adaptive_vs_mix("eagle3 adaptive<=3", {**per_k, "2": 1}, 2.7, fixed) is None
    assert bench.adaptive_vs_mix("ngram adaptive<=4", {"0": 1, "4": 1}, 5.0, fixed) == \
        pytest.approx(1.0)
    assert bench.fixed_k("eagle3 adaptive{3}") is None
    assert bench.fixed_k("none") == ("", 0) and bench.fixed_k("eagle3 K=3") == ("eagle3", 3)
    # Its choices: AL 2.0 (its drafting iterations'; 3 of its 4, the K = 0 one makes 1
    # token: 1.75 an iteration) over the mix's 2.25 ms against the best fixed config's
    # rate (K = 3: AL 2.4 over 3.0 ms = 0.8 a ms; K = 1: 1.5 / 2.0 = 0.75; none: 1 / 1).
    als = {"none": None, "eagle3 K=1": 1.5, "eagle3 K=3": 2.4, "ngram K=4": 3.0}
    eagle = dict(fixed)                     # n-gram's K = 4 is another method's: not counted
    assert bench.mix_vs_best("eagle3 adaptive<=3", per_k, 2.0, eagle, als) == \
        pytest.approx(1.75 / 2.25 / 1.0, abs=1e-3)      # none's 1 token a ms is the best
    eagle["none"] = 2.0
    assert bench.mix_vs_best("eagle3 adaptive<=3", per_k, 2.0, eagle, als) == \
        pytest.approx((1.75 / ((2 + 2 + 6) / 4)) / 0.8, abs=1e-3)
    assert bench.mix_vs_best("eagle3 adaptive<=3", per_k, None, eagle, als) is None
    # The engine's counters key K by int (the rows' JSON by str): the same figure.
    by_int = {int(k): n for k, n in per_k.items()}
    assert bench.mix_vs_best("eagle3 adaptive<=3", by_int, 2.0, eagle, als) == \
        bench.mix_vs_best("eagle3 adaptive<=3", per_k, 2.0, eagle, als)
    # A twin is judged like a rule, its iterations priced at its fixed config's.
    assert bench.fixed_k("eagle3 K=2 twin") is None
    assert bench.adaptive_vs_mix("eagle3 K=2 twin", {"2": 4}, 2.2, {"eagle3 K=2": 2.0}) == \
        pytest.approx(1.1)


def test_adaptive_vs_max_judges_rules_and_twins_against_the_rest(common, capsys):
    """The bar's line: an adaptive config and a fixed config's twin over the best of the
    others (neither counts among them), by medians and run by run, and against the one
    config best by medians run by run."""
    bench = importlib.import_module("bench_process_gpu")
    rates = {"eagle3 K=2": [100.0, 90.0, 110.0], "eagle3 K=3": [95.0, 99.0, 80.0],
             "eagle3 adaptive<=3": [97.0, 96.0, 99.0], "eagle3 K=2 twin": [120.0, 90.0, 99.0]}
    bench.adaptive_vs_max(128, "process", list(rates), rates)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "batch 128 process: eagle3 adaptive<=3 / max(others) = 0.970 (medians); runs "
        "0.970 0.970 0.900; / eagle3 K=2 run by run: median 0.970",
        "batch 128 process: eagle3 K=2 twin / max(others) = 0.990 (medians); runs "
        "1.200 0.909 0.900; / eagle3 K=2 run by run: median 1.000"]


def test_replicas_merge_their_counters_and_keep_each_runs(common):
    """``bench_process_gpu.py --replicas``: a config's engines (one core process each) are
    one row: counters summed over the replicas (AL, K mix, iterations), runs listed
    replica after replica, each replica's median beside them; a config of one engine has
    no ``replica_medians``."""
    from types import SimpleNamespace

    bench = importlib.import_module("bench_process_gpu")

    def stats(drafting, accepted, iterations, overlapped, per_k):
        # Every row drafted: verified rows are the drafting rows.
        return SimpleNamespace(num_drafting_rows=drafting, num_accepted_tokens=accepted,
                               num_iterations=iterations, num_overlapped_iterations=overlapped,
                               iterations_per_k=per_k, num_verify_rows=drafting)

    zero = stats(0, 0, 0, 0, {})
    keys = [("a", "process", 0), ("a", "process", 1), ("k", "process", 0)]
    # Each run's counters after and before it (or its steady window): summed.
    deltas = {keys[0]: [(stats(60, 30, 14, 14, {2: 4, 3: 10}), stats(10, 0, 10, 10, {3: 10})),
                        (stats(110, 60, 20, 20, {2: 12, 3: 18}),
                         stats(60, 30, 14, 14, {2: 4, 3: 10}))],
              keys[1]: [(stats(100, 40, 10, 9, {3: 10}), zero)],
              keys[2]: [(stats(50, 50, 50, 50, {3: 50}), zero)]}
    rates = {keys[0]: [1.0, 3.0], keys[1]: [5.0, 7.0], keys[2]: [2.0]}
    walls = {keys[0]: [0.01, 0.01], keys[1]: [0.02, 0.0], keys[2]: [0.1]}
    speeds = {keys[0]: [1, 2], keys[1]: [3, 4], keys[2]: [5]}
    merged = bench.merge_replicas(keys, deltas, rates, walls, speeds,
                                  {keys[0]: [4, 6], keys[1]: [5, 0], keys[2]: [50]})
    got_rates, al, extra, iterations = merged["a", "process"]
    # Each run's wall over its iterations (a run of none left out), and their median.
    assert extra["iteration_ms_runs"] == [2.5, pytest.approx(1.667), 4.0]
    assert extra["iteration_ms_median"] == 2.5
    # Each run's rows an iteration (its verified rows over its iterations).
    assert extra["rows_runs"] == [12.5, 8.3, 10.0]
    assert got_rates == [1.0, 3.0, 5.0, 7.0] and iterations == 20
    assert al == pytest.approx(1 + 100 / 200)          # (60 + 40) / (100 + 100)
    assert extra["iterations_per_k"] == {2: 12, 3: 18}  # 8 + 10 at K = 3
    assert extra["overlapped"] == pytest.approx(19 / 20)
    assert extra["iteration_ms"] == pytest.approx(40 / 20)
    assert extra["host_python_us"] == [1, 2, 3, 4] and extra["replica_medians"] == [2.0, 6.0]
    single = merged["k", "process"]
    assert single[0] == [2.0] and "replica_medians" not in single[2] and single[1] == 2.0


def test_adaptive_sim_admissions_cost_and_are_disturbed(common, monkeypatch):
    """bench/adaptive_sim.py ``--refill --lengths --disturbed``: rows of spread lengths are
    refilled at different iterations (equal lengths stay in step: all at once), an
    iteration that admits refilled rows takes ``--disturbed`` ms more at any K, and the
    rule is told that iteration and the one before it are disturbed, as the engine's
    clock tells it."""
    import random

    from specloop.engine import _adaptive

    sim = importlib.import_module("adaptive_sim")
    base = ["--batch", "4", "--refill", "10", "--sigma", "0", "--dwell", "0",
            "--times", "1.0,1.0", "--accept", "0.5", "--iterations", "100", "--seeds", "1"]

    def args(*extra):
        return sim.parser().parse_args(base + list(extra))

    def refills(*extra) -> list[int]:
        rows = sim.Rows(args(*extra), random.Random(0))
        out = []
        for i in range(60):
            rows.step(0)
            if rows.refilled:
                out.append(i)
        return out

    assert refills() == [9, 19, 29, 39, 49, 59]         # every row at once, every 10th
    assert len(refills("--lengths", "0.5")) > 12        # spread: 3x the iterations admit

    plain, costly = sim.run_fixed(0, args(), 0), sim.run_fixed(0, args("--disturbed", "1"), 0)
    # K = 0, 4 rows of 10 tokens, 1 ms an iteration: the 9 iterations in 100 that admit
    # (after each 10th) take 1 ms more, 100 ms -> 109 ms for the same tokens.
    assert plain / costly == pytest.approx(1.09)

    told = []
    monkeypatch.setattr(_adaptive.AdaptiveK, "disturb",
                        lambda self: told.append(self._calls))
    sim.run_rule(args(), 0)
    assert told == []                                   # nothing disturbed without it
    sim.run_rule(args("--disturbed", "1"), 0)
    # Each admitting iteration and the one before it, at K = 0 (with drafts the rows
    # end at other iterations): 2 x 9, and the rule's calls two apart each time.
    assert len(told) >= 18 and len(set(told)) == len(told)


def test_adaptive_sim_unseen_cost_flips_the_best_k_and_the_rule_follows(common):
    """bench/adaptive_sim.py ``--unseen``: the H200's batch 32 under a server's load
    (twenty-sixth session). On the rule's clock alone K = 1 makes the most tokens a ms;
    with the 0.35 ms every iteration pays beyond it, K = 3 does (the fixed engines
    measured so). The rule, told that cost only through the iterations' time with the
    prefill (X(b)), drafts the best K in both and stays within 3 % of it."""
    sim = importlib.import_module("adaptive_sim")
    base = ["--batch", "32", "--refill", "128", "--lengths", "0.5",
            "--times", "0.71,0.93,1.14,1.20", "--accept", "0.53,0.47,0.52",
            "--sigma", "0.1", "--slow", "1", "--dwell", "0", "--iterations", "1500",
            "--seeds", "1"]
    for unseen, best in (("0", 1), ("0.35", 3)):
        (row,) = sim.main(base + ["--unseen", unseen])
        assert row["best_k"] == best
        assert max(row["chosen"], key=row["chosen"].get) == best
        assert row["vs_best"] >= 0.97


def test_every_bench_script_imports():
    """Every bench/*.py imports against this tree (in a fresh interpreter: some set
    sys.path or torch's threads at import). The GPU benches run only on a lent H200, so a
    name they import that the engine renamed would otherwise surface there, costing
    device time (bench_serve.py and profile_spec_gpu.py had rotted that way: they now have
    tests of their own)."""
    import subprocess
    import sys

    code = (
        "import importlib, pathlib, sys\n"
        f"sys.path.insert(0, {str(BENCH)!r})\n"
        "bad = {}\n"
        f"for p in sorted(pathlib.Path({str(BENCH)!r}).glob('*.py')):\n"
        "    try:\n"
        "        importlib.import_module(p.stem)\n"
        "    except Exception as e:\n"
        "        bad[p.name] = repr(e)\n"
        f"print(len(list(pathlib.Path({str(BENCH)!r}).glob('*.py'))), bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    count, bad = out.stdout.strip().split(" ", 1)
    assert int(count) > 40 and bad == "{}", out.stdout


def test_trace_kernels_orders_one_iteration_by_launch(monkeypatch):
    """bench/trace_kernels.py: iterations end at the read-back (device to host), the
    partial first and last are dropped, the most common sequence is summarized by
    position (median gap and duration), and kernels of one graph replay share a launch
    label."""
    monkeypatch.syspath_prepend(str(BENCH))
    trace_kernels = importlib.import_module("trace_kernels")
    events, ts, corr = [], 0, 0
    for it in range(6):
        for launch, names in (("cudaGraphLaunch", ["glue", "head"]),
                              ("cudaMemcpyAsync", ["Memcpy DtoH (Device -> Pinned)"])):
            corr += 1
            events.append({"cat": "cuda_runtime", "name": launch, "ts": ts, "dur": 1,
                           "args": {"correlation": corr}})
            for name in names:
                dur = 5 if name == "head" and it == 3 else 2     # one slow iteration
                events.append({"cat": "gpu_memcpy" if "Memcpy" in name else "kernel",
                               "name": name, "ts": ts, "dur": dur,
                               "args": {"correlation": corr}})
                ts += dur + 1
    seen, common, rows = trace_kernels.summarize({"traceEvents": events})
    assert (seen, common) == (4, 4)
    assert [(label, name) for label, name, _, _ in rows] == [
        ("01 GraphLaunch", "glue"), ("01 GraphLaunch", "head"),
        ("02 MemcpyAsync", "Memcpy DtoH (Device -> Pinned)")]
    assert [(gap, dur) for _, _, gap, dur in rows] == [(0.0, 2), (1, 2), (1, 2)]


def test_adaptive_sim_spill_charges_a_switch_to_its_run_first_two_iterations(common,
                                                                             monkeypatch):
    """bench/adaptive_sim.py ``--spill S``: after a switch of K, the run's first iteration
    takes 2 S more (x its T) and its second S more; a run that began no switch (the first)
    and later iterations nothing; the fixed engines (no switches) nothing."""
    from specloop.engine import _adaptive

    sim = importlib.import_module("adaptive_sim")
    base = ["--batch", "4", "--sigma", "0", "--dwell", "0", "--times", "1.0,1.0",
            "--accept", "0.5", "--iterations", "12", "--seeds", "1"]
    cycle = [0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 0, 0]
    calls = iter(cycle)
    monkeypatch.setattr(_adaptive.AdaptiveK, "choose", lambda self, *a, **kw: next(calls))
    took = []
    monkeypatch.setattr(_adaptive.AdaptiveK, "measured",
                        lambda self, seconds, *a: took.append(round(seconds * 1e3, 6)))
    sim.run_rule(sim.parser().parse_args(base + ["--spill", "0.1"]), 0)
    assert took == [1.0, 1.0, 1.0, 1.2, 1.1, 1.0, 1.0, 1.2, 1.2, 1.1, 1.2, 1.1]
    args = sim.parser().parse_args(base + ["--spill", "0.1"])
    assert sim.run_fixed(0, args, 0) == sim.run_fixed(
        0, sim.parser().parse_args(base), 0)


async def test_one_engine_sweep_caps_one_engine_a_config_at_each_batch(common, monkeypatch,
                                                                       tiny_dir, tiny_loaded):
    """``bench_process_gpu.py --one-engine`` (``sweep``): each config's engine is built once,
    for the largest batch, and capped at each batch in turn (``set_max_running``): under
    steady load with requests waiting beyond the batch, every window runs at most that
    batch's rows, and each batch is reported as it is done."""
    from .conftest import PROMPTS, make_config

    bench = importlib.import_module("bench_process_gpu")
    built = []

    def config(spec, batch, device, buckets):
        built.append((spec["method"], batch))
        return make_config(tiny_dir, method=spec["method"], max_batch_size=batch)

    monkeypatch.setattr(bench, "engine_config", config)
    per_batch = []
    for batch in (1, 3):
        sets = [PROMPTS[:batch]]
        # Twice the batch in flight: the cap, not the client, holds the batch.
        steady = common.SteadySetup(PROMPTS, 8 * batch, 0.0, 2 * batch)
        per_batch.append((batch, sets, steady))
    reported = []
    got = await bench.sweep(per_batch, ["none", "ngram K=4"], ["in-process"], tiny_loaded,
                            6, 1, "cpu", "stream", "serving",
                            report=lambda batch, *rest: reported.append(batch))
    assert sorted(built) == [("ngram", 3), ("none", 3)]      # one engine a config
    assert reported == [1, 3] and sorted(got) == [1, 3]
    for batch in (1, 3):
        for name in ("none", "ngram K=4"):
            rates, _, extra = got[batch][name, "in-process"]
            assert rates[0] > 0
            assert 0 < max(extra["rows_runs"]) <= batch


def test_adaptive_sim_ahead_commits_the_next_k_and_leaves_dropped_steps_untimed(common,
                                                                               monkeypatch):
    """bench/adaptive_sim.py ``--ahead Q``: one GPU rank's path. The next K is taken early
    (``next_k``) and committed where its step can be queued, and the choice is then
    ``choose_committed``'s; an iteration whose queued step was dropped is not timed, nor
    one that queued a step it did not take itself. Q = 1: every iteration is timed but the
    first and the first after each switch between K = 0 and a drafting K (no step can be
    queued across it); Q = 0: no queued step is ever taken, so nothing is timed and ``stay`` holds
    the first K all run (as the worker would). Without ``--ahead`` every iteration is
    timed and chosen by ``choose``."""
    from specloop.engine import _adaptive

    sim = importlib.import_module("adaptive_sim")
    base = ["--batch", "4", "--sigma", "0", "--dwell", "0", "--times", "1.0,1.2",
            "--accept", "0.5", "--iterations", "200", "--seeds", "1"]
    timed, committed = [], []
    measured, choose_committed = (_adaptive.AdaptiveK.measured,
                                  _adaptive.AdaptiveK.choose_committed)

    def counting_measured(self, seconds, *a):
        timed.append(seconds)
        return measured(self, seconds, *a)

    def counting_committed(self, batch):
        committed.append(batch)
        return choose_committed(self, batch)
    monkeypatch.setattr(_adaptive.AdaptiveK, "measured", counting_measured)
    monkeypatch.setattr(_adaptive.AdaptiveK, "choose_committed", counting_committed)

    def run(*extra):
        timed.clear()
        committed.clear()
        return sim.run_rule(sim.parser().parse_args(base + list(extra)), 0)

    _, chosen, _ = run()
    assert len(timed) == 200 and not committed and sum(chosen.values()) == 200
    _, chosen, _ = run("--ahead", "1")
    assert 190 <= len(timed) < 200 and len(committed) >= 150 and sum(chosen.values()) == 200
    _, chosen, k0_run = run("--ahead", "0")
    assert timed == [] and len(committed) == 199
    assert chosen == {0: 200} and k0_run == 200
