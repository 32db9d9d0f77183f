"""Host time of adaptive K's per-iteration calls at batch 1 (one GPU rank's path), on the
CPU: ``next_k`` + ``commit``, ``measured``, ``choose_committed``, ``record``, for a rule
with n-gram's 4 draft classes and K = 0 .. 4, each row's class drawn at random. Two
tables: fixed at warm-up's times (nothing learned) and learning. ``--tail-batch N``: a
head's rule instead (no classes, K = 0 .. 3, the batch's tail: ``tail.rows`` before the
choice, ``tail.accepted`` into ``record``) over N rows under a server's load (a row ends
and another joins about every other iteration), its time handed over by
``IterationClock.tick`` (a simulated clock; ``--prefill-rate``: the share of iterations
that admit a request, their prefill timed by fake CUDA events, each of whose calls is
counted: on the H200 each costs the loop thread a GIL handoff to the compute thread,
several µs). µs an iteration, 3 runs each of ``--iterations``.

    python bench/bench_adaptive_host.py [--iterations 20000] [--tail-batch 64]
        [--prefill-rate 0.9]              (with --tail-batch: a server's steady load)
        [--module /tmp/old_adaptive.py]   (another version of engine/_adaptive.py, e.g.
                                           ``git show <commit>:engine/_adaptive.py``)
        [--against /tmp/old_adaptive.py]  (with --tail-batch: this tree's module and that
                                           one taking turns, --runs each, µs per call; a
                                           git revision instead of a file: its
                                           engine/_adaptive.py and _adaptive_tail.py)
"""

from __future__ import annotations

import argparse
import inspect
import pathlib
import random
import subprocess
import sys
import time
import types

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(path: str):
    """This tree's engine/_adaptive.py (``path`` empty), another file's (with this tree's
    _adaptive_tail.py), or a git revision's (with that revision's _adaptive_tail.py)."""
    if not path:
        from specloop.engine import _adaptive  # noqa: PLC0415
        return _adaptive
    if pathlib.Path(path).is_file():
        return _module("specloop.engine._adaptive_other", pathlib.Path(path).read_text())
    return load_revision(path, "other")


def load_revision(rev: str, name: str):
    """engine/_adaptive.py at git revision ``rev`` as specloop.engine._adaptive_<name>,
    importing that revision's _adaptive_tail.py (specloop.engine._adaptive_tail_<name>)."""
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
    _module(f"specloop.engine._adaptive_tail_{name}", show("engine/_adaptive_tail.py"))
    source = show("engine/_adaptive.py").replace(
        "from ._adaptive_tail import", f"from ._adaptive_tail_{name} import")
    return _module(f"specloop.engine._adaptive_{name}", source)


def _module(name: str, source: str):
    import specloop.engine  # noqa: F401, PLC0415  (the package its relative imports need)
    module = types.ModuleType(name)
    module.__package__ = "specloop.engine"
    module.__file__ = f"<{name}>"
    sys.modules[name] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)  # noqa: S102
    return module


_TAKES_ADMITTED: dict[type, bool] = {}


def tail_rows_call(tail):
    """``tail.rows`` of any version of engine/_adaptive_tail.py as a call (batch,
    admitted) -> rows: the scheduler's admissions so far where it takes them (since the
    fifty-third session), else the batch alone (before: it told a join by a superset test
    of the batch)."""
    kind = type(tail)
    takes = _TAKES_ADMITTED.get(kind)
    if takes is None:
        takes = _TAKES_ADMITTED[kind] = "admitted" in inspect.signature(kind.rows).parameters
    return tail.rows if takes else (lambda batch, _admitted: tail.rows(batch))


def tail_rows_of(tail, batch, admitted: int) -> int:
    """``tail_rows_call(tail)(batch, admitted)``, 0 without a tail."""
    return 0 if tail is None else tail_rows_call(tail)(batch, admitted)


def make(module, learn: bool):
    candidates = [0, 1, 2, 3, 4]
    cost = module.CostTable({(1, k): 0.0004 + 0.00005 * k for k in candidates}, learn=learn)
    adaptive = module.AdaptiveK(candidates, cost, classes=4, burn_in=0)
    rng = random.Random(0)
    for _ in range(300):       # some acceptance counts in every class
        k = rng.choice(candidates[1:])
        adaptive.record(k, [rng.randrange(k + 1)], [rng.randrange(4)])
    return adaptive


