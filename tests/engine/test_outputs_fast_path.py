"""RESCAN's commit: the all-at-once path for rows with no stop equals the per-token rules
(property-based: random limits, stop tokens, EOS and accepted chunks)."""

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from specloop.engine._outputs import Outputs
from specloop.engine._request import Request
from specloop.engine._scheduler import Scheduler
from specloop.engine._stats import EngineStats
from specloop.samplers import SamplingParams

EOS = 2


@attrs.define
class _Runner:
    trims: list = attrs.Factory(list)
    loaded: object = None

    def trim_many(self, requests):
        self.trims.extend((r.request_id, r.num_cached) for r in requests)

    def release(self, slot):
        self.trims.append(("release", slot))


def _outputs(k, max_seq_len, fast, rows=False):
    """``rows``: the outputs built as wire rows (``deliver_rows``, a ProcessEngine core)."""
    runner = _Runner(loaded=attrs.make_class("L", ["tokenizer"])(
        attrs.make_class("T", ["eos_token_ids"])([EOS])))
    config = attrs.make_class("C", ["speculative", "model"])(
        attrs.make_class("S", ["k", "verify_drafts"])(k, k),
        attrs.make_class("M", ["max_seq_len"])(max_seq_len))
    delivered = []
    out = Outputs(config=config, scheduler=Scheduler(4, 10**6), runner=runner, drafter=None,
                  stats=EngineStats(), deliver=lambda handle, o: delivered.append(o),
                  deliver_rows=delivered.extend if rows else None)
    return out, runner, delivered


@settings(max_examples=300, deadline=None)
@given(k=st.integers(0, 4), max_seq_len=st.integers(12, 40), max_tokens=st.integers(1, 20),
       ignore_eos=st.booleans(), stops=st.lists(st.integers(0, 9), max_size=2),
       chunks=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=5), max_size=8))
def test_fast_commit_equals_per_token_rules(k, max_seq_len, max_tokens, ignore_eos, stops,
                                            chunks):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                            stop_token_ids=tuple(stops))
    results = []
    for fast in (True, False):
        out, runner, delivered = _outputs(k, max_seq_len, fast)
        request = Request("r", (5, 6, 7), params, 0, [5, 6, 7])
        if not fast:    # every commit "may stop": the per-token rules for every token
            request.stop_length, request.stop_tokens = 0, frozenset()
        out.scheduler.add(request)
        out.scheduler.admit()
        for chunk in chunks:
            if request.finished:
                break
            out.append(request, list(chunk[:k + 1]))
        results.append((request.token_ids, request.finish_reason, request.num_cached,
                        delivered, runner.trims, out.stats.num_generated_tokens))
    assert results[0] == results[1]


# A batch's requests (max_tokens, ignore_eos, stop tokens) and its steps: each row's 4
# tokens and accepted count.
BATCHES = dict(
    k=st.integers(0, 3), max_seq_len=st.integers(12, 40),
    requests=st.lists(st.tuples(st.integers(1, 12), st.booleans(),
                                st.lists(st.integers(0, 9), max_size=2)),
                      min_size=1, max_size=4),
    steps=st.lists(st.lists(st.tuples(st.lists(st.integers(0, 9), min_size=4, max_size=4),
                                      st.integers(0, 3)), min_size=4, max_size=4),
                   max_size=6))


def _admit(out, requests):
    """``requests`` added and admitted -> the Request objects."""
    made = []
    for i, (max_tokens, ignore_eos, stops) in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                ignore_eos=ignore_eos, stop_token_ids=tuple(stops))
        made.append(Request(f"r{i}", (5, 6, 7), params, 0, [5, 6, 7], handle=i))
        out.scheduler.add(made[-1])
    out.scheduler.admit()
    return made


@settings(max_examples=150, deadline=None)
@given(**BATCHES)
def test_batch_commit_equals_a_row_at_a_time(k, max_seq_len, requests, steps):
    """RESCAN's ``commit`` of a batch == ``append`` of each row in batch order: the same
    tokens, finish reasons, trims and releases, and the same outputs in the same
    order (finished requests leave the next iteration's batch)."""
    results = []
    for batched in (True, False):
        out, runner, delivered = _outputs(k, max_seq_len, True)
        _admit(out, requests)
        finished = []
        for step in steps:
            batch = list(out.scheduler.running)
            rows = [row for row, _ in step[:len(batch)]]
            accepted = [min(n, k) for _, n in step[:len(batch)]]
            if batched:
                finished.append(out.commit(batch, rows, accepted))
            else:
                for request, row, n in zip(batch, rows, accepted):
                    out.append(request, row[:n + 1])
                finished.append([r for r in batch if r.finished])
        state = [(r.token_ids, r.finish_reason, r.num_cached) for r in out.scheduler.running + [
                      r for f in finished for r in f]]
        results.append((state, [[r.request_id for r in f] for f in finished], delivered,
                        runner.trims, out.stats.num_generated_tokens))
    assert results[0] == results[1]


@settings(max_examples=150, deadline=None)
@given(**BATCHES)
def test_rows_are_the_objects_outputs_on_the_wire(k, max_seq_len, requests, steps):
    """A ProcessEngine core's RESCAN builds wire rows directly (``deliver_rows``): the
    same rows, in the same order, as the RequestOutputs it builds otherwise, each through
    ``output_row`` (ongoing rows, stop and length finishes, and the cancelled ends of
    ``cancel_all``), and the same engine state."""
    from specloop.engine._wire import output_row

    results = []
    for rows_mode in (True, False):
        out, runner, delivered = _outputs(k, max_seq_len, True, rows=rows_mode)
        made = _admit(out, requests)
        for step in steps:
            batch = list(out.scheduler.running)
            out.commit(batch, [row for row, _ in step[:len(batch)]],
                       [min(n, k) for _, n in step[:len(batch)]])
        out.cancel_all()
        wire = delivered if rows_mode else [output_row(o) for o in delivered]
        state = [(r.token_ids, r.finish_reason, r.num_cached) for r in made]
        results.append((wire, state, runner.trims, out.stats.num_generated_tokens))
    assert results[0] == results[1]
    assert all(isinstance(row, tuple) and len(row) == 5 for row in results[0][0])
