"""Token-wise rejection sampling on CUDA: the Triton kernel vs the copy-bandwidth roofline
and vs the torch path on the same GPU.

B=64, K=4, V in {49152, 151936}, f32 probabilities. Roofline = bytes of target_probs
[B, K+1, V] and draft_probs [B, K, V] read once / measured device copy bandwidth; the
fraction printed is roofline time / kernel time (goal >= 0.7). The kernel reads only the
row at tau (plus K gathered entries), so it can beat that roofline; the bandwidth on the
bytes it actually touches is printed too. Times are CUDA-graph replays (device time, no
launch overhead), cycling through input sets larger than L2; eager times are shown too.

    python bench/bench_rejection_gpu.py [--repeats N]
"""

from __future__ import annotations

import argparse

import torch

from _common import device_seconds
from specloop.graphs._cuda import capture_graph
from specloop.samplers import _rejection, rejection_sample

B, K = 64, 4
VOCABS = (49152, 151936)
SETS_BYTES = 1 << 30  # cycle through >= 1 GiB of inputs so L2 (~50 MB) never holds them


def copy_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Best device-to-device copy rate, bytes read plus bytes written."""
    src = torch.ones(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * nbytes / best / 1e9


def inputs(V: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t_logits = torch.randn(B, K + 1, V, device="cuda", generator=g) * 2
    target = torch.softmax(t_logits, -1)
    noise = torch.randn(B, K, V, device="cuda", generator=g)
    draft = torch.softmax(t_logits[:, :K] + noise, -1)
    d = torch.multinomial(draft.reshape(-1, V), 1, generator=g).reshape(B, K)
    # Half the drafts argmax p, so point-mass drafts get accepted too.
    half = torch.rand(B, K, device="cuda", generator=g) < 0.5
    d = torch.where(half, target[:, :K].argmax(-1), d)
    seeds = torch.arange(B, device="cuda") * 1000 + seed
    positions = torch.full((B,), 100, device="cuda")
    return d, target, draft, seeds, positions


def graph_ms(sets, point_mass: bool, repeats: int) -> float:
    """Device ms per call: a graph of one call per input set, replayed `repeats` times."""
    def calls():
        for d, t, q, s, pos in sets:
            rejection_sample(d, t, None if point_mass else q, seeds=s, positions=pos,
                             validate=False)
    graph, _ = capture_graph(calls)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (repeats * len(sets))


def eager_ms(sets, point_mass: bool, repeats: int) -> float:
    d, t, q, s, pos = sets[0]
    fn = lambda: rejection_sample(d, t, None if point_mass else q, seeds=s,  # noqa: E731
                                  positions=pos, validate=False)
    fn()
    return device_seconds(fn, repeats) * 1e3


def torch_path():
    """Context: rejection_sample without the kernel (the CPU algorithm on CUDA tensors)."""
    class Ctx:
        def __enter__(self):
            self.saved = _rejection._triton_rejection.usable
            _rejection._triton_rejection.usable = lambda *a: False

        def __exit__(self, *exc):
            _rejection._triton_rejection.usable = self.saved
    return Ctx()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    bw = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: device copy "
          f"{bw:.0f} GB/s (read + write)")
    for V in VOCABS:
        set_bytes = (2 * K + 1) * B * V * 4
        sets = [inputs(V, seed) for seed in range(max(2, -(-SETS_BYTES // set_bytes)))]
        for point_mass in (False, True):
            read = (K + 1 if point_mass else 2 * K + 1) * B * V * 4  # bytes read once
            touched = (1 if point_mass else 2) * B * V * 4  # the rows at tau
            roof_ms = read / (bw * 1e9) * 1e3
            k_ms = graph_ms(sets, point_mass, args.repeats)
            k_eager = eager_ms(sets, point_mass, args.repeats)
            with torch_path():
                t_ms = graph_ms(sets, point_mass, max(2, args.repeats // 4))
                t_eager = eager_ms(sets, point_mass, max(2, args.repeats // 4))
            acc = rejection_sample(*sets[0][:2], None if point_mass else sets[0][2],
                                   seeds=sets[0][3], positions=sets[0][4],
                                   validate=False).num_accepted.float().mean()
            print(f"V={V:6d} {'point-mass' if point_mass else 'full-q    '} "
                  f"kernel {k_ms * 1e3:7.1f} us (eager {k_eager * 1e3:6.1f}) | "
                  f"roofline {roof_ms * 1e3:6.1f} us for {read / 1e6:5.0f} MB -> "
                  f"fraction {roof_ms / k_ms:5.2f} | touched {touched / 1e6:4.0f} MB at "
                  f"{touched / k_ms / 1e6:5.0f} GB/s | torch path {t_ms * 1e3:7.1f} us "
                  f"(eager {t_eager * 1e3:6.1f}) -> kernel {t_ms / k_ms:5.1f}x faster "
                  f"(eager {t_eager / k_eager:4.1f}x) | mean accepted {acc:.2f}")
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
