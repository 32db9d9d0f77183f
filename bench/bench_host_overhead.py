"""Host overhead per iteration with a trivial stand-in model, logging at warning level.

The stand-in's forward and LM head cost ~nothing, so the time per iteration is the
engine's own: scheduling, SYNC, the graph key, drafting, sampling and RESCAN.

    python bench/bench_host_overhead.py [--batch 64] [--iterations 300] [--consumers stream,batch]

``--gpu-path``: the path one GPU rank runs, on the CPU (``bench_chain_host``'s frozen graph
replays: replays copy their inputs and compute nothing; VERIFY queued from the event loop;
without speculation the step queued ahead, with eagle3 DRAFT + VERIFY chained), for
``--batch 64,128,256`` and ``--methods none,eagle3`` (K = ``--k``), ``--runs`` runs each:
wall and thread CPU per iteration, each state's time per iteration and per row, and
(``--profile FILE``) cProfile of the last run of each configuration.

    python bench/bench_host_overhead.py --gpu-path --batch 64,128,256 --methods none,eagle3 --k 3
"""

from __future__ import annotations

import argparse
import time

import anyio
import attrs
import torch

from _common import quiet_logs


class TrivialModel(torch.nn.Module):
    """Logits favour token (position-independent) 7; no attention, no weights to speak of."""

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.row = torch.zeros(args.vocab_size)
        self.row[7] = 1.0

    def forward(self, tokens, start_pos, slots, cache, *, num_layers=None, kv_len=None):
        return torch.zeros(*tokens.shape, self.args.hidden_size)

    def logits(self, hidden):
        return self.row.expand(*hidden.shape[:-1], -1)


def stand_in(tmp):
    from specloop.models import LoadedModel, load_model
    from specloop.models.testing import write_tiny_checkpoint
    real = load_model(write_tiny_checkpoint(tmp, vocab_size=320, num_layers=1, hidden=16,
                                            num_heads=2, num_kv_heads=1, intermediate=32))
    return LoadedModel(TrivialModel(real.args), real.tokenizer, real.args, real.path)


class StateTimes:
    """Sums each state's handler time: the engine's own cost, without its consumers."""

    def __init__(self):
        self.total_us = {}

    def on_transition(self, event):
        if event.batch_size:
            key = event.state.value
            self.total_us[key] = self.total_us.get(key, 0.0) + event.duration_us


def start_consumers(tg, engine, consumer, batch, prompt, params):
    """``batch`` requests of ``prompt`` in ``tg``, their outputs drained: one ``generate``
    task per request ("stream") or one ``generate_batch`` ("batch")."""
    async def one(i):
        async for _ in engine.generate(prompt, params, request_id=f"r{i}"):
            pass

    async def all_at_once():
        async for _ in engine.generate_batch([prompt] * batch, params):
            pass
    if consumer == "batch":
        tg.start_soon(all_at_once)
    else:
        for i in range(batch):
            tg.start_soon(one, i)


async def measure(config, loaded, batch, iterations, consumer="stream"):
    """-> (wall us, process CPU us) per iteration, state times, K. ``consumer``: one
    ``generate`` task per request ("stream") or one ``generate_batch`` ("batch")."""
    from specloop.engine import AsyncEngine
    from specloop.samplers import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
    k = config.speculative.k
    times = StateTimes()
    async with AsyncEngine(config, model=loaded, observers=[times]) as engine:
        async with anyio.create_task_group() as tg:
            start_consumers(tg, engine, consumer, batch, [1, 2, 3, 4], params)
            while engine.stats.num_iterations < 20:
                await anyio.sleep(0.01)
            start_it, start = engine.stats.num_iterations, time.perf_counter()
            cpu = time.process_time()
            times.total_us.clear()
            while engine.stats.num_iterations < start_it + iterations:
                await anyio.sleep(0.01)
            done = engine.stats.num_iterations - start_it
            per_it = (time.perf_counter() - start) / done
            cpu_it = (time.process_time() - cpu) / done
            states = {k_: v / done for k_, v in times.total_us.items()}
            tg.cancel_scope.cancel()
    return per_it * 1e6, cpu_it * 1e6, sum(states.values()), states, k


