"""``specloop certify``: passes on correct engines, fails (naming the check) on planted
bugs, and says "inconclusive" when its control shows the trials lack power.

Planted bugs are injected (monkeypatch, or test-only components named through config in
tests/engine/planted.py); production code has no test flags."""

import json

import attrs
import pytest

from specloop.engine._certify import certify
from specloop.engine._certify_options import CertifyOptions
from specloop.engine._cli_certify import main

from . import planted
from .conftest import make_config
from .test_tree_engine import TREE, head_file  # noqa: F401 (a fixture)

T1 = "temperature=1.0"
TOP_P = "temperature=0.7,top_p=0.9"
GREEDY = "temperature=0"
DRAFTERS = ["ngram", "draft_model", "early_exit", "mtp_eagle"]


def config_for(tiny_dir, tiny_draft_dir, method, *, verification="token", **sections):
    spec = {"verification": verification}
    return make_config(tiny_dir, method=method, k=3, rejection=True, max_batch_size=64,
                       max_seq_len=64,
                       draft_model=tiny_draft_dir if method == "draft_model" else None,
                       speculative=spec, **sections)


def statuses(report):
    return {c["name"]: c["status"] for c in report["checks"]}


def failed(report):
    return sorted(name for name, s in statuses(report).items() if s == "fail")


DIST = CertifyOptions(ranks=(1,), trials=300, positions=2, params=(T1,),
                      checks=("distribution",))
INVARIANCE = CertifyOptions(ranks=(1,), params=(T1,), probe_tokens=6,
                            checks=("invariance",))


@pytest.fixture(scope="module")
def draft_config(tiny_dir, tiny_draft_dir):
    # A good drafter (q close to p), against which sampler bugs show in a few hundred trials.
    return config_for(tiny_dir, tiny_dir, "draft_model",
                      components={"drafter": "tests.engine.planted:near_target_drafter"})


# Slow: passing certificates are the slow every-drafter cases' job; the fast subset keeps
# the failing ones (a planted sampler bug, a rank off by one) and the CLI's exit codes.
@pytest.mark.slow
@pytest.mark.usefixtures("batched_prefill")   # tests/engine/conftest.py: why
async def test_clean_draft_model_distribution_passes(draft_config, tiny_loaded):
    report = await certify(draft_config, DIST, model=tiny_loaded)
    assert report["verdict"] == "pass", report["checks"][0]["summary"]
    rows = report["checks"][0]["details"][0]["rows"]
    assert [r["position"] for r in rows] == [1, 2]
    assert all(r["control"]["verdict"] == "fail" for r in rows)


# 150 trials are plenty for this bug (half of DIST's, which the clean case above keeps for
# its controls' sake): at position 1 chi2 = 138 against a threshold of 32.3 (4.3x), and
# that row's own control still fails (139 > 32.3), so the trials had power; at 300 trials
# it was 385 against 57.9.
BUG_TRIALS = 150


async def test_residual_not_renormalised_fails_distribution(draft_config, tiny_loaded,
                                                             monkeypatch):
    planted.skip_residual_normalisation(monkeypatch)
    report = await certify(draft_config, attrs.evolve(DIST, trials=BUG_TRIALS),
                           model=tiny_loaded)
    assert report["verdict"] == "fail"
    assert failed(report) == ["distribution"]
    row = report["checks"][0]["details"][0]["rows"][0]
    assert row["verdict"] == "fail" and row["control"]["verdict"] == "fail", row


@pytest.mark.slow
@pytest.mark.usefixtures("batched_prefill")   # tests/engine/conftest.py: why
async def test_shared_noise_stream_fails_distribution(tiny_dir, tiny_draft_dir, tiny_loaded,
                                                      monkeypatch):
    """A subtle bias (chi2 / sample ~ 0.1 here): it takes ~2000 trials to see at 10 sigma."""
    planted.share_one_stream(monkeypatch)
    config = config_for(tiny_dir, tiny_draft_dir, "early_exit")
    report = await certify(config, attrs.evolve(DIST, trials=2000), model=tiny_loaded)
    assert report["verdict"] == "fail"
    assert failed(report) == ["distribution"]


