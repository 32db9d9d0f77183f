"""Wall time inside chosen engine functions, summed per function (any thread): where an
engine's host time goes beside another's, without a profiler's per-call overhead on
everything else. ``bench_process_gpu.py --timers`` prices adaptive K's own calls on the
in-process engines this way (docs/performance-history.md, "Adaptive K's own cost against
its mix's").

    timers = HostTimers(ADAPTIVE_CALLS); timers.install()
    before = timers.snapshot(); ...; spent = timers.since(before)   # {label: seconds}
    timers.uninstall()

``CoreTimers``: the same inside a ``ProcessEngine``'s core (its own process), as an
iteration observer the core builds from its config (``bench_process_gpu.py
--core-timers``): the parent reads the totals off the stats it fetches.
"""

from __future__ import annotations

import functools
import importlib
import time

from adaptive_sim import bucket_of      # the rule's class of a batch's rows

# (module, class, method): adaptive K's calls on one GPU rank's path, and the chained
# step's queueing (inside ``_adaptive_next``, and a fixed K's own) to set them beside.
ADAPTIVE_CALLS = (
    ("specloop.engine._adaptive", "IterationClock", "tick"),
    ("specloop.engine._adaptive", "IterationClock", "prefill_started"),
    ("specloop.engine._adaptive", "IterationClock", "prefill_done"),
    ("specloop.engine._adaptive", "AdaptiveK", "next_k"),
    ("specloop.engine._adaptive", "AdaptiveK", "choose"),
    ("specloop.engine._adaptive", "AdaptiveK", "choose_committed"),
    ("specloop.engine._adaptive", "AdaptiveK", "record"),
    ("specloop.engine._adaptive", "AdaptiveK", "measured"),
    ("specloop.engine._adaptive", "AdaptiveK", "disturb"),
    ("specloop.engine._adaptive_tail", "BatchTail", "rows"),
    ("specloop.engine._adaptive_tail", "BatchTail", "accepted"),
    ("specloop.engine._ahead", "RunAhead", "_adaptive_next"),
    ("specloop.engine._ahead", "RunAhead", "after_verify"),
    ("specloop.engine._chain", "DeviceChain", "queue"),
    ("specloop.engine._worker", "RankWorker", "draft_classes"),
    ("specloop.engine._worker", "RankWorker", "tail_rows"),
)

# Inside the chained step's queueing (``DeviceChain.queue``) and RESCAN: where a drafting
# iteration's host time goes under a server's load (nested calls count in each: a row is
# the time inside that function, its callees' included; not a coroutine function, whose
# call only makes the coroutine: RESCAN's whole time is its state's).
CHAIN_CALLS = (
    ("specloop.engine._chain", "DeviceChain", "_joined_key"),
    ("specloop.engine._chain", "DeviceChain", "_joined_rows"),
    ("specloop.engine._chain", "DeviceChain", "_rows"),
    ("specloop.engine._chain", "DeviceChain", "_can_queue"),
    ("specloop.engine._chain", "DeviceChain", "collected"),
    ("specloop.engine._worker", "RankWorker", "_sampling_batch"),
    ("specloop.engine._worker", "RankWorker", "_collect_verify"),
    ("specloop.engine._outputs", "Outputs", "commit"),
    ("specloop.engine._runner", "ModelRunner", "start_read_back"),
    ("specloop.engine._runner", "ModelRunner", "finish_read_back"),
    ("specloop.engine._runner", "ModelRunner", "reserve"),
    ("specloop.engine._runner", "ModelRunner", "trim_many"),
    ("specloop.models._cache", "PageTable", "sync"),
    ("specloop.models.drafters._mtp", "MtpEagleDrafter", "chained_inputs"),
    ("specloop.models.drafters._mtp", "MtpEagleDrafter", "on_verified"),
    ("specloop.graphs._cuda", "CudaGraphCache", "replay"),
    # The launch alone (CudaGraphCache.replay also copies the inputs that changed).
    ("torch.cuda.graphs", "CUDAGraph", "replay"),
)


# A ProcessEngine core's own traffic with its parent (its pipe front door): the outputs
# RESCAN hands over as rows, each message sent, and the parent's messages read.
# (``deliver_rows`` is timed on the instance: the worker holds the bound method from
# before the observers are built.)
CORE_CALLS = (
    ("specloop.engine._core_process", "PipeFrontDoor", "send"),
    ("specloop.engine._core_process", "PipeFrontDoor", "take_message"),
    ("specloop.engine._core_process", "PipeFrontDoor", "has_news"),
)


# Triton compiling a kernel specialisation: called on a cache miss only, so 0 where warm-up
# compiled every shape served, else ~0.1-0.5 s a kernel inside a timed run (a stall a fixed
# engine may never meet: adaptive K's eager catch-up after K = 0, or a new row count). Where
# Triton (or this private method) is missing, nothing is timed for it.
COMPILE_CALLS = (("triton.runtime.jit", "JITFunction", "_do_compile"),)
OPTIONAL = frozenset(COMPILE_CALLS)
# An iteration whose read-back waited less than this for the GPU was host-bound (the
# read-back's own call, a finished event's query, costs a few µs).
HOST_BOUND_US = 20.0