async def direct_handlers_us(config, loaded, batch, iterations):
    """The engine's own host work: every handler of an iteration called in order on a
    fixed batch of ``batch`` decoding requests, compute inline (no thread hop, no
    consumers), the stand-in model costing ~nothing."""
    from specloop.engine import AsyncEngine, IterationRecord
    from specloop.engine._request import Request
    from specloop.samplers import SamplingParams, SpecMetadata
    engine = AsyncEngine(config, model=loaded)
    engine._build()
    worker = engine.worker
    params = SamplingParams(temperature=0.0, max_tokens=10**9, ignore_eos=True)
    requests = [Request(f"r{i}", (1, 2, 3, 4), params, i, [1, 2, 3, 4], slot=i,
                        num_cached=3) for i in range(batch)]
    worker.scheduler.running = list(requests)
    spec = SpecMetadata(use_rejection_sampling=config.speculative.use_rejection_sampling)
    if worker.drafter is not None:
        for r in requests:
            worker.drafter.prefill(r.slot, r.token_ids[:-1], None)

    async def one():
        rec = IterationRecord(0, spec)
        rec.batch = list(requests)
        await worker.sync(rec)
        await worker.pick_graph_key(rec)
        await worker.draft(rec)
        rec.result = worker._verify(rec)
        await worker.rescan(rec)

    for _ in range(20):
        await one()
    start = time.perf_counter()
    for _ in range(iterations):
        await one()
    return (time.perf_counter() - start) / iterations * 1e6


class PipeParent:
    """``--core``: the parent's end of a ProcessEngine core's pipe, played in this process:
    ``submit`` sends the requests as the parent's pump does (pickled FrontDoorMessages),
    a thread reads every message the core sends and drops it unread (the parent's reader
    unpickles them in its own process, outside the core's time)."""

    def __init__(self):
        import multiprocessing  # noqa: PLC0415
        import threading  # noqa: PLC0415
        self.conn, self.core_conn = multiprocessing.Pipe()
        self.messages = 0
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self):
        while True:
            try:
                self.conn.recv_bytes()
            except (EOFError, OSError):
                return
            self.messages += 1

    def submit(self, batch, prompt, params):
        import pickle  # noqa: PLC0415
        from specloop.engine._frontdoor import FrontDoorMessage  # noqa: PLC0415
        from specloop.engine._request import NewRequest  # noqa: PLC0415
        news = tuple((0, NewRequest(f"r{i}", tuple(prompt), params, i, handle=i))
                     for i in range(batch))
        self.conn.send_bytes(pickle.dumps(("msg", FrontDoorMessage(news)),
                                          pickle.HIGHEST_PROTOCOL))

    def watch(self, stats, iterations, loop_thread, out, clear, snapshot):
        """From a thread (the core's loop never yields while it has work, as in its own
        process): after 30 iterations, ``clear`` the state times and time ``iterations``
        iterations (wall, and the loop thread's CPU; ``snapshot`` the state times), then
        send the parent's shutdown."""
        import pickle  # noqa: PLC0415
        from specloop.engine._frontdoor import FrontDoorMessage  # noqa: PLC0415
        clock = time.pthread_getcpuclockid(loop_thread)
        while stats.num_iterations < 30:
            time.sleep(0.002)
        clear()
        first, start, cpu = stats.num_iterations, time.perf_counter(), time.clock_gettime(clock)
        while stats.num_iterations < first + iterations:
            time.sleep(0.002)
        out.update(done=stats.num_iterations - first, elapsed=time.perf_counter() - start,
                   thread=time.clock_gettime(clock) - cpu, states=snapshot())
        self.conn.send_bytes(pickle.dumps(("msg", FrontDoorMessage(shutdown=True)),
                                          pickle.HIGHEST_PROTOCOL))

    def close(self):
        self.core_conn.close()
        # The reader sees EOF once it has read what the core sent: joined, so its count is
        # final (on a busy 2-core box the test's check ran before the thread had ended).
        self._reader.join(timeout=30)
        self.conn.close()


def _gpu_path_worker(worker) -> None:
    """Set ``worker`` on one GPU rank's path: VERIFY from the event loop, the step queued
    ahead or DRAFT + VERIFY chained (the steps it takes: ``num_overlapped_iterations``)."""
    from specloop.engine._chain import DeviceChain  # noqa: PLC0415
    worker.verify_inline = True     # VERIFY from the event loop, as on CUDA
    if worker.k == 0:
        worker.ahead.always = True  # the step queued ahead
    elif worker.drafter is not None and worker.drafter.can_chain:
        worker.chain = DeviceChain(worker=worker)


