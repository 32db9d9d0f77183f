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


@pytest.mark.skipif(not _prompts.FORTUNES.exists(), reason="needs Debian's fortunes")
def test_shipped_prompts_are_made_from_the_fortunes_corpus(held_out):
    """Every shipped prompt is one of fortune_prompts' forms applied to a fortune of the
    installed corpus (Debian 12's fortunes 1:1.99.1-7.3; another version may lack some):
    the file is made from the corpus, not edited by hand. Not an exact rebuild: which
    prompts build_prompts(5000, 400, 0) draws depends on the random stream after the
    training builders, i.e. on Debian's package list at the last ``apt-get update`` and on
    Python's docstrings (a rebuild on 2026-12-04 drew other fortunes)."""
    missing = [r["text"][:60] for r in held_out.not_from_corpus(held_out.read())]
    assert not missing, f"{len(missing)} shipped prompts are no fortune in these forms: " \
        f"{missing[:3]}"
