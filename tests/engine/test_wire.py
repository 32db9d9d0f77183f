from specloop.engine import FinishReason, RequestOutput
from specloop.engine import _wire

from .test_adp import PARAMS, adp_config, run_group, serve, single_rank
from .conftest import PROMPTS


def test_outputs_round_trip_through_the_block():
    outs = [(3, RequestOutput("a", (5, 6, 7), "", False, None)),
            (0, RequestOutput("b", (9,), "", True, FinishReason.STOP)),
            (11, RequestOutput("c", (), "", True, FinishReason.CANCELLED))]
    flat = _wire.encode_rows(outs, rows=4, k=2)
    names = {3: "a", 0: "b", 11: "c"}
    assert _wire.decode_outputs(flat, 2, names.get) == [o for _, o in outs]


def test_too_many_or_too_long_outputs_do_not_fit():
    one = RequestOutput("a", (1,), "", False, None)
    assert _wire.encode_rows([(0, one)] * 3, rows=2, k=2) is None
    assert _wire.encode_rows([(0, RequestOutput("a", (1, 2, 3, 4), ""))], rows=2, k=2) \
        is None


def test_outputs_of_a_consumer_that_left_are_dropped():
    flat = _wire.encode_rows([(1, RequestOutput("gone", (1,), ""))], rows=1, k=0)
    assert _wire.decode_outputs(flat, 0, {}.get) == []


async def test_overflowing_blocks_fall_back_to_objects(tiny_dir, tiny_loaded, monkeypatch):
    expected = await single_rank(adp_config(tiny_dir, 1, method="ngram"), tiny_loaded)
    real = _wire.encode_rows

    def every_other_overflows(outputs, rows, k):
        every_other_overflows.calls += 1
        if outputs and every_other_overflows.calls % 2:
            every_other_overflows.overflows += 1
            return None
        return real(outputs, rows, k)
    every_other_overflows.calls = every_other_overflows.overflows = 0
    monkeypatch.setattr("specloop.engine._exchange.encode_rows", every_other_overflows)
    results, _ = await run_group(2, adp_config(tiny_dir, 2, method="ngram", max_batch_size=2),
                                 tiny_loaded, lambda e: serve(e, PROMPTS, PARAMS))
    assert results[0] == expected
    # Blocks are encoded when a rank has outputs (an empty one is built once).
    assert every_other_overflows.overflows >= 3
