"""A multi-rank run under torchrun: a stream of mixed greedy and seeded sampled requests,
arriving over time; rank 0 writes the outputs (JSON) and every rank reports its
per-iteration SYNC cost. Run the same workload with 1 and N processes and compare:

    torchrun --standalone --nproc-per-node 2 bench/adp_run.py --out out2.json [options]
    torchrun --standalone --nproc-per-node 1 bench/adp_run.py --out out1.json [options]
    python bench/adp_run.py --compare out1.json out2.json

Weights are random in SmolLM2's shape unless --model names a checkpoint (timing and
equality only: the outputs are not meaningful text).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import anyio
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import quiet_logs  # noqa: E402

SMOLLM2_SHAPE = dict(vocab_size=49152, num_layers=30, hidden=576, num_heads=9,
                     num_kv_heads=3, intermediate=1536)


class StateCost:
    def __init__(self):
        self.us = {}
        self.events = []        # (iteration, state, duration us): --trace-out
        self.last = -1          # the last iteration seen

    def on_transition(self, event):
        self.last = event.iteration
        if event.batch_size or event.state.value == "SYNC":
            self.us.setdefault(event.state.value, []).append(event.duration_us)
            self.events.append((event.iteration, event.state.value, event.duration_us))


def workload(n, seed_base=0, balanced_tokens=0):
    """Mixed greedy / seeded sampled requests of varied lengths arriving 5 ms apart; or,
    with ``balanced_tokens``, n equal greedy requests (16-token prompts, that many new
    tokens each) all at once: the same work on every rank."""
    from specloop.samplers import SamplingParams
    if balanced_tokens:
        params = SamplingParams(temperature=0.0, max_tokens=balanced_tokens, ignore_eos=True)
        return [([(7 * i + j) % 300 + 10 for j in range(16)], params, 0.0) for i in range(n)]
    reqs = []
    for i in range(n):
        prompt = [(7 * i + j) % 300 + 10 for j in range(8 + i % 13)]   # < the tiny vocab
        if i % 3 == 1:
            params = SamplingParams(temperature=0.8, top_p=0.95, seed=seed_base + i,
                                    max_tokens=24 + i % 40, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=24 + (5 * i) % 48,
                                    ignore_eos=True)
        reqs.append((prompt, params, 0.005 * i))
    return reqs


async def serve(engine, reqs, consumer="stream"):
    """stream: one ``generate`` task per request, each after its delay; batch: one
    ``generate_batch`` for all at once (delays ignored)."""
    outs = {}
    if consumer == "batch":     # automatic ids "req-N", N increasing in prompt order
        async for item in engine.generate_batch([p for p, _, _ in reqs],
                                                [q for _, q, _ in reqs]):
            for o in item:
                outs.setdefault(o.request_id, []).extend(o.token_ids)
        return [outs[i] for i in sorted(outs, key=lambda rid: int(rid.split("-")[1]))]

    async def one(i, prompt, params, delay):
        await anyio.sleep(delay)
        outs[i] = [t async for o in engine.generate(prompt, params) for t in o.token_ids]

    async with anyio.create_task_group() as tg:
        for i, (prompt, params, delay) in enumerate(reqs):
            tg.start_soon(one, i, prompt, params, delay)
    return [outs[i] for i in range(len(reqs))]


def engine_config(args, model, world, **parallel):
    """The run's EngineConfig (bench/adp_process.py's too); ``parallel``: more of its
    [parallel] section."""
    from specloop.engine import EngineConfig
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return EngineConfig.from_dict({
        "model": {"name": str(model), "dtype": args.dtype, "device": device,
                  "max_seq_len": 512, "chat_template": False},
        "scheduler": {"max_batch_size": args.batch},
        "speculative": {"method": args.method, "num_draft_tokens": args.k,
                        "use_rejection_sampling": args.rejection,
                        **({"draft_weights": args.draft_weights} if args.draft_weights
                           else {}),
                        **({"tree": json.loads(args.tree)} if args.tree else {})},
        "parallel": {"world_size": world, "attention_dp": world > 1,
                     "lm_head_tp_in_adp": args.lm_head_tp and world > 1, **parallel},
        "components": {"communicator": "torch_distributed" if world > 1 else "single",
                       "graph_cache": "cuda" if args.graphs and device == "cuda" else "eager"},
        "graphs": {"batch_buckets": [int(b) for b in args.buckets.split(",")]}})


async def main_async(args, path, world):
    from specloop.engine import AsyncEngine
    config = engine_config(args, path, world, checked_collectives=args.checked,
                           pin_host_cores=args.pin)
    cost = StateCost()
    engine = AsyncEngine(config, observers=[cost])
    if args.inline_collectives and hasattr(engine.comm, "inline"):
        engine.comm.inline = True       # NCCL collectives issued on the loop and polled
    if hasattr(engine.comm, "shared_memory"):
        if args.shared_memory_exchange:
            engine.comm.shared_memory = True    # host all-gathers through shared memory
        if args.gloo_exchange:
            engine.comm.shared_memory = False   # host all-gathers over gloo
    rounds = []     # rank 0: (consumer, first iteration, exchanges before, tok/s)
    async with engine:
        rank = engine.comm.rank
        print(f"[rank {rank}] pin_host_cores={args.pin}: loop thread on CPUs "
              f"{sorted(os.sched_getaffinity(0))}", flush=True)
        if rank == 0:
            rates, consumers = {}, args.consumer.split(",")
            for consumer in consumers:
                rates[consumer] = []
                for _ in range(args.rounds):    # the same workload again, warm engine
                    first = cost.last + 1
                    exchanges = engine.worker.exchange.times.count
                    start = time.perf_counter()
                    got = await serve(engine, workload(args.requests,
                                                       balanced_tokens=args.balanced_tokens),
                                      consumer)
                    elapsed = time.perf_counter() - start
                    rates[consumer].append(sum(len(o) for o in got) / elapsed)
                    rounds.append((consumer, first, exchanges, rates[consumer][-1]))
                    if consumer == consumers[0]:
                        outs = got
        else:
            await engine.wait_closed()
        iters = engine.stats.num_iterations
        # This rank's own rows: each rank drafts for its batch alone (its AL is its own).
        al = engine.stats.mean_acceptance_length
        per_k = dict(sorted(engine.stats.iterations_per_k.items()))
        chain = engine.worker.chain
        chained = "off" if chain is None else f"{chain.queued_steps} queued, " \
            f"{chain.taken_steps} taken"
        times = engine.worker.exchange.times
    sync = cost.us.get("SYNC", [0.0])
    print(f"[rank {rank}] iterations {iters}, acceptance length {al:.3f}, iterations by K "
          f"{per_k}, chained steps {chained}", flush=True)
    print(f"[rank {rank}] SYNC median {statistics.median(sync):.0f} us "
          f"mean {statistics.mean(sync):.0f} us over {len(sync)}; median state us: "
          + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in cost.us.items()),
          flush=True)
    if times.count:
        skew = [a for a, _ in times.recent]
        coll = [b for _, b in times.recent]
        print(f"[rank {rank}] exchange (one all-gather per iteration) over {times.count}: "
              f"collective after the last rank arrived median {statistics.median(coll):.0f} "
              f"us, mean {times.collective_us_total / times.count:.0f} us; waiting for the "
              f"last rank (skew) median {statistics.median(skew):.0f} us, mean "
              f"{times.skew_us_total / times.count:.0f} us", flush=True)
    if args.trace_out:
        os.makedirs(args.trace_out, exist_ok=True)
        with open(os.path.join(args.trace_out, f"trace_w{world}_r{rank}.json"), "w") as f:
            json.dump({"world": world, "rank": rank, "rounds": rounds,
                       "exchange_count": times.count,
                       "exchange": list(times.recent), "states": cost.events}, f)
    if rank == 0:
        for consumer, per in rates.items():
            print(f"[rank 0] world {world}, {consumer} consumer: tok/s per round: "
                  + ", ".join(f"{r:.0f}" for r in per), flush=True)
        with open(args.out, "w") as f:
            json.dump({"outputs": outs, "tok_s": rates}, f)


def compare(a, b):
    x, y = json.load(open(a))["outputs"], json.load(open(b))["outputs"]
    reqs = workload(len(x))
    greedy = [i for i, r in enumerate(reqs) if r[1].is_greedy]
    sampled = [i for i in range(len(x)) if i not in greedy]
    same_g = sum(x[i] == y[i] for i in greedy)
    same_s = sum(x[i] == y[i] for i in sampled)
    print(f"compare {a} vs {b}: greedy {same_g}/{len(greedy)} identical, seeded sampled "
          f"{same_s}/{len(sampled)} identical")
    return same_g == len(greedy) and same_s == len(sampled)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="adp_out.json")
    ap.add_argument("--compare", nargs=2)
    ap.add_argument("--model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--method", default="mtp_eagle")
    ap.add_argument("--draft-weights", help="a shipped head (e.g. smollm2-135m-instruct-eagle3)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--tree", default=None,
                    help="a draft tree (speculative.tree, JSON), e.g. '[[0], [1], [0, 0]]'")
    ap.add_argument("--rejection", action="store_true")
    ap.add_argument("--lm-head-tp", action="store_true")
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--checked", action="store_true")
    ap.add_argument("--inline-collectives", action="store_true",
                    help="tensor collectives issued on the event loop and polled, no thread")
    ap.add_argument("--shared-memory-exchange", action="store_true",
                    help="SCHEDULE's host all-gather through shared memory, not gloo")
    ap.add_argument("--gloo-exchange", action="store_true",
                    help="SCHEDULE's host all-gather over gloo (whatever the default)")
    ap.add_argument("--pin", default="auto", choices=("auto", "on", "off"),
                    help="parallel.pin_host_cores: each rank's loop thread on its own core")
    ap.add_argument("--trace-out",
                    help="folder: each rank's per-iteration state times and exchange "
                         "times (skew, collective), rank 0's round boundaries (JSON)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (tests)")
    ap.add_argument("--balanced-tokens", type=int, default=0,
                    help="N equal greedy requests of this many new tokens, all at once")
    ap.add_argument("--rounds", type=int, default=1, help="serve the workload N times")
    ap.add_argument("--consumer", default="stream",
                    help="stream: a generate task per request; batch: one generate_batch "
                         "for all; both: stream,batch (rounds each, outputs of the first)")
    ap.add_argument("--buckets", default="1,2,4,8,16,32",
                    help="CUDA-graph batch buckets")
    args = ap.parse_args()
    if args.compare:
        sys.exit(0 if compare(*args.compare) else 1)
    quiet_logs()
    torch.backends.cuda.matmul.allow_tf32 = False
    world = int(os.environ.get("WORLD_SIZE", "1"))
    path = args.model
    if path is None:
        from specloop.models.testing import write_tiny_checkpoint
        rank = os.environ.get("RANK", "0")
        shape = dict(vocab_size=384, num_layers=2) if args.tiny else SMOLLM2_SHAPE
        path = write_tiny_checkpoint(tempfile.mkdtemp(prefix=f"ckpt{rank}-"), **shape,
                                     seed=0)
    anyio.run(main_async, args, path, world)


if __name__ == "__main__":
    main()
