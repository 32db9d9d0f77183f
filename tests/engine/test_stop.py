"""Stop strings: matched on detokenized text across token boundaries, never leaking a
prefix that later turns out to be a stop string, ending the request and freeing its slot."""

from __future__ import annotations

import random

import anyio
import pytest

from specloop.engine import AsyncEngine, FinishReason
from specloop.engine._stop import StopMatcher
from specloop.samplers import SamplingParams, SamplingParamsError

from .conftest import make_config


def stream(stops, chunks):
    """Feed chunks; return (released text, stopped, every release)."""
    matcher, out, releases = StopMatcher(stops), "", []
    for chunk in chunks:
        safe, stopped = matcher.push(chunk)
        out += safe
        releases.append(out)
        if stopped:
            return out, True, releases
    return out + matcher.flush(), False, releases


def reference(stops, text):
    """One character at a time: cut before the first stop string to complete."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            return text[:min(starts)], True
    return text, False


def random_chunks(rng, text):
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_stop_matcher_equals_one_shot_search_for_any_chunking():
    rng = random.Random(0)
    alphabet = "ab\n#"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        out, stopped, releases = stream(stops, random_chunks(rng, text))
        assert (out, stopped) == reference(stops, text), (text, stops)
        # Nothing released is ever taken back: every release is a prefix of the answer.
        assert all(out.startswith(r) for r in releases)


def test_stop_matcher_holds_back_a_possible_stop_prefix():
    matcher = StopMatcher(["###"])
    assert matcher.push("hello #") == ("hello ", False)
    assert matcher.push("#") == ("", False)
    assert matcher.push("x") == ("##x", False)
    assert matcher.push("a##") == ("a", False)
    assert matcher.push("#tail") == ("", True)


def test_stop_param_validation():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    for bad in ([""], [3], 3):
        with pytest.raises(SamplingParamsError, match="stop"):
            SamplingParams(stop=bad)


async def _run(engine, prompt, params):
    text, ids, reason = "", [], None
    async for out in engine.generate(prompt, params):
        text += out.text
        ids.extend(out.token_ids)
        reason = out.finish_reason
    return text, ids, reason


@pytest.mark.parametrize("method", ["none", "ngram"])
async def test_engine_ends_at_a_stop_string_spanning_tokens(tiny_loaded, tiny_dir, method):
    config = make_config(tiny_dir, method=method, k=3, max_batch_size=2)
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        tok = engine.tokenizer
        greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        full, full_ids, _ = await _run(engine, "The quick brown fox", greedy)
        pieces = [tok.decode(full_ids[:i]) for i in range(len(full_ids) + 1)]
        # A stop string that starts inside one token's text and ends inside a later one.
        start = len(pieces[5]) - 1
        stop = full[start:start + 4]
        assert len(stop) == 4 and full.find(stop) >= 0
        expect = full[:full.find(stop)]
        text, ids, reason = await _run(
            engine, "The quick brown fox", SamplingParams(
                temperature=0, max_tokens=40, ignore_eos=True, stop=("never there", stop)))
        assert text == expect and reason is FinishReason.STOP
        # Tokens end with the one that completed the match: a prefix of the full run.
        assert ids == full_ids[:len(ids)] and len(ids) < len(full_ids)
        assert stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])
        # The engine-side request is cancelled: its slot comes back within iterations.
        with anyio.fail_after(10):
            while engine.num_free_slots != config.scheduler.max_batch_size:
                await anyio.sleep(0.01)
        # A stop string that never occurs changes nothing.
        again = await _run(engine, "The quick brown fox", SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=True, stop="never there"))
        assert again == (full, full_ids, FinishReason.LENGTH)


def test_detokenize_off_refuses_stop_strings_by_name():
    assert SamplingParams(detokenize=False).detokenize is False
    with pytest.raises(SamplingParamsError, match=r"detokenize = False .*stop strings "
                                                  r"\('x',\).*stop_token_ids"):
        SamplingParams(detokenize=False, stop="x")
    with pytest.raises(SamplingParamsError, match="detokenize = 0 .*must be a bool"):
        SamplingParams(detokenize=0)


@pytest.mark.parametrize("method", ["none", "ngram"])
async def test_detokenize_off_gives_the_same_tokens_and_no_text(tiny_loaded, tiny_dir,
                                                                method):
    """``detokenize=False``: the same token ids, every output's text empty, in ``generate``
    and in ``generate_batch`` beside a request that does detokenize (its text unchanged)."""
    config = make_config(tiny_dir, method=method, k=3, max_batch_size=2)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids_only = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False)
    async with AsyncEngine(config, model=tiny_loaded) as engine:
        text, ids, reason = await _run(engine, "The quick brown fox", greedy)
        assert text and text == engine.tokenizer.decode(ids)
        assert await _run(engine, "The quick brown fox", ids_only) == ("", ids, reason)
        got: dict[str, tuple[str, list[int]]] = {}
        async for outs in engine.generate_batch(["The quick brown fox"] * 2,
                                                [greedy, ids_only]):
            for out in outs:
                t, i = got.get(out.request_id, ("", []))
                got[out.request_id] = (t + out.text, i + list(out.token_ids))
        assert sorted(got.values(), key=lambda v: v[0]) == [("", ids), (text, ids)]
