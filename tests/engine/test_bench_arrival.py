"""bench/_common.py's steady-load options: how many requests a run submits (the timed
window is the finishes between the batch-th and the last submission, so the requests set
how long a run measures)."""

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