def loop(adaptive, n: int) -> float:
    """µs an iteration of the one-rank path's calls."""
    rng = random.Random(1)
    k = 0
    start = time.perf_counter()
    for _ in range(n):
        c = rng.randrange(4)
        adaptive.commit(adaptive.next_k(1, k, classes=[c]))
        adaptive.measured(0.00045 + rng.random() * 1e-5)
        k = adaptive.choose_committed(1)
        adaptive.record(k, [rng.randrange(k + 1) if k else 0], [c])
    return (time.perf_counter() - start) / n * 1e6


class _Row:
    """What the tail reads of a request: its limit and its tokens so far."""

    def __init__(self, rng: random.Random) -> None:
        self.stop_length = rng.randrange(64, 256)
        self.token_ids = [0] * rng.randrange(1, 32)


def make_tail(module, learn: bool):
    candidates = [0, 1, 2, 3]
    cost = module.CostTable({(64, k): 0.0015 + 0.0001 * k for k in candidates}, learn=learn)
    adaptive = module.AdaptiveK(candidates, cost, burn_in=0, tail=True)
    rng = random.Random(0)
    for _ in range(300):
        k = rng.choice(candidates[1:])
        adaptive.record(k, [rng.randrange(k + 1) for _ in range(8)], None,
                        [rng.randrange(k + 1) for _ in range(2)])
    return adaptive


# "tick": IterationClock.tick (``measured`` and ``disturb`` in it); "prefill": on an
# iteration that admits, the clock's calls around the prefill (prefill_started, the job
# from on_device, prefill_done).
CALLS = ("tail.rows", "next_k", "tick", "prefill", "choose_committed", "tail.accepted",
         "record")


class _FakeEvent:
    """A CUDA timing event as the clock uses it, counting the calls that would reach the
    device (``calls``: the bench's ``cuda`` figure)."""

    calls = 0

    def record(self, stream) -> None:
        pass        # recorded by the compute thread's job on a GPU: not the loop's call

    def query(self) -> bool:
        _FakeEvent.calls += 1
        return True     # VERIFY's read-back waited behind the prefill

    def elapsed_time(self, end) -> float:
        _FakeEvent.calls += 1
        return 0.3      # ms: 0.2 beyond the host's 0.1 (below)


def make_clock(module, adaptive, now: list[float], event=None):
    """``module``'s IterationClock for ``adaptive`` on a (fake) GPU, its prefill timed by
    two ``event`` (a fake CUDA event class; ``_FakeEvent`` by default); the module's clock
    reads ``now[0]`` until ``module.time`` is given back (``time``)."""
    event = event or _FakeEvent
    module.time = types.SimpleNamespace(perf_counter=lambda: now[0])
    clock = module.IterationClock(adaptive, device=torch.device("cuda"))
    clock._pair = (event(), event(), None)
    return clock


def loop_tail(adaptive, n: int, batch_size: int, calls: dict | None = None,
              prefill_rate: float = 0.0, module=None) -> float:
    """µs an iteration in the one-rank path's calls for a head over ``batch_size`` rows
    (only theirs: the loop's own row bookkeeping is not timed); ``calls``: each call's
    (CALLS) µs an iteration added to it, and "cuda": the CUDA event calls an iteration.
    ``prefill_rate``: the share of iterations that admit a request (``module``: the one
    ``adaptive`` is from, for its clock)."""
    module = module or load("")
    now = [1000.0]
    iteration = make_clock(module, adaptive, now)
    try:
        return _loop_tail(adaptive, iteration, now, n, batch_size, calls, prefill_rate)
    finally:
        module.time = time