async def gpu_path(cfg, loaded, batch, iterations, consumer="stream", profiler=None):
    """One GPU rank's path on the CPU (see the module doc): -> (wall us per iteration,
    thread CPU us per iteration, {state: us per iteration}, {state: thread CPU us per
    iteration}, share of iterations that took a step queued ahead or chained).
    ``consumer`` "core": the engine core of a ProcessEngine instead (``core_path``)."""
    if consumer == "core":
        return await core_path(cfg, loaded, batch, iterations, profiler)
    from bench_chain_host import ThreadTimes  # noqa: PLC0415 - beside this script
    from specloop.engine import AsyncEngine  # noqa: PLC0415
    from specloop.samplers import SamplingParams  # noqa: PLC0415
    params = SamplingParams(temperature=0.0, max_tokens=10 ** 6, ignore_eos=True)
    times, cpu = StateTimes(), ThreadTimes()
    async with AsyncEngine(cfg, model=loaded, observers=[times, cpu]) as engine:
        _gpu_path_worker(engine.worker)
        stats = engine.stats
        async with anyio.create_task_group() as tg:
            start_consumers(tg, engine, consumer, batch, [1, 2, 3, 4, 5, 6], params)
            while engine.stats.num_iterations < 30:
                await anyio.sleep(0.005)
            first, steps = stats.num_iterations, stats.num_overlapped_iterations
            times.total_us.clear()
            cpu.clear()
            if profiler is not None:
                profiler.enable()
            start, thread = time.perf_counter(), time.thread_time()
            while engine.stats.num_iterations < first + iterations:
                await anyio.sleep(0.005)
            elapsed, thread = time.perf_counter() - start, time.thread_time() - thread
            if profiler is not None:
                profiler.disable()
            done = engine.stats.num_iterations - first
            states = {s: v / done for s, v in times.total_us.items()}
            cpu_states = {s: v / done for s, v in cpu.us.items()}
            share = (stats.num_overlapped_iterations - steps) / done
            engine.front.close()    # the consumers end with their requests
    return elapsed / done * 1e6, thread / done * 1e6, states, cpu_states, share


async def core_path(cfg, loaded, batch, iterations, profiler=None):
    """``gpu_path`` for the engine core of a ProcessEngine: the engine behind
    engine/_core_process.py's PipeFrontDoor, the parent's side played by ``PipeParent``
    (a thread times it: the core's loop never yields while it has work). The profile, if
    any, covers the warm-up iterations too."""
    import threading  # noqa: PLC0415
    from bench_chain_host import ThreadTimes  # noqa: PLC0415 - beside this script
    from specloop.engine import AsyncEngine  # noqa: PLC0415
    from specloop.engine._core_process import PipeFrontDoor  # noqa: PLC0415
    from specloop.samplers import SamplingParams  # noqa: PLC0415
    params = SamplingParams(temperature=0.0, max_tokens=10 ** 6, ignore_eos=True)
    times, cpu = StateTimes(), ThreadTimes()
    parent = PipeParent()
    front = PipeFrontDoor(parent.core_conn)
    out: dict = {}

    def clear():
        times.total_us.clear()
        cpu.clear()

    def snapshot():
        return dict(times.total_us), dict(cpu.us)
    try:
        async with AsyncEngine(cfg, model=loaded, observers=[times, cpu],
                               front_door=front) as engine:
            worker = engine.worker
            _gpu_path_worker(worker)
            watcher = threading.Thread(target=parent.watch, args=(
                worker.stats, iterations, threading.get_ident(), out, clear, snapshot))
            parent.submit(batch, [1, 2, 3, 4, 5, 6], params)
            if profiler is not None:
                profiler.enable()
            watcher.start()
            await engine.wait_closed()
            if profiler is not None:
                profiler.disable()
            watcher.join()
            share = engine.stats.num_overlapped_iterations / engine.stats.num_iterations
    finally:
        parent.close()
    done, (wall_us, cpu_us) = out["done"], out["states"]
    return (out["elapsed"] / done * 1e6, out["thread"] / done * 1e6,
            {s: v / done for s, v in wall_us.items()},
            {s: v / done for s, v in cpu_us.items()}, share)