@pytest.mark.slow   # fast twin: tests/engine/test_slot_invariance.py (the property itself)
async def test_drafter_leaking_the_slots_previous_user_fails_slot_reuse(
        tiny_dir, tiny_draft_dir, tiny_loaded):
    # The target as its own draft model: every draft is accepted unless the leak bites.
    config = config_for(tiny_dir, tiny_dir, "draft_model",
                        components={"drafter": "tests.engine.planted:LeakyDraftModelDrafter"})
    report = await certify(config, INVARIANCE, model=tiny_loaded)
    assert report["verdict"] == "fail"
    assert "invariance.kv_slot_reuse" in failed(report)
    assert statuses(report)["invariance.rank_placement"] == "skipped"


@pytest.mark.slow   # fast twins: test_adp / test_lm_head_tp (seeded rows match one rank)
async def test_a_rank_sampling_with_seed_plus_one_fails_rank_placement(
        tiny_dir, tiny_draft_dir, tiny_loaded):
    planted.SAMPLERS_BUILT.clear()
    config = config_for(tiny_dir, tiny_draft_dir, "ngram",
                        components={"sampler": "tests.engine.planted:one_rank_off_by_one"})
    opts = attrs.evolve(INVARIANCE, ranks=(1, 2))
    report = await certify(config, opts, model=tiny_loaded)
    assert "invariance.rank_placement[2]" in failed(report)
    # Every one-rank scenario agrees; only runs on the group differ.
    assert set(failed(report)) <= {"invariance.rank_placement[2]",
                                   "invariance.one_token_prompts"}


@pytest.mark.slow   # fast twin: tests/graphs/test_static_steps.py (the same replay cache)
async def test_graph_replay_matches_eager_through_a_step_replay_cache(
        tiny_dir, tiny_draft_dir, tiny_loaded):
    """The static-step (CUDA-graph) path on CPU, mtp_eagle's draft graph included."""
    config = config_for(tiny_dir, tiny_draft_dir, "mtp_eagle",
                        components={"graph_cache":
                                    "tests.graphs.test_static_steps:StepReplayCache"},
                        graphs={"batch_buckets": [1, 2, 4, 8, 16, 32, 64]})
    report = await certify(config, INVARIANCE, model=tiny_loaded)
    assert statuses(report)["invariance.graph_replay"] == "pass"
    assert report["verdict"] == "pass", [c["summary"] for c in report["checks"]
                                         if c["status"] != "pass"]


def test_cli_exit_codes_and_json(tmp_path, tiny_dir, tiny_loaded, monkeypatch):
    toml = tmp_path / "c.toml"
    toml.write_text(f"""
[model]
name = "{tiny_dir}"
dtype = "float64"
max_seq_len = 64
chat_template = false
[scheduler]
max_batch_size = 64
[speculative]
method = "draft_model"
draft_model = "{tiny_dir}"
num_draft_tokens = 2
use_rejection_sampling = true
[components]
drafter = "tests.engine.planted:near_target_drafter"
""")
    out = tmp_path / "r.json"
    args = ["--config", str(toml), "--ranks", "1", "--checks", "distribution",
            "--params", T1, "--positions", "1", "--json", str(out)]
    # 12 samples cannot tell T from 1.5 T: the control passes, so no verdict is given.
    assert main([*args, "--trials", "12"], model=tiny_loaded) == 3
    report = json.loads(out.read_text())
    assert report["verdict"] == "inconclusive"
    row = report["checks"][0]["details"][0]["rows"][0]
    assert {"statistic", "df", "threshold", "verdict", "control"} <= set(row)
    planted.skip_residual_normalisation(monkeypatch)
    assert main([*args, "--trials", str(BUG_TRIALS)], model=tiny_loaded) == 1
    assert main(["--config", str(toml), "--checks", "bogus"], model=tiny_loaded) == 2
    assert main(["--config", str(toml), "--params", "temperature=x"], model=tiny_loaded) == 2


