import subprocess
import sys

import pytest

import specloop.comm as comm

EXPECTED = {
    "CollectiveCall", "CollectiveCounter", "CollectiveMismatchError", "CollectiveTimeoutError",
    "CommError", "Communicator", "ForwardingCommunicator", "InjectedFault", "LocalCommunicator",
    "LocalGroup", "ReduceOp",
    "SingleRankCommunicator", "TorchDistributedCommunicator", "TorchrunEnv", "collective_label",
    "distributed_argmax", "distributed_topk", "pin_loop_thread",
}


def test_public_names_are_exactly_all():
    assert set(comm.__all__) == EXPECTED
    for name in comm.__all__:
        assert getattr(comm, name) is not None
    public = {n for n in vars(comm) if not n.startswith("_")}
    assert public == EXPECTED, "public module attributes outside __all__"


# A fresh interpreter (imports torch, ~3 s CPU): slow; test_packaging's
# test_imports_point_one_way checks the same imports statically in the fast subset.
@pytest.mark.slow
def test_comm_imports_nothing_of_the_project():
    code = (
        "import sys, specloop.comm; "
        "print(sorted(m for m in sys.modules if m.startswith('specloop.') and not m.startswith('specloop.comm')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_implementations_satisfy_the_protocol():
    group = comm.LocalGroup(2)
    for c in (comm.SingleRankCommunicator(), group.communicator(0),
              comm.CollectiveCounter(group.communicator(1)),
              comm.ForwardingCommunicator(group.communicator(1))):
        assert isinstance(c, comm.Communicator)


def test_torchrun_env_names_what_is_missing():
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT"):
        comm.TorchrunEnv.read({"RANK": "0", "WORLD_SIZE": "2"})
    env = comm.TorchrunEnv.read({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "7"})
    assert (env.rank, env.world_size, env.local_rank, env.master_port) == (1, 2, 1, 7)
    with pytest.raises(RuntimeError, match="outside"):
        comm.TorchrunEnv.read({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "7"})
