"""parallel.pin_host_cores: which CPUs each rank's loop thread and the other threads get."""
import os
import threading

import pytest

from specloop.comm import _affinity
from specloop.comm._affinity import CorePlan, apply_plan, physical_cores, plan_cores, should_pin

HT = [(0, 16), (1, 17), (2, 18), (3, 19)]       # 4 physical cores, 2 hyper-threads each


def test_each_local_rank_gets_its_own_core_and_others_avoid_every_loop_core():
    plans = [plan_cores(HT, r, 2) for r in range(2)]
    assert plans[0] == CorePlan(frozenset({1, 17}), frozenset({0, 16, 3, 19}))
    assert plans[1] == CorePlan(frozenset({2, 18}), frozenset({0, 16, 3, 19}))
    # No thread of either rank may share a loop core: the others' set is the same on both
    # ranks and disjoint from every loop set.
    for plan in plans:
        assert not plan.others & (plans[0].loop | plans[1].loop)


def test_too_few_cores_plans_nothing():
    assert plan_cores(HT[:3], 0, 2) is None          # system + 2 loops, none for the rest
    assert plan_cores([(0,), (1,)], 0, 1) is None     # the 2-core box
    assert plan_cores([(0,), (1,), (2,)], 0, 1) == CorePlan(frozenset({1}), frozenset({0, 2}))
    assert plan_cores(HT, 2, 2) is None               # a rank outside the local world


def test_physical_cores_groups_siblings_from_sysfs(tmp_path):
    for cpu, siblings in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3", 4: "4"}.items():
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(siblings + "\n")
    assert physical_cores({0, 1, 2, 3, 4}, str(tmp_path)) == [(0, 2), (1, 3), (4,)]
    # Only allowed CPUs count; an unreadable topology is a core of its own.
    assert physical_cores({1, 2, 9}, str(tmp_path)) == [(1,), (2,), (9,)]
    (tmp_path / "cpu5" / "topology").mkdir(parents=True)
    (tmp_path / "cpu5" / "topology" / "thread_siblings_list").write_text("5-7\n")
    assert physical_cores({5, 6, 7}, str(tmp_path)) == [(5, 6, 7)]


def test_auto_pins_cuda_ranks_under_torchrun_only():
    torchrun = {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    assert should_pin("auto", "cuda", torchrun)
    assert not should_pin("auto", "cuda", {})          # in-process groups, plain scripts
    assert not should_pin("auto", "cpu", torchrun)     # torch's thread pool computes there
    assert should_pin("on", "cpu", {})
    assert not should_pin("off", "cuda", torchrun)


def test_pin_without_enough_cores_changes_nothing(monkeypatch):
    monkeypatch.setattr(_affinity, "physical_cores", lambda allowed: [(0,), (1,)])
    called = []
    monkeypatch.setattr(_affinity, "apply_plan", lambda *a: called.append(a))
    assert _affinity.pin_loop_thread("on", "cuda", {"LOCAL_WORLD_SIZE": "1"}) is None
    assert not called


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and 2 CPUs")
def test_apply_plan_sets_each_threads_own_mask():
    """Two helper threads stand in for the loop and another thread (this process's other
    threads keep their masks: apply_plan touches only the ids it is given)."""
    cpus = sorted(os.sched_getaffinity(0))
    plan = CorePlan(frozenset(cpus[:1]), frozenset(cpus[1:]))
    ids, seen, go, done = {}, {}, threading.Event(), threading.Event()

    def body(name):
        ids[name] = threading.get_native_id()
        go.wait(5)
        seen[name] = os.sched_getaffinity(0)
        done.wait(5)

    threads = [threading.Thread(target=body, args=(n,)) for n in ("loop", "other")]
    for t in threads:
        t.start()
    while len(ids) < 2:
        threading.Event().wait(0.001)
    apply_plan(plan, ids["loop"], [ids["loop"], ids["other"], 2 ** 22 + 7])   # one gone
    go.set()
    while len(seen) < 2:
        threading.Event().wait(0.001)
    done.set()
    for t in threads:
        t.join()
    assert seen == {"loop": set(plan.loop), "other": set(plan.others)}
    assert os.sched_getaffinity(0) == set(cpus)     # the caller's own mask untouched
