"""All-greedy VERIFY epilogue on CUDA: the torch ops (argmax over [B, K+1, V], then
strict_from_targets' eq/cumprod/sum/where and the step's torch.cat into ``packed``) vs the
two Triton kernels of samplers/_triton_greedy.py (strict_verify's CUDA path, mode
"split"), which write ``packed`` [B, K+2] themselves, and its one-kernel mode "row" (a
program a row: SPECLOOP_GREEDY_VERIFY=row makes it strict_verify's).

Each is captured CALLS times into one CUDA graph on the same logits (as in a VERIFY step,
the lm_head has just written them: L2-warm at small batches), and the graph replayed;
the time printed is device microseconds per call (kernels plus the gaps between them in
a graph), the best of --rounds. All outputs are checked equal first.

    python bench/bench_greedy_verify_gpu.py [--rounds 5] [--dtype float32]

B in {1, 8, 32}, K+1 in {1, 4}, V = 49152 (SmolLM2); f32 logits, what DecoderModel.logits
returns. The ratios are torch / kernels (> 1: the kernels are faster). Then a draft step's
argmax [B, V] (DefaultSampler.draft), torch vs the same kernels, B in {1, 8, 32}.
"""

from __future__ import annotations

import argparse

import torch

from specloop.graphs._cuda import capture_graph
from specloop.samplers import SamplingBatch, SamplingParams, strict_verify
from specloop.samplers import _sampler, _triton_greedy
from specloop.samplers._sampler import packed_result, strict_from_targets

V = 49152
CALLS = 50


def torch_epilogue(d: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """What a VERIFY step ran before the kernels: argmax, strict_from_targets, torch.cat."""
    r = strict_from_targets(d, logits.argmax(dim=-1))
    return torch.cat([r.token_ids, r.num_accepted[:, None]], dim=1)


def kernel_epilogue(d: torch.Tensor, logits: torch.Tensor, batch: SamplingBatch,
                    pos: torch.Tensor) -> torch.Tensor:
    """strict_verify's CUDA path, mode "split" (the default)."""
    assert _sampler.usable(d, logits) and _triton_greedy._MODE == "split", \
        "run without SPECLOOP_GREEDY_VERIFY"
    return packed_result(strict_verify(d, logits, batch, pos))


def row_epilogue(d: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The one-kernel alternative: a program a row (mode "row")."""
    return _triton_greedy.greedy_verify(d, logits, mode="row")


def graph_us(fn, rounds: int) -> float:
    """Device us per call: CALLS calls in one graph, replayed; best of `rounds`."""
    graph, _ = capture_graph(lambda: [fn() for _ in range(CALLS)])
    graph.replay()
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (10 * CALLS))
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}, V={V}, {args.dtype} "
          f"logits, device us per call (CUDA graph of {CALLS} calls, best of {args.rounds})")
    print(f"{'B':>3} {'K+1':>4} {'S':>3} {'torch':>8} {'split':>8} {'row':>8} "
          f"{'t/split':>7} {'t/row':>6}")
    g = torch.Generator(device="cuda").manual_seed(0)
    for B in (1, 8, 32):
        for T in (1, 4):
            logits = (torch.randn(B, T, V, device="cuda", generator=g) * 3).to(dtype)
            t = logits.argmax(-1)
            # Half the rows accept every draft, the others break at a random position.
            d = t[:, :-1].clone()
            if T > 1:
                cut = torch.randint(0, T - 1, (B,), device="cuda", generator=g)
                miss = (torch.arange(T - 1, device="cuda") == cut[:, None])
                miss &= (torch.arange(B, device="cuda") % 2 == 1)[:, None]
                d = torch.where(miss, (d + 1) % V, d)
            batch = SamplingBatch.from_params([SamplingParams(temperature=0)] * B,
                                              list(range(B)), device="cuda")
            pos = torch.zeros(B, dtype=torch.int64, device="cuda")
            want = torch_epilogue(d, logits)
            assert torch.equal(kernel_epilogue(d, logits, batch, pos), want), (B, T)
            assert torch.equal(row_epilogue(d, logits), want), (B, T)
            base = graph_us(lambda: torch_epilogue(d, logits), args.rounds)
            fused = graph_us(lambda: kernel_epilogue(d, logits, batch, pos), args.rounds)
            row = graph_us(lambda: row_epilogue(d, logits), args.rounds)
            S = -(-V // _triton_greedy.chunk_size(B * T, V))
            print(f"{B:>3} {T:>4} {S:>3} {base:8.2f} {fused:8.2f} {row:8.2f} "
                  f"{base / fused:7.2f} {base / row:6.2f}")
    # A draft step's argmax over the full vocabulary (DefaultSampler.draft, not advanced:
    # the draft-model and early-exit drafters): logits.argmax(-1) vs the same kernels.
    print(f"draft argmax [B, V]\n{'B':>3} {'torch':>8} {'split':>8} {'row':>8} "
          f"{'t/split':>7} {'t/row':>6}")
    for B in (1, 8, 32):
        logits = (torch.randn(B, V, device="cuda", generator=g) * 3).to(dtype)
        for mode in ("split", "row"):
            assert torch.equal(_triton_greedy.greedy_argmax(logits, mode=mode),
                               logits.argmax(-1))
        base = graph_us(lambda: logits.argmax(-1), args.rounds)
        fused = graph_us(lambda: _triton_greedy.greedy_argmax(logits, mode="split"),
                         args.rounds)
        row = graph_us(lambda: _triton_greedy.greedy_argmax(logits, mode="row"), args.rounds)
        print(f"{B:>3} {base:8.2f} {fused:8.2f} {row:8.2f} {base / fused:7.2f} "
              f"{base / row:6.2f}")


if __name__ == "__main__":
    main()
