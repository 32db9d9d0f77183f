import torch

from specloop.comm import CollectiveCall

FINGERPRINT = -1782262606331708584


def test_describe_names_op_arguments_sequence_and_group():
    call = CollectiveCall.for_tensor("all_reduce", "adp", 7, torch.zeros(3, dtype=torch.int64), "op=max")
    assert call.describe() == "all_reduce(op=max, shape=(3,), dtype=int64) #7 on group 'adp'"
    assert CollectiveCall("barrier", "world", 0).describe() == "barrier() #0 on group 'world'"


def test_fingerprint_is_stable_across_processes():
    # A pinned value: hash() is salted per process, so equal values here across runs
    # mean every rank computes the same fingerprint.
    call = CollectiveCall("all_gather", "adp", 1, (2, 3), "float32")
    assert call.fingerprint() == FINGERPRINT


def test_signature_differs_when_anything_differs():
    base = CollectiveCall("all_gather", "adp", 1, (2, 3), "float32")
    variants = [
        CollectiveCall("all_reduce", "adp", 1, (2, 3), "float32", "op=sum"),
        CollectiveCall("all_gather", "tp", 1, (2, 3), "float32"),
        CollectiveCall("all_gather", "adp", 2, (2, 3), "float32"),
        CollectiveCall("all_gather", "adp", 1, (3, 2), "float32"),
        CollectiveCall("all_gather", "adp", 1, (2, 3), "bfloat16"),
    ]
    for v in variants:
        assert v.signature() != base.signature()
    assert len(base.signature()) == 3
