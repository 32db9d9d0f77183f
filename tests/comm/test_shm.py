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


def _post(side: _shm.SharedGather, tensor: torch.Tensor) -> None:
    side.post(_shm.tensor_bytes(tensor))


def _result(side: _shm.SharedGather, like: torch.Tensor) -> torch.Tensor:
    return _shm.tensor_from(side.result(), side.world, like)


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
                _post(group[r], rows[r])
                assert group[r].ready() == (i == world - 1)
            want = torch.stack(rows)
            for side in group:
                got = _result(side, rows[0])
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
        _post(a, torch.full((3,), 10 * n, dtype=torch.int64))
        _post(b, torch.full((3,), 10 * n + 1, dtype=torch.int64))
        assert a.ready() and b.ready()
        first = _result(a, torch.empty(3, dtype=torch.int64))
        _post(a, torch.full((3,), -1, dtype=torch.int64))      # a moves on to call n + 1 ...
        assert not a.ready()
        late = _result(b, torch.empty(3, dtype=torch.int64))   # ... b still reads call n
        assert torch.equal(first, late) and late[:, 0].tolist() == [10 * n, 10 * n + 1]
        _post(b, torch.full((3,), -2, dtype=torch.int64))
        assert a.ready() and b.ready()
        assert _result(a, torch.empty(3, dtype=torch.int64))[:, 0].tolist() == [-1, -2]


def test_inputs_that_are_not_plain_contiguous_tensors(sides):
    """A strided view, a tensor that requires grad, and a first call under
    inference_mode followed by calls outside it (results are fresh tensors)."""
    a, b = sides(2, 4 * 6)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    strided = base[:, 1::2].t()                       # [2, 3], not contiguous
    with torch.inference_mode():
        _post(a, strided)
        _post(b, strided * 2)
        assert torch.equal(_result(a, strided), torch.stack([strided, strided * 2]))
    grad = torch.ones(2, 3, requires_grad=True)
    _post(a, grad)
    _post(b, strided)
    got = _result(b, grad)
    assert not got.requires_grad and torch.equal(got, torch.stack([torch.ones(2, 3), strided]))


def test_a_tensor_of_another_size_is_refused(sides):
    (a, _) = sides(2, 16)
    with pytest.raises(ValueError, match="not 16 bytes"):
        _post(a, torch.zeros(3, dtype=torch.int64))


@pytest.fixture
def lone_rank():
    """This process as rank 1 of a group of 2 whose rank 0 is a ``SharedGather`` driven
    from the test (``peer(nbytes)``), or never posts: the communicator's shared-memory
    calls without a second process. A world of 1 underneath (the communicator reads its
    global rank from torch.distributed), torn down after."""
    import datetime

    import torch.distributed as dist

    from specloop.comm._torch_dist import TorchDistributedCommunicator, _Family

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    family = _Family(torch.device("cpu"), datetime.timedelta(seconds=0.3), owns_world=False)
    comm = TorchDistributedCommunicator(family=family, group=dist.group.WORLD,
                                        object_group=dist.group.WORLD, ranks=(1, 0))
    comm.shared_memory = True
    peers = []

    def peer(nbytes: int) -> _shm.SharedGather:
        path = _shm.create_file(2, nbytes)
        try:
            comm._shared[nbytes] = _shm.SharedGather(path, 1, 2, nbytes)
            peers.append(_shm.SharedGather(path, 0, 2, nbytes))
        finally:
            os.unlink(path)
        return peers[-1]

    try:
        yield comm, peer
    finally:
        for side in peers:
            side.close()
        comm.close()
        dist.destroy_process_group()


async def test_objects_go_through_shared_memory_as_lengths_then_padded_pickles(lone_rank):
    import pickle

    comm, peer = lone_rank
    lengths, pickles = peer(8), peer(1024)
    theirs, mine = {"rank": 0, "tokens": list(range(300, 600))}, ("rank 1", None)
    data = pickle.dumps(theirs)
    assert 512 < len(data) <= 1024      # the longer pickle sets the padded size
    lengths.post(len(data).to_bytes(8, "little"))
    pickles.post(data + b"\x07" * (1024 - len(data)))     # the padding: any bytes
    assert await comm.all_gather_object(mine) == [theirs, mine]


async def test_bytes_go_through_shared_memory_in_rank_order(lone_rank):
    """SCHEDULE's exchange: every rank's bytes, this rank (1) after its peer (0), many
    calls over the two buffers; no tensor on the way."""
    comm, peer = lone_rank
    side = peer(24)
    for n in range(5):
        theirs, mine = bytes([n]) * 24, bytes(range(n, n + 24))
        side.post(theirs)
        assert await comm.all_gather_bytes(mine) == [theirs, mine]


@pytest.mark.parametrize("op, want", [
    ("all_gather", r"all_gather\(shape=\(1,\), dtype=int64\)"),
    ("all_gather_object", r"all_gather_object\(\)"),
    ("all_gather_bytes", r"all_gather_bytes\(shape=\(8,\), dtype=uint8\)")])
async def test_a_peer_that_never_posts_is_a_timeout_error_naming_the_call(lone_rank, op, want):
    from specloop.comm import CollectiveTimeoutError

    comm, peer = lone_rank
    peer(8)
    call = {"all_gather": lambda: comm.all_gather(torch.zeros(1, dtype=torch.int64)),
            "all_gather_object": lambda: comm.all_gather_object("never gathered"),
            "all_gather_bytes": lambda: comm.all_gather_bytes(bytes(8))}[op]()
    with pytest.raises(CollectiveTimeoutError, match=rf"{want} #0 .*not completed within 0.3 s"):
        await call