def gpu_path_main(args):
    import cProfile
    import io
    import os
    import pstats
    import statistics
    import tempfile
    from bench_chain_host import config  # noqa: PLC0415 - beside this script
    from specloop.models import load_model  # noqa: PLC0415
    from specloop.models.testing import write_tiny_checkpoint  # noqa: PLC0415
    print(f"load average {os.getloadavg()}", flush=True)
    order = ("SCHEDULE", "SYNC", "PICK_GRAPH_KEY", "DRAFT", "VERIFY", "RESCAN")
    profiles = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(tmp, vocab_size=384, num_layers=2, hidden=64, seed=1)
        loaded = load_model(path, dtype=torch.float32)
        for method in args.methods.split(","):
            for batch in map(int, args.batch.split(",")):
                cfg = config(path, method, args.k, batch)
                if hasattr(cfg.parallel, "freeze_gc"):     # as on a GPU ("auto")
                    cfg = attrs.evolve(cfg, parallel=attrs.evolve(cfg.parallel,
                                                                  freeze_gc="on"))
                for consumer in args.consumers.split(","):
                    rows = []
                    for run in range(args.runs):
                        profiler = cProfile.Profile() if args.profile and \
                            run == args.runs - 1 else None
                        rows.append(anyio.run(
                            gpu_path, cfg, loaded, batch, args.iterations, consumer, profiler,
                            backend_options={"use_uvloop": True} if args.uvloop else None))
                        wall, thread, states, cpu_states, share = rows[-1]
                        print(f"  {method} batch {batch} {consumer}: wall {wall:.0f} us/it, "
                              f"thread CPU {thread:.0f} us/it ({thread / batch:.2f} per row), "
                              f"steps taken {share:.2f}; state wall us/it: "
                              + " ".join(f"{s} {states.get(s, 0):.0f}" for s in order)
                              + "; thread CPU us/it: "
                              + " ".join(f"{s} {cpu_states.get(s, 0):.0f}" for s in order),
                              flush=True)
                        if profiler is not None:
                            out = io.StringIO()
                            stats = pstats.Stats(profiler, stream=out)
                            stats.sort_stats("tottime").print_stats(40)
                            stats.sort_stats("cumulative").print_stats(60)
                            profiles.write(f"==== {method} batch {batch} {consumer}\n"
                                           + out.getvalue())
                    walls = [r[0] for r in rows]
                    threads = [r[1] for r in rows]

                    def rng(values, per=1):
                        return f"{min(values) / per:.1f}-{max(values) / per:.1f}"
                    print(f"{method} K={args.k if method != 'none' else 0} batch {batch} "
                          f"{consumer}: wall {rng(walls)} us/it ({rng(walls, batch)} per row); "
                          f"thread CPU {rng(threads)} ({rng(threads, batch)} per row); "
                          "per state thread CPU us/it (per row): "
                          + " ".join(f"{s} {m:.0f} ({m / batch:.2f})" for s, m in (
                              (s, statistics.median(r[3].get(s, 0) for r in rows))
                              for s in order)), flush=True)
    if args.profile:
        with open(args.profile, "w") as f:
            f.write(profiles.getvalue())


def main():
    import tempfile
    from specloop.engine import EngineConfig
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="64", help="batch sizes, comma-separated")
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--consumers", default="stream,batch",  # --gpu-path: also "core"
                    help="stream: a generate task per request; batch: one generate_batch")
    ap.add_argument("--methods", default=None, help="default: none,ngram; --gpu-path "
                    "none,eagle3")
    ap.add_argument("--gpu-path", action="store_true",
                    help="one GPU rank's path (step queued ahead, chain) on the CPU")
    ap.add_argument("--k", type=int, default=3, help="--gpu-path: K of the drafter")
    ap.add_argument("--runs", type=int, default=3, help="--gpu-path: runs each")
    ap.add_argument("--profile", default="", help="--gpu-path: cProfile stats to this file")
    ap.add_argument("--uvloop", action="store_true",
                    help="--gpu-path: on uvloop's event loop (pip install uvloop)")
    args = ap.parse_args()
    quiet_logs()
    torch.set_num_threads(1)
    if args.gpu_path:
        args.methods = args.methods or "none,eagle3"
        if args.consumers == "stream,batch":
            args.consumers = "stream"
        gpu_path_main(args)
        return
    args.methods = args.methods or "none,ngram"
    with tempfile.TemporaryDirectory() as tmp:
        loaded = stand_in(tmp)
        for method in args.methods.split(","):
            for batch in map(int, args.batch.split(",")):
                config = EngineConfig.from_dict({
                    "model": {"name": str(loaded.path), "max_seq_len": 4096,
                              "chat_template": False},
                    "scheduler": {"max_batch_size": batch},
                    "speculative": {"method": method, "num_draft_tokens": 4}})
                direct = anyio.run(direct_handlers_us, config, loaded, batch, args.iterations)
                for consumer in args.consumers.split(","):
                    wall, cpu, engine_us, states, k = anyio.run(
                        measure, config, loaded, batch, args.iterations, consumer)
                    split = ", ".join(f"{s_} {v:.0f}" for s_, v in states.items())
                    print(f"host overhead, batch {batch}, method {method} (K={k}): engine "
                          f"handlers {direct:.0f} us/iteration (goal <= 200); in the running "
                          f"engine with {consumer} consumers and compute off the event loop "
                          f"{wall:.0f} us/iteration wall, {cpu:.0f} us process CPU [state "
                          f"times incl. consumers run meanwhile: {split}]", flush=True)

if __name__ == "__main__":
    main()
