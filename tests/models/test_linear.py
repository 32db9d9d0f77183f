"""PackedLinear: oneDNN-packed weights for VERIFY-sized row counts on the CPU."""

import pytest
import torch
import torch.nn.functional as F

from specloop.models import KVCache
from specloop.models import _linear
from specloop.models._linear import (MAX_ROWS, MIN_ROWS, PackedLinear, bf16_packing_available,
                                     packing_available)

needs_packing = pytest.mark.skipif(not packing_available(), reason="no oneDNN in this torch")


def _case(rows, seed=0, out=96, inp=64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, rows, inp, generator=gen)
    w = torch.randn(out, inp, generator=gen)
    b = torch.randn(out, generator=gen)
    return x, w, b


@needs_packing
@pytest.mark.parametrize("rows", [MIN_ROWS, 4, 7, MAX_ROWS])
def test_packed_rows_equal_f_linear(rows):
    x, w, b = _case(rows)
    lin = PackedLinear()
    for bias in (None, b):
        got = lin(x, w, bias)
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    assert len(lin._packed) == 1          # packed once, reused for the bias call


@pytest.mark.parametrize("rows", [1, MAX_ROWS + 1])
def test_outside_the_window_is_f_linear_bit_for_bit(rows):
    x, w, b = _case(rows)
    lin = PackedLinear()
    assert torch.equal(lin(x, w, b), F.linear(x, w, b))
    assert not lin._packed


@needs_packing
def test_in_place_weight_write_is_noticed():
    # A stale packed copy would keep answering with the old weights.
    x, w, _ = _case(4)
    lin = PackedLinear()
    lin(x, w)
    with torch.no_grad():
        w.mul_(-2.0)
    torch.testing.assert_close(lin(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    # Views of one stacked parameter (the decoder's per-layer weights) are told apart.
    stacked = torch.randn(2, 96, 64)
    a, c = stacked.unbind(0)
    torch.testing.assert_close(lin(x, c), F.linear(x, c), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x, a), F.linear(x, a), rtol=1e-5, atol=1e-5)


@needs_packing
def test_a_used_model_still_deep_copies_and_pickles():
    import copy
    import pickle

    x, w, _ = _case(4)
    lin = PackedLinear()
    lin(x, w)
    for clone in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
        assert clone.enabled == lin.enabled and not clone._packed
        torch.testing.assert_close(clone(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not bf16_packing_available(), reason="no native bf16 GEMMs here")
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
def test_bf16_runs_packed_from_one_row(rows):
    """bfloat16 (a draft head's dtype on such a CPU) runs packed from 1 row, to the
    float64 product within bf16's rounding."""
    x, w, b = (t.bfloat16() for t in _case(rows))
    lin = PackedLinear()
    got = lin(x, w, b)
    assert got.dtype == torch.bfloat16 and len(lin._packed) == 1
    want = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=0.15)


def test_bf16_without_native_gemms_is_f_linear(monkeypatch):
    monkeypatch.setattr(_linear, "bf16_packing_available", lambda: False)
    x, w, b = (t.bfloat16() for t in _case(3))
    lin = PackedLinear()
    assert torch.equal(lin(x, w, b), F.linear(x, w, b))
    assert not lin._packed


def test_autograd_and_other_dtypes_fall_back():
    x, w, _ = _case(4)
    lin = PackedLinear()
    wg = w.clone().requires_grad_(True)
    lin(x, wg).sum().backward()
    assert wg.grad is not None
    assert torch.equal(lin(x.double(), w.double()), F.linear(x.double(), w.double()))
    assert not lin._packed


@needs_packing
def test_decoder_verify_rows_match_unpacked(tiny_llama):
    """A tiny model's K+1-token forward and LM head with packing == without (fp32)."""
    import copy

    model = copy.deepcopy(tiny_llama.model).float()
    cache = KVCache(model.args, 1, 64)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.args.vocab_size, (1, 9), generator=gen)
    slot, zero = torch.tensor([0]), torch.tensor([0])

    def run(enabled):
        model.linear.enabled = enabled
        with torch.inference_mode():
            return model.logits(model(prompt, zero, slot, cache))

    packed, plain = run(True), run(False)
    assert model.linear._packed                       # the packed path did run
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-4)
    assert torch.equal(packed.argmax(-1), plain.argmax(-1))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("reduced", [True, False])
@pytest.mark.parametrize("rows", [1, 3])
def test_draft_head_logits_on_the_cpu_paths(rows, reduced, dtype):
    """DraftHead on the CPU (a private copy: 1 fp32 row against the transposed copy,
    several packed; bf16 packed from 1 row) gives F.linear's logits on the draft
    vocabulary (all of it without a d2t) and -inf elsewhere, as float32; the target's
    weight is shared (not copied) only where it is used as it is."""
    from specloop.models.drafters._lm_head import DraftHead

    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(50, 16, generator=gen)
    d2t = torch.tensor([1, 4, 7, 30, 49]) if reduced else None
    hidden = torch.randn(rows, 16, generator=gen)
    head = DraftHead(weight, lm_head_tp=False, max_rows=4, d2t=d2t, dtype=dtype)
    assert head.weight.dtype == (dtype or weight.dtype)
    assert (head.weight is weight) == (not reduced and dtype is None)
    with torch.inference_mode():
        got = head.logits(hidden)
    rows_of = slice(None) if d2t is None else d2t
    want = torch.full((rows, 50), float("-inf"))
    want[:, rows_of] = F.linear(hidden, weight[rows_of])
    tol = 1e-5 if dtype is None else 0.1       # bf16: 8 bits of mantissa, sums of 16
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
