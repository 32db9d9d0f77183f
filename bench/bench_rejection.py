"""rejection_sample on CPU vs a straightforward per-row Python reference.

B=32, K=4, V=49152 (SmolLM2's vocab). Prints milliseconds per call and the ratio
reference / vectorised (goal >= 10x). The reference is the same algorithm and the same
counter-based noise (it returns identical tokens, checked here); a second reference row
uses torch.rand instead, to show how much of its time is the per-scalar noise.

    python bench/bench_rejection.py [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specloop.samplers import rejection_sample
from specloop.samplers._reference import reference_rejection_sample

B, K, V = 32, 4, 49152


def naive_rand_reference(d, target, draft, gen):
    # The textbook per-row loop with torch.rand / torch.multinomial: not reproducible
    # across batches, shown only as a lower bound on a per-row implementation's time.
    out = torch.full((d.shape[0], d.shape[1] + 1), -1, dtype=torch.int64)
    for b in range(d.shape[0]):
        for i in range(d.shape[1]):
            x = int(d[b, i])
            if float(torch.rand((), generator=gen)) * float(draft[b, i, x]) <= float(target[b, i, x]):
                out[b, i] = x
                continue
            resid = (target[b, i] - draft[b, i]).clamp_min(0)
            out[b, i] = int(torch.multinomial(resid / resid.sum(), 1, generator=gen))
            break
        else:
            out[b, -1] = int(torch.multinomial(target[b, -1], 1, generator=gen))
    return out


def timed(fn, repeats: int) -> float:
    """Median milliseconds per call: the median resists other load on a shared machine."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def inputs(temperature_gap: float = 1.0):
    g = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(B, K + 1, V, generator=g), dim=-1)
    # Draft logits correlated with the target's so that some drafts get accepted.
    noise = torch.randn(B, K, V, generator=g) * temperature_gap
    draft = torch.softmax(torch.log(target[:, :K]) + noise, dim=-1)
    d = torch.multinomial(draft.reshape(-1, V), 1, generator=g).reshape(B, K)
    return d, target, draft


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    d, target, draft = inputs()
    seeds = torch.arange(B, dtype=torch.int64) * 1000 + 7
    positions = torch.full((B,), 100, dtype=torch.int64)
    kw = dict(seeds=seeds, positions=positions)
    print(f"B={B} K={K} V={V} torch {torch.__version__} threads={torch.get_num_threads()}")
    for method in ("token", "block"):
        vec = rejection_sample(d, target, draft, method=method, **kw)
        ref = reference_rejection_sample(d, target, draft, method=method, **kw)
        assert torch.equal(vec.token_ids, ref.token_ids), "vectorised != reference"
        t_ref = timed(lambda: reference_rejection_sample(d, target, draft, method=method, **kw),
                      max(1, args.repeats // 4))
        for validate in (False, True):
            t_vec = timed(lambda: rejection_sample(d, target, draft, method=method,
                                                   validate=validate, **kw), args.repeats)
            print(f"{method:5s} validate={validate!s:5s} vectorised {t_vec:7.3f} ms | "
                  f"per-row reference {t_ref:7.2f} ms | ratio {t_ref / t_vec:6.1f}x  "
                  f"(mean accepted {vec.num_accepted.float().mean():.2f})")
    gen = torch.Generator().manual_seed(1)
    t_naive = timed(lambda: naive_rand_reference(d, target, draft, gen), args.repeats)
    t_vec = timed(lambda: rejection_sample(d, target, draft, validate=False, **kw), args.repeats)
    print(f"token vs naive torch.rand per-row loop {t_naive:7.2f} ms | ratio "
          f"{t_naive / t_vec:6.1f}x (not reproducible; lower bound on per-row cost)")


if __name__ == "__main__":
    main()
