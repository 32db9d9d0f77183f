"""GPU: one SmolLM2-shaped forward step (random bf16 weights), fused kernels vs reference ops.

Per batch (1, 8, 64) and step width (1 = decode, 5 = VERIFY with K=4), with every row at
``--context`` cached positions: replay time of a CUDA graph of forward + LM head, for the
fused Triton path and the reference path (static kv_len, as graphs had to use before);
their agreement; and the kernels per layer of a fused decode step (torch.profiler).

    python bench/bench_gpu_step.py [--context 300]
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from _common import quiet_logs

SMOLLM2_SHAPE = dict(vocab_size=49152, num_layers=30, hidden=576, num_heads=9,
                     num_kv_heads=3, intermediate=1536)


def _graph(model, cache, tokens, start, slots, kv_len):
    from specloop.graphs._cuda import capture_graph
    return capture_graph(
        lambda: model.logits(model(tokens, start, slots, cache, kv_len=kv_len)[:, -1]),
        warmups=2)


def _time(graph, n=50):
    for _ in range(5):
        graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(n):
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return sorted(times)[n // 2]


def _setup(model, batch, context, max_len, page_size=16):
    from specloop.models import PageTable
    pages = PageTable(batch, max_len, page_size, device="cuda")
    cache = model.make_cache(batch, max_len, pages=pages)
    for slot in range(batch):
        pages.resize(slot, context + 8)
    pages.sync()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for slot in range(batch):  # write the context (chunked prefill through the same model)
        ids = torch.randint(0, model.args.vocab_size, (1, context), device="cuda", generator=gen)
        model(ids, torch.tensor([0], device="cuda"), torch.tensor([slot], device="cuda"), cache)
    return cache


def smollm2_model():
    """A DecoderModel of SMOLLM2_SHAPE with random weights, bf16, on CUDA."""
    from specloop.models import load_model
    from specloop.models.testing import write_tiny_checkpoint
    path = write_tiny_checkpoint(tempfile.mkdtemp(), **SMOLLM2_SHAPE, seed=0)
    return load_model(path, dtype=torch.bfloat16, device="cuda").model


def step_cases(model, batches, widths, context, max_len):
    """Per batch, a cache with ``context`` positions written in every slot (_setup), and per
    step width T random tokens: yields (batch, T, cache, tokens, start, slots)."""
    for batch in batches:
        cache = _setup(model, batch, context, max_len)
        slots = torch.arange(batch, device="cuda")
        start = torch.full((batch,), context, device="cuda")
        for T in widths:
            tokens = torch.randint(0, model.args.vocab_size, (batch, T), device="cuda")
            yield batch, T, cache, tokens, start, slots


def kernels_per_layer(model, cache, tokens, start, slots):
    from torch.profiler import ProfilerActivity, profile
    model(tokens, start, slots, cache)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(tokens, start, slots, cache)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower()]
    names = {}
    for e in kernels:
        names[e.name[:60]] = names.get(e.name[:60], 0) + 1
    return len(kernels) / model.args.num_layers, names


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--max-len", type=int, default=1024)
    args = ap.parse_args()
    quiet_logs()
    model = smollm2_model()
    print(f"random SmolLM2-shaped weights, bf16, {torch.cuda.get_device_name()}, "
          f"context {args.context}, max_seq_len {args.max_len}")
    for batch, T, cache, tokens, start, slots in step_cases(model, (1, 8, 64), (1, 5),
                                                            args.context, args.max_len):
        res = {}
        for fused in (True, False):
            model.kernels = fused
            graph, out = _graph(model, cache, tokens, start, slots,
                                None if fused else args.max_len)
            res[fused] = (_time(graph), out.clone())
        diff = (res[True][1] - res[False][1]).abs().max().item()
        agree = (res[True][1].argmax(-1) == res[False][1].argmax(-1)).float().mean().item()
        print(f"batch {batch:3d} T={T}: fused {res[True][0]:.3f} ms, reference "
              f"(kv_len={args.max_len}) {res[False][0]:.3f} ms; max|dlogit| {diff:.3f}, "
              f"argmax agree {agree:.3f}", flush=True)
        if batch == 1 and T == 5:  # after batch 1's last width, on its cache
            model.kernels = True
            per_layer, names = kernels_per_layer(model, cache, tokens[:, :1], start, slots)
            print(f"fused decode step: {per_layer:.2f} kernels per layer; {names}")
    model.kernels = None


if __name__ == "__main__":
    main()
