"""Two real processes over gloo, started the way torchrun starts them (env vars)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# One module fixture starts two processes that import torch and join gloo three times in
# turn: minutes on a loaded 2-core machine, so the per-process limit below is generous and
# the test's too.
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

WORKER = Path(__file__).with_name("dist_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(*args: str, world_size: int = 2) -> list[list[dict]]:
    """-> per rank, the RESULT of each run (runs separated by ``--then``)."""
    with tempfile.TemporaryDirectory(prefix="dist-signal-") as signals:
        return _launch_in(signals, *args, world_size=world_size)


def _launch_in(signals: str, *args: str, world_size: int) -> list[list[dict]]:
    runs = 1 + args.count("--then")
    port, *more = (_free_port() for _ in range(runs))
    procs = []
    for rank in range(world_size):
        # SPECLOOP_TEST_SIGNAL_DIR: where rank 0 says it has timed out in the collective
        # rank 1 skips, so rank 1 leaves then (dist_worker.stay_until_rank0_done).
        # SPECLOOP_TEST_PORTS: the ports of the runs after the first (each its own group).
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CUDA_VISIBLE_DEVICES": "",
               "SPECLOOP_TEST_SIGNAL_DIR": signals,
               "SPECLOOP_TEST_PORTS": ",".join(map(str, more))}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=480)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.communicate()  # reap it and close its pipe (else a ResourceWarning later)
            raise
        assert proc.returncode == 0, out
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert len(lines) == runs, out
        outputs.append([json.loads(line.removeprefix("RESULT ")) for line in lines])
    return outputs


@pytest.fixture(scope="module")
def launched() -> dict[str, list[dict]]:
    """The three modes in turn in one pair of processes (each its own process group, as
    its own launch had): mode -> each rank's results."""
    per_rank = _launch("--checked", "--then", "--inline", "--then", "--shm")
    return {mode: [runs[i] for runs in per_rank]
            for i, mode in enumerate(("checked", "inline", "shm"))}


@pytest.fixture(scope="module")
def unchecked(inline) -> list[dict]:
    """The default path's results (unchecked, not inline): the --inline run does it
    first, before it turns inline on."""
    assert not any(res["inline"] is False for res in inline)
    return [{"ops": res["ops_plain"]} for res in inline]


@pytest.fixture(scope="module")
def checked(launched) -> list[dict]:
    return launched["checked"]


@pytest.fixture(scope="module")
def inline(launched) -> list[dict]:
    return launched["inline"]


@pytest.fixture(scope="module")
def shared(launched) -> list[dict]:
    return launched["shm"]


def _assert_ops(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        ops = res["ops"]
        assert (ops["rank"], ops["world_size"]) == (rank, 2)
        assert ops["all_gather"] == [[0, 0], [1, 10]]
        assert ops["all_gather_2d_shape"] == [2, 2, 3]
        assert ops["sum"] == [2.0, 1.0]
        assert (ops["max"], ops["min"]) == ([1, 0], [0, -1])
        assert ops["objects"] == [{"rank": 0}, {"rank": 1}]
        assert ops["bytes"] == ["000700", "010701"]
        assert ops["broadcast"] == "from 1"
        assert ops["sub_rank"] == rank and ops["sub_gather"] == [[0], [1]]
        assert ops["argmax"] == ops["argmax_expected"]


def test_collectives_over_gloo(unchecked):
    _assert_ops(unchecked)


def test_checked_mode_gives_the_same_results(checked):
    _assert_ops(checked)


def test_checked_mode_turns_asymmetry_into_errors_on_both_ranks(checked):
    expected = {
        "shape": ("rank 0 called all_gather(shape=(3,), dtype=float32) #9 on group 'world'",
                  "rank 1 called all_gather(shape=(4,), dtype=float32) #9 on group 'world'"),
        "dtype": ("rank 0 called all_gather(shape=(3,), dtype=float32) #10",
                  "rank 1 called all_gather(shape=(3,), dtype=int64) #10"),
        "op": ("rank 0 called all_gather(shape=(3,), dtype=float32) #11",
               "rank 1 called all_reduce(op=sum, shape=(3,), dtype=float32) #11"),
    }
    for res in checked:
        mismatches = res["mismatches"]
        for case, fragments in expected.items():
            assert mismatches[case] is not None, case
            for fragment in fragments:
                assert fragment in mismatches[case]["message"]
        assert mismatches["after"] == [2]


def test_missing_rank_becomes_a_timeout_error(checked):
    waiting = checked[0]["timeout"]
    assert waiting["error"] is not None and "did not enter barrier()" in waiting["error"]
    assert waiting["elapsed"] < 10


def test_collectives_issued_inline_give_the_same_results(inline):
    """Tensor collectives issued on the event loop and polled (NCCL's default path), here
    over gloo: same results; a rank that never enters is a timeout error, not a hang."""
    _assert_ops(inline)
    assert all(res["inline"] for res in inline)
    waiting = inline[0]["timeout"]
    assert waiting["error"] is not None and "did not enter all_gather" in waiting["error"]
    assert waiting["elapsed"] < 10


def test_host_all_gathers_through_shared_memory(shared):
    """Host tensors' all_gather through a file in shared memory: the same results; 300
    calls in a row with new contents each, then sizes and dtypes in turn, all bit-exact;
    objects of a few sizes (the largest over gloo); a rank that skips one is a timeout
    error on the other, not a hang."""
    _assert_ops(shared)
    for res in shared:
        assert res["shared_memory"]["wrong"] == 0
        # [0] f32, 3 bytes (all_gather_bytes), [4] bf16 and the pickles' lengths, [2]
        # i64, [2, 3] f32, [5] i64, [3, 2] f64, small, ~1 KB pickles, [326] i64, ~5 KB
        # pickles (2 MiB ones: gloo).
        assert res["shared_memory"]["sizes"] == [0, 3, 8, 16, 24, 40, 48, 256, 1024, 2608,
                                                 8192]
    waiting = shared[0]["shared_memory"]
    assert waiting["error"] is not None and "not completed within 3 s" in waiting["error"]
    assert waiting["elapsed"] < 10


@pytest.mark.parametrize("gpus, local_rank, want", [(2, 0, "cuda:0"), (2, 1, "cuda:1"),
                                                    (1, 1, "cuda:0"), (2, 3, "cuda:1")])
def test_ranks_share_gpus_round_robin_when_there_are_fewer_gpus(monkeypatch, gpus, local_rank, want):
    """cuda:LOCAL_RANK, or with fewer GPUs than local ranks the model runner's rule
    (rank mod GPUs): bench/adp_run.py runs 2 ranks on a one-GPU machine this way."""
    import torch

    from specloop.comm._torch_dist import _pick_device
    from specloop.engine._runner import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert str(_pick_device(None, local_rank)) == want
    assert str(_pick_device("cuda", local_rank)) == want == str(resolve_device("cuda", local_rank))
    assert str(_pick_device("cuda:0", local_rank)) == "cuda:0"     # named: as named
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert str(_pick_device(None, local_rank)) == "cpu"
