"""specloop.comm: communicators whose collectives are checked for symmetry.

Private modules behind this thin re-export; everything public is in `__all__`.
"""
from ._affinity import pin_loop_thread
from ._argmax import distributed_argmax
from ._topk import distributed_topk
from ._call import CollectiveCall
from ._counter import CollectiveCounter, collective_label
from ._errors import CollectiveMismatchError, CollectiveTimeoutError, CommError, InjectedFault
from ._forwarding import ForwardingCommunicator
from ._local import LocalCommunicator, LocalGroup
from ._protocol import Communicator, ReduceOp
from ._single import SingleRankCommunicator
from ._torch_dist import TorchDistributedCommunicator
from ._torchrun_env import TorchrunEnv

__all__ = [
    "CollectiveCall",
    "CollectiveCounter",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommError",
    "Communicator",
    "ForwardingCommunicator",
    "InjectedFault",
    "LocalCommunicator",
    "LocalGroup",
    "ReduceOp",
    "SingleRankCommunicator",
    "TorchDistributedCommunicator",
    "TorchrunEnv",
    "collective_label",
    "distributed_argmax",
    "distributed_topk",
    "pin_loop_thread",
]