class HostTimers:
    def __init__(self, calls=ADAPTIVE_CALLS + CHAIN_CALLS + COMPILE_CALLS) -> None:
        self.calls = calls
        self.seconds: dict[str, float] = {}
        self._originals: list[tuple[type, str, object]] = []

    def install(self) -> None:
        for call in self.calls:
            module, cls_name, name = call
            try:
                cls = getattr(importlib.import_module(module), cls_name)
                original = cls.__dict__[name]
            except (ImportError, AttributeError, KeyError):
                if call in OPTIONAL:
                    continue
                raise
            label = f"{cls_name}.{name}"
            if isinstance(original, staticmethod):
                setattr(cls, name, staticmethod(self._timed(original.__func__, label)))
            else:
                setattr(cls, name, self._timed(original, label))
            self._originals.append((cls, name, original))

    def uninstall(self) -> None:
        for cls, name, original in reversed(self._originals):
            setattr(cls, name, original)
        self._originals.clear()

    def _timed(self, fn, label: str):
        seconds, clock = self.seconds, time.perf_counter

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] = seconds.get(label, 0.0) + clock() - start
        return timed

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)

    def since(self, before: dict[str, float]) -> dict[str, float]:
        """Seconds in each function since ``before`` (a ``snapshot``)."""
        return {k: v - before.get(k, 0.0) for k, v in self.seconds.items()
                if v - before.get(k, 0.0) > 0}


class CoreTimers:
    """An iteration observer (``components.observers = ["_host_timers:CoreTimers"]``) for
    an engine core in a process of its own (``ProcessEngine``), where the bench cannot
    install timers: built there from the config, it installs ``HostTimers`` (adaptive
    K's, the chained step's and the pipe's calls) in that process, adds up each
    iteration state's time from its events, and hangs both running totals on the
    worker's stats (at RESCAN's first commit, the first place that holds them), which the
    parent fetches across the pipe before and after a timed stretch: ``host_timers``
    {label: seconds}, ``host_states_us`` {state: µs}, ``host_moves_us`` {"K before>K@B":
    [iterations, wall µs, µs waiting for the GPU, iterations that waited less than
    HOST_BOUND_US]}: what an iteration at each K costs in
    this engine, beside a fixed engine's (adaptive K's mix), at each class B of the
    iteration's rows (the power of two at or above them, adaptive K's classes: under a
    server's load the rule picks small K where the batch drains, so a K's mean over every
    class is not a fixed engine's); ``JITFunction._do_compile``:
    Triton compiling a kernel during the runs (COMPILE_CALLS). Each timed call costs ~1 µs more,
    and its wall holds whatever waits inside it, the GIL's included (on the CPU the model
    runs in a worker thread: a call as small as ``IterationClock.tick`` then reads
    milliseconds).
    """

    def __init__(self, config: object = None) -> None:
        from specloop.engine._outputs import Outputs  # noqa: PLC0415 - the core's own

        self.timers = HostTimers(ADAPTIVE_CALLS + CHAIN_CALLS + CORE_CALLS + COMPILE_CALLS)
        self.timers.install()
        self.states: dict[str, float] = {}
        # Per move and rows' class ("K before>K@B"): [iterations, wall µs, µs waiting for
        # the GPU in the read-back, host-bound iterations], summed; an iteration's wall is
        # its states' time. A mean wait well above zero can hide host-bound iterations
        # (each then costs its host time, not the GPU's): counted apart.
        self.moves: dict[str, list[float]] = {}
        self._wall = 0.0
        self._waited = 0.0          # the read-back's total when the iteration began
        self._last_k: int | None = None
        seconds, states = self.timers.seconds, self.states
        commit = Outputs.commit     # (the timed one)

        @functools.wraps(commit)
        def showing(outputs, *args, **kwargs):
            stats = outputs.stats
            if getattr(stats, "host_timers", None) is not seconds:     # the first commit
                stats.host_timers, stats.host_states_us = seconds, states
                stats.host_moves_us = self.moves
                if outputs.deliver_rows is not None:
                    outputs.deliver_rows = self.timers._timed(
                        outputs.deliver_rows, "PipeFrontDoor.deliver_rows")
            return commit(outputs, *args, **kwargs)
        Outputs.commit = showing

    def on_transition(self, event) -> None:
        name, states = event.state.name, self.states
        states[name] = states.get(name, 0.0) + event.duration_us
        if not event.batch_size:        # an idle iteration (SYNC -> DONE): no move
            self._wall = 0.0
            return
        self._wall += event.duration_us
        if event.next_state.name != "DONE":
            return
        waited = self.timers.seconds.get("ModelRunner.finish_read_back", 0.0)
        k, rows = event.num_draft_tokens, event.batch_size
        move = self.moves.setdefault(f"{self._last_k}>{k}@{bucket_of(rows)}", [0, 0.0, 0.0, 0])
        wait_us = (waited - self._waited) * 1e6
        move[0] += 1
        move[1] += self._wall
        move[2] += wait_us
        move[3] += wait_us < HOST_BOUND_US
        self._wall, self._waited, self._last_k = 0.0, waited, k


def per_iteration(totals: dict[str, float], iterations: int,
                  scale: float = 1.0) -> dict[str, float]:
    """Each label's total over a timed stretch (``HostTimers.since``, a state's µs,
    ``CoreTimers``' growth) an iteration, times ``scale`` (1e6: seconds to µs), rounded
    to 0.1; labels that took no time left out."""
    per = max(iterations, 1)
    return {k: round(v * scale / per, 1) for k, v in sorted(totals.items()) if v > 0}
