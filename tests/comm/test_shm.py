"""The shared-memory all-gather (comm/_shm.py) in one process: every rank's side is a
``SharedGather`` on the same file, driven in turn. The multi-process path (a real
communicator, a peer that never posts) is in test_torch_dist.py."""
from __future__ import annotations

import os

import pytest
import torch

from specloop.comm import _shm

pytestmark = pytest.mark.skipif(not _shm.supported(), reason="x86-64 only (store order)")


@pytest.fixture
def sides():
    made = []

    def make(world: int, nbytes: int) -> list[_shm.SharedGather]:
        path = _shm.create_file(world, nbytes)
        try:
            group = [_shm.SharedGather(path, r, world, nbytes) for r in range(world)]
        finally:
            os.unlink(path)
        made.extend(group)
        return group

    yield make
    for side in made:
        side.close()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: NaN payloads and -0.0 compare exactly."""
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def _rows(world: int, shape: tuple[int, ...], dtype: torch.dtype, call: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * call + len(shape))
    out = []
    for r in range(world):
        if dtype.is_floating_point:
            row = torch.randn(shape, generator=gen).to(dtype)
            if row.numel() > 2:
                flat = row.view(-1)
                flat[0], flat[1] = -0.0, float("nan")
        elif dtype == torch.bool:
            row = torch.randint(0, 2, shape, generator=gen).bool()
        else:
            row = torch.randint(-2**62, 2**62, shape, generator=gen, dtype=torch.int64).to(dtype)
        out.append(row)
    return out


CASES = [((326,), torch.int64), ((2, 3), torch.float32), ((4,), torch.bfloat16),
         ((5,), torch.bool), ((3, 0), torch.float32), ((), torch.float64), ((7,), torch.int8)]


@pytest.mark.parametrize("world", [2, 3])
def test_many_calls_round_trip_bit_exactly(sides, world):
    """Every call's result is every rank's row, bit for bit, whichever rank posts first
    (both buffers reused many times over), and a fresh tensor each call."""
    for shape, dtype in CASES:
        nbytes = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
        group = sides(world, nbytes)
        held = []
        for call in range(40):
            rows = _rows(world, shape, dtype, call)
            order = list(range(world))[call % world:] + list(range(world))[:call % world]
            for i, r in enumerate(order):
                group[r].post(rows[r])
                assert group[r].ready() == (i == world - 1)
            want = torch.stack(rows)
            for side in group:
                got = side.result(rows[0])
                assert got.shape == (world, *shape) and got.dtype == dtype
                assert torch.equal(_bits(got), _bits(want)), (shape, dtype, call)
            held.append((got, want))
        # A result is a copy: later calls do not change it.
        for got, want in held:
            assert torch.equal(_bits(got), _bits(want))


def test_a_rank_one_call_ahead_does_not_overwrite_the_call_its_peer_reads(sides):
    """Call n + 1 writes the other buffer: a rank that finished call n and posted n + 1
    leaves call n's rows intact for the rank still reading them."""
    a, b = sides(2, 8 * 3)
    for n in range(6):
        a.post(torch.full((3,), 10 * n, dtype=torch.int64))
        b.post(torch.full((3,), 10 * n + 1, dtype=torch.int64))
        assert a.ready() and b.ready()
        first = a.result(torch.empty(3, dtype=torch.int64))
        a.post(torch.full((3,), -1, dtype=torch.int64))      # a moves on to call n + 1 ...
        assert not a.ready()
        late = b.result(torch.empty(3, dtype=torch.int64))   # ... b still reads call n
        assert torch.equal(first, late) and late[:, 0].tolist() == [10 * n, 10 * n + 1]
        b.post(torch.full((3,), -2, dtype=torch.int64))
        assert a.ready() and b.ready()
        assert a.result(torch.empty(3, dtype=torch.int64))[:, 0].tolist() == [-1, -2]


def test_inputs_that_are_not_plain_contiguous_tensors(sides):
    """A strided view, a tensor that requires grad, and a first call under
    inference_mode followed by calls outside it (the map's views stay writable)."""
    a, b = sides(2, 4 * 6)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    strided = base[:, 1::2].t()                       # [2, 3], not contiguous
    with torch.inference_mode():
        a.post(strided)
        b.post(strided * 2)
        assert torch.equal(a.result(strided), torch.stack([strided, strided * 2]))
    grad = torch.ones(2, 3, requires_grad=True)
    a.post(grad)
    b.post(strided)
    got = b.result(grad)
    assert not got.requires_grad and torch.equal(got, torch.stack([torch.ones(2, 3), strided]))


def test_a_tensor_of_another_size_is_refused(sides):
    (a, _) = sides(2, 16)
    with pytest.raises(ValueError, match="not 16 bytes"):
        a.post(torch.zeros(3, dtype=torch.int64))
