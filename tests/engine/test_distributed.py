"""Real processes over gloo, launched by torchrun (marked ``distributed``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specloop.models.testing import write_tiny_checkpoint

from .conftest import write_gloo_config

# One launch for the three gloo cases and their one-rank references, one for the CLI.
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("adp_worker.py")


def launch(*args, timeout=240):
    """``args`` under torchrun on 2 ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", *map(str, args)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


# bench/adp_run.py's options per case: n-gram, SCHEDULE's exchange through shared memory
# (the default on CUDA ranks); MTP-EAGLE with rejection sampling and LM-head TP,
# collectives checked (the exchange a host tensor over gloo); the same with collectives
# issued on the loop and polled (gloo here); a draft tree with LM-head TP, collectives
# checked (each depth's children ranked across the ranks' vocabulary shards; sampled rows
# verified strictly through the tree). How collectives are issued (checked, inline,
# shared memory) changes nothing on one rank: the two mtp_eagle chains share their
# one-rank reference.
# (4 rows a rank: batches up to speculative.tree_max_batch draft the tree.)
TREE = "--batch 4 --tree '[[0], [1], [0, 0], [1, 0], [0, 0, 0]]'"
CASES = {"ngram": "--method ngram --shared-memory-exchange",
         "checked": "--method mtp_eagle --rejection --lm-head-tp --checked",
         "inline": "--method mtp_eagle --rejection --lm-head-tp --inline-collectives",
         "tree": f"--method mtp_eagle --lm-head-tp --checked {TREE}"}
ONE_RANK = {"ngram": "--method ngram", "checked": CASES["checked"].replace(" --checked", ""),
            "tree": f"--method mtp_eagle {TREE}"}
ONE_RANK["inline"] = ONE_RANK["checked"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case on 2 gloo ranks and each distinct one-rank reference, in one torchrun
    launch (tests/engine/adp_worker.py: a launch's torch imports and agent, not a run,
    were most of a case's time; the one-rank runs are rank 0's alone, world 1, as a plain
    process would run them) -> (case -> 2-rank outputs, case -> 1-rank outputs)."""
    out_dir = tmp_path_factory.mktemp("adp")
    references = list(dict.fromkeys(ONE_RANK.values()))
    argv = [*CASES.values(), *(f"world=1 {opts}" for opts in references)]
    proc = launch(WORKER, out_dir, *argv, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Every rank of every run reported its SYNC cost.
    assert proc.stdout.count("SYNC median") == 2 * len(CASES) + len(references), \
        proc.stdout[-3000:]
    outputs = [json.loads((out_dir / f"run{i}.json").read_text())["outputs"]
               for i in range(len(argv))]
    two = dict(zip(CASES, outputs))
    one = {case: outputs[len(CASES) + references.index(opts)]
           for case, opts in ONE_RANK.items()}
    return two, one


@pytest.mark.parametrize("case", list(CASES))
def test_two_gloo_ranks_equal_one_rank(case, runs):
    # What `bench/adp_run.py --compare` checks (every greedy and seeded sampled request's
    # tokens identical), read here rather than in another process that imports torch.
    two, one = runs[0][case], runs[1][case]
    assert len(one) == 18 and all(one), one
    assert two == one


def test_cli_under_torchrun_and_without(tmp_path):
    """`specloop generate` on a 2-rank config: under torchrun (each rank its process), and
    alone (it spawns the two ranks: a ProcessEngine): the same completions, token for
    token, equal to one rank's."""
    model = write_tiny_checkpoint(tmp_path / "tiny", vocab_size=384)
    config = write_gloo_config(tmp_path / "adp2.toml", model)
    one_rank = config.with_name("one.toml")
    one_rank.write_text(config.read_text().replace("world_size = 2", "world_size = 1")
                        .replace("attention_dp = true", "attention_dp = false")
                        .replace('"torch_distributed"', '"single"'))

    def argv(path):
        return ["-m", "specloop.engine.cli", "generate", "--config", str(path), "--prompt",
                "hello", "--prompt", "world", "--prompt", "again", "--max-tokens", "8",
                "--json"]

    def alone(path):        # a plain process, not a torchrun rank
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("WORLD_SIZE", None)
        proc = subprocess.run([sys.executable, *argv(path)], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    under = launch(*argv(config))
    assert under.returncode == 0, under.stderr[-3000:]
    spawned, one = alone(config), alone(one_rank)

    def completions(proc):
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        assert len(rows) == 3 and all(len(r["token_ids"]) == 8 for r in rows), proc.stdout
        return [r["token_ids"] for r in rows]

    assert completions(under) == completions(spawned) == completions(one)
    assert "[specloop] new tokens 24" in spawned.stdout and "on rank 0" in spawned.stdout