def _loop_tail(adaptive, iteration, now: list[float], n: int, batch_size: int,
               calls: dict | None, prefill_rate: float) -> float:
    rng = random.Random(1)
    batch = [_Row(rng) for _ in range(batch_size)]
    tail, k, clock, spent = adaptive.tail, 0, time.perf_counter, 0.0
    admitted = batch_size       # the scheduler's admissions so far (``Scheduler.admitted``)
    rows_of = tail_rows_call(tail)     # bound once: the loop times the call itself
    iteration.tick()
    events = _FakeEvent.calls
    split = [0.0] * len(CALLS)
    for _ in range(n):
        # 1.5 ms an iteration, and an admitting one's prefill: 0.1 ms on the host, 0.3 on
        # the device (``_FakeEvent``), which VERIFY waits behind.
        now[0] += 0.0015 + rng.random() * 1e-5
        admits = rng.random() < prefill_rate
        t0 = clock()
        tail_rows = rows_of(batch, admitted)
        t1 = clock()
        adaptive.commit(adaptive.next_k(batch_size, k, tail_rows=tail_rows))
        t2 = clock()
        iteration.tick()
        t3 = clock()
        if admits:
            mark = iteration.prefill_started()
            now[0] += 0.0001
            iteration.on_device(lambda: None)()
            iteration.prefill_done(mark)
            now[0] += 0.0002
        t3a = clock()
        k = adaptive.choose_committed(batch_size)
        iteration.timed = True
        t4 = clock()
        accepted = [rng.randrange(k + 1) if k else 0 for _ in batch]
        t5 = clock()
        tail_accepted = tail.accepted(batch, accepted)
        t6 = clock()
        adaptive.record(k, accepted, None, tail_accepted)
        t7 = clock()
        for i, took in enumerate((t1 - t0, t2 - t1, t3 - t2, t3a - t3, t4 - t3a, t6 - t5,
                                  t7 - t6)):
            split[i] += took
        spent += t4 - t0 + t7 - t5
        for row, m in zip(batch, accepted):
            row.token_ids += [0] * (m + 1)
        if rng.random() < 0.5:      # one ends, another joins
            batch[rng.randrange(batch_size)] = _Row(rng)
            admitted += 1
    if calls is not None:
        for name, took in zip(CALLS, split):
            calls[name] = calls.get(name, 0.0) + took / n * 1e6
        calls["cuda"] = calls.get("cuda", 0.0) + (_FakeEvent.calls - events) / n
    return spent / n * 1e6


def against(modules: dict, batch_size: int, iterations: int, runs: int,
            prefill_rate: float = 0.0) -> dict:
    """Each module's learning head rule over ``batch_size`` rows, the modules taking turns
    ``runs`` times (a fresh rule each run, 500 iterations to warm): -> {name: {"total":
    sorted µs an iteration, call: sorted µs}} (a shared box's drift hits all alike)."""
    found: dict = {name: {} for name in modules}
    for _ in range(runs):
        for name, module in modules.items():
            adaptive = make_tail(module, True)
            loop_tail(adaptive, 500, batch_size, None, prefill_rate, module)
            calls: dict = {}
            total = loop_tail(adaptive, iterations, batch_size, calls, prefill_rate, module)
            for key, value in (("total", total), *calls.items()):
                found[name].setdefault(key, []).append(round(value, 1))
    return {name: {key: sorted(v) for key, v in per.items()} for name, per in found.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=20000)
    ap.add_argument("--module", default="", help="another engine/_adaptive.py to time")
    ap.add_argument("--tail-batch", type=int, default=0,
                    help="a head's rule with the batch's tail over this many rows")
    ap.add_argument("--against", default="",
                    help="with --tail-batch: another engine/_adaptive.py (a file, or a git "
                         "revision) taking turns with this tree's, µs per call")
    ap.add_argument("--prefill-rate", type=float, default=0.0,
                    help="with --tail-batch: the share of iterations that admit a request "
                         "(a server's steady load at batch 32 on the H200 admits one "
                         "nearly every iteration)")
    ap.add_argument("--runs", type=int, default=4, help="--against: runs of each")
    args = ap.parse_args(argv)
    module = load(args.module)
    if args.against:
        if not args.tail_batch:
            ap.error("--against times the head's rule: give --tail-batch")
        found = against({"this": module, "other": load(args.against)}, args.tail_batch,
                        args.iterations // 4, args.runs, args.prefill_rate)
        for name, per in found.items():
            print(f"tail, batch {args.tail_batch}, {name}: " +
                  "; ".join(f"{key} {values}" for key, values in per.items()))
        return
    if args.tail_batch:
        for learn in (False, True):
            adaptive = make_tail(module, learn)
            loop_tail(adaptive, 500, args.tail_batch, None, args.prefill_rate, module)
            runs = [round(loop_tail(adaptive, args.iterations // 4, args.tail_batch, None,
                                    args.prefill_rate, module), 1) for _ in range(3)]
            print(f"tail, batch {args.tail_batch}, "
                  f"{'learning' if learn else 'warm-up times'}: {runs} us an iteration "
                  f"(K chosen: {dict(sorted(adaptive.chosen.items()))})")
        return
    for learn in (False, True):
        adaptive = make(module, learn)
        loop(adaptive, 2000)        # warm
        runs = [round(loop(adaptive, args.iterations), 1) for _ in range(3)]
        print(f"{'learning' if learn else 'warm-up times'}: {runs} us an iteration "
              f"(K chosen: {dict(sorted(adaptive.chosen.items()))})")


if __name__ == "__main__":
    main()
