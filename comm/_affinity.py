"""Each rank's event-loop thread on a physical core of its own (``parallel.pin_host_cores``).

Why (issue 12): with a step queued ahead, an ADP rank's pace is its host Python against a
~1.3 ms GPU step, and on the 2 x H200 machine that Python ran at two speeds ~2x apart,
switching within a run (DRAFT 16 or 31 us, VERIFY's queueing 0.37 or 0.7 ms) — the look of
a thread moved between cores or sharing one with another busy thread (the other rank's
polling loop, the compute thread, a hyper-thread sibling). A pinned loop stays where its
caches are and shares its core with nothing of this job.

The plan: the allowed CPUs (``os.sched_getaffinity``) grouped into physical cores (their
hyper-thread siblings); the first core is left to the system; local rank r's loop thread
gets core 1 + r (all its siblings); every other thread of the process (the compute
thread, NCCL's, gloo's, CUDA's) gets what is left — the same set on every rank, so no
thread of the job runs on a rank's loop core. Threads the loop thread starts later inherit
its core (Linux copies the starter's mask): anyio's worker threads started after the pin
then share it, which costs only while they work (on a GPU rank: prefill, which the loop
waits for anyway).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping, Sequence

import attrs
import structlog

log = structlog.get_logger(__name__)

MODES = ("auto", "on", "off")
_SYS_CPU = "/sys/devices/system/cpu"


@attrs.frozen
class CorePlan:
    loop: frozenset[int]        # CPUs of the rank's loop thread (one physical core)
    others: frozenset[int]      # CPUs of every other thread of the process


def plan_cores(cores: Sequence[Sequence[int]], local_rank: int, local_world: int
               ) -> CorePlan | None:
    """``cores``: physical cores (each its logical CPUs) in a stable order, the same on
    every rank. None when there are too few: a core for the system, one per local rank and
    at least one for the other threads."""
    if not 0 <= local_rank < local_world or len(cores) < local_world + 2:
        return None
    reserved = cores[1:1 + local_world]
    taken = {cpu for core in reserved for cpu in core}
    others = frozenset(cpu for core in cores for cpu in core if cpu not in taken)
    return CorePlan(frozenset(reserved[local_rank]), others)


def physical_cores(allowed: Iterable[int], sys_cpu: str = _SYS_CPU) -> list[tuple[int, ...]]:
    """The allowed CPUs grouped by hyper-thread siblings (sysfs), ordered by first CPU; a
    CPU whose topology cannot be read counts as a core of its own."""
    allowed = set(allowed)
    cores: list[tuple[int, ...]] = []
    placed: set[int] = set()
    for cpu in sorted(allowed):
        if cpu in placed:
            continue
        siblings = _read_list(f"{sys_cpu}/cpu{cpu}/topology/thread_siblings_list")
        core = tuple(sorted({cpu, *(c for c in siblings if c in allowed and c not in placed)}))
        placed.update(core)
        cores.append(core)
    return cores


def _read_list(path: str) -> list[int]:
    """A sysfs CPU list ("0-3,8,10-11") as ints; [] when unreadable."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return []
    cpus: list[int] = []
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def should_pin(mode: str, device_type: str, environ: Mapping[str, str] | None = None) -> bool:
    """``auto``: a CUDA rank launched by torchrun (LOCAL_WORLD_SIZE set) on Linux — its
    loop only queues work, so one core suffices; a CPU rank computes with torch's thread
    pool, which the pin would squeeze. ``on``: wherever Linux allows; ``off``: never."""
    env = os.environ if environ is None else environ
    if mode == "off" or not hasattr(os, "sched_setaffinity"):
        return False
    return mode == "on" or (device_type == "cuda" and "LOCAL_WORLD_SIZE" in env)


def pin_loop_thread(mode: str, device_type: str, environ: Mapping[str, str] | None = None
                    ) -> CorePlan | None:
    """Call from the loop thread once the engine is built (its threads exist): pin it and
    move every other thread of the process off the ranks' loop cores. -> the plan applied,
    or None (not asked for, or too few cores: then nothing changes)."""
    env = os.environ if environ is None else environ
    if not should_pin(mode, device_type, env):
        return None
    local_rank = int(env.get("LOCAL_RANK", "0"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", "1"))
    plan = plan_cores(physical_cores(os.sched_getaffinity(0)), local_rank, local_world)
    if plan is None:
        log.info("pin_host_cores_skipped", reason="too few cores", local_world=local_world,
                 cpus=len(os.sched_getaffinity(0)))
        return None
    apply_plan(plan, threading.get_native_id(), _thread_ids())
    log.info("pin_host_cores", local_rank=local_rank, loop=sorted(plan.loop),
             others=len(plan.others))
    return plan


def apply_plan(plan: CorePlan, loop_tid: int, tids: Iterable[int]) -> None:
    """``loop_tid`` onto ``plan.loop``, each other thread of ``tids`` onto
    ``plan.others``; a thread that ended meanwhile, or one the system will not move, is
    skipped (pinning is a speed-up, never a reason to fail)."""
    for tid in tids:
        try:
            os.sched_setaffinity(tid, plan.loop if tid == loop_tid else plan.others)
        except OSError:
            pass


def _thread_ids() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [threading.get_native_id()]