# Every drafter under token verification; block verification for one drafter with a full
# draft distribution q (draft_model) and one with a point mass (ngram): block verification
# reads only the drafts, q and p, so which drafter made a q of either form adds nothing
# (and each certificate costs ~20 s of CPU in the full suite).
@pytest.mark.slow
@pytest.mark.usefixtures("batched_prefill")   # tests/engine/conftest.py: why
@pytest.mark.parametrize("method, verification",
                         [(m, "token") for m in DRAFTERS]
                         + [("draft_model", "block"), ("ngram", "block")])
async def test_certify_passes_every_drafter(tiny_dir, tiny_draft_dir, tiny_loaded, method,
                                            verification):
    config = config_for(tiny_dir, tiny_draft_dir, method, verification=verification)
    # All three params in one certificate: the distribution check runs its T1 and top-p
    # trials in one engine run, and the invariance scenarios probe greedy, T1 and top-p
    # rows together (mixed batches), instead of one certificate per params.
    # 800 trials: the power control fails at every position (600 left one top-p position
    # inconclusive).
    opts = CertifyOptions(ranks=(1, 2), trials=800, positions=2, params=(GREEDY, T1, TOP_P),
                          probe_tokens=6)
    report = await certify(config, opts, model=tiny_loaded)
    assert report["verdict"] == "pass", [c["summary"] for c in report["checks"]
                                         if c["status"] != "pass"]
    rows = [r for c in report["checks"] if c["name"] == "distribution"
            for d in c["details"] for r in d["rows"]]
    assert len(rows) == 2 * 2 * 2       # 2 prompts x (T1, top-p) x 2 positions, all tested


@pytest.mark.slow
@pytest.mark.usefixtures("batched_prefill")   # tests/engine/conftest.py: why
async def test_certify_passes_adp_with_lm_head_tp(tiny_dir, tiny_draft_dir, tiny_loaded):
    """The configured group (2 ranks, LM-head TP on the greedy draft path) against 1 rank."""
    config = config_for(tiny_dir, tiny_draft_dir, "mtp_eagle",
                        parallel={"world_size": 2, "attention_dp": True,
                                  "lm_head_tp_in_adp": True})
    opts = CertifyOptions(ranks=(1, 2), trials=800, positions=2, params=(TOP_P,),
                          probe_tokens=6)
    report = await certify(config, opts, model=tiny_loaded)
    assert report["verdict"] == "pass", [c["summary"] for c in report["checks"]
                                         if c["status"] != "pass"]


@pytest.mark.slow
@pytest.mark.usefixtures("batched_prefill")   # tests/engine/conftest.py: why
async def test_certify_passes_a_draft_tree_and_fails_one_uniform_for_its_path(
        tiny_dir, tiny_loaded, head_file):
    """A draft tree verified strictly (sampled rows too: ``use_rejection_sampling`` off,
    every batch up to 64 rows drafting the tree): the distribution check passes; with
    the tree's rows all drawn at the root's position (a sampler whose ``strict_targets``
    only a tree iteration calls) it fails."""
    def tree_config(**sections):
        return make_config(tiny_dir, method="eagle3", k=3, max_batch_size=64,
                           max_seq_len=64, speculative={
                               "draft_weights": str(head_file), "tree": TREE,
                               "tree_max_batch": 64}, **sections)

    opts = CertifyOptions(ranks=(1,), trials=800, positions=2, params=(T1, TOP_P),
                          checks=("distribution",))
    report = await certify(tree_config(), opts, model=tiny_loaded)
    assert report["verdict"] == "pass", report["checks"][0]["summary"]
    bad = tree_config(components={"sampler": "tests.engine.planted:one_position_tree_sampler"})
    # The bug shows at position 2 only, after an accepted node: at 1600 trials chi2 245
    # against a threshold of 138 there (800 trials: 100 against 86).
    report = await certify(bad, attrs.evolve(opts, trials=1600, params=(T1,)),
                           model=tiny_loaded)
    assert failed(report) == ["distribution"], report["checks"][0]["summary"]
