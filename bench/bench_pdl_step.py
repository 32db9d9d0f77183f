"""GPU: a SmolLM2-shaped forward step (random bf16 weights, the fused kernels) in a CUDA
graph, with and without Programmatic Dependent Launch (specloop.samplers._pdl).

bench_pdl.py measures PDL on a chain of plain GEMV kernels; this one on the engine's own
step: the 30 layers' skinny GEMMs (weight tiles loaded before the wait), norms, RoPE +
cache write, paged attention and the LM head, captured once with the switch off
(SPECLOOP_PDL=0's launches) and once on. Per batch (1, 8, 32) and step width (1 = decode,
4 = VERIFY with K=3), every row at ``--context`` cached positions: the median replay time
of each (best of ``--rounds`` interleaved rounds), the ratio, the microseconds saved, and
whether both graphs give the same logits bits (they must: PDL changes when kernels start,
not what they compute).

    python bench/bench_pdl_step.py [--context 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from _common import quiet_logs
from bench_gpu_step import _graph, _time, smollm2_model, step_cases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "pdl_step.json"))
    args = ap.parse_args()
    quiet_logs()
    from specloop.samplers import _pdl

    if not torch.cuda.is_available() or not _pdl.device_supports(torch.cuda.current_device()):
        raise SystemExit("PDL needs an sm_90+ GPU and Triton's gdc_wait")
    model = smollm2_model()
    assert model.uses_kernels
    print(f"random SmolLM2-shaped weights, bf16, {torch.cuda.get_device_name()}, "
          f"context {args.context}; graph replay ms, PDL off vs on", flush=True)
    rows = []
    for batch, T, cache, tokens, start, slots in step_cases(model, (1, 8, 32), (1, 4),
                                                            args.context, args.max_len):
        graphs = {}
        for on in (False, True):
            _pdl._ENV_ON = on       # the switch SPECLOOP_PDL sets at import
            graphs[on] = _graph(model, cache, tokens, start, slots, None)
        _pdl._ENV_ON = True
        best = {False: float("inf"), True: float("inf")}
        for _ in range(args.rounds):
            for on in (False, True):
                best[on] = min(best[on], _time(graphs[on][0]))
        same = bool(torch.equal(graphs[False][1], graphs[True][1]))
        row = {"batch": batch, "T": T, "off_ms": round(best[False], 4),
               "on_ms": round(best[True], 4),
               "saved_us": round((best[False] - best[True]) * 1e3, 1),
               "ratio": round(best[False] / best[True], 3), "same_bits": same}
        rows.append(row)
        print(f"batch {batch:3d} T={T}: off {best[False]:.3f} ms, on {best[True]:.3f} ms,"
              f" x{row['ratio']}, {row['saved_us']:+.1f} us, same bits: {same}",
              flush=True)
        del graphs
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "context": args.context,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
