"""bench/prompts_heldout.jsonl: the held-out prompts every GPU bench reads by default."""

import importlib
from pathlib import Path

import pytest

from specloop.train import _prompts

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture()
def held_out(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("held_out_prompts")


def test_shipped_file_is_the_eval_split(held_out):
    """400 distinct prompts, all of the eval split, from the source no head trains on,
    in the forms fortune_prompts makes; the benches' reader takes every one."""
    rows = held_out.read()
    assert len(rows) == held_out.NUM_EVAL == 400
    assert {r["split"] for r in rows} == {"eval"}
    assert {r["source"] for r in rows} == {"fortunes"}
    assert {r["form"] for r in rows} <= {"question", "instruction", "rewrite"}
    assert len({r["text"] for r in rows}) == 400
    common = importlib.import_module("_common")     # bench/ is on the path (held_out)
    assert common.held_out_texts(str(held_out.PATH)) == [r["text"] for r in rows]


@pytest.mark.skipif(not (_prompts.WORDNET.exists() and _prompts.FORTUNES.exists()),
                    reason="needs Debian's wordnet-base and fortunes")
def test_shipped_file_is_what_build_prompts_makes(held_out):
    """Rebuilt from the corpora (build_prompts(5000, 400, 0)), the eval split equals the
    shipped file row for row: the file is reproducible, not edited by hand. (Built from
    Debian 12's fortunes 1:1.99.1-7.3 and wordnet-base: other versions of the corpora
    give other prompts, and this fails.)"""
    assert held_out.build() == held_out.read()
