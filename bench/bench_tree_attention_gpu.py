"""What a draft tree's visibility words and the query rows a program cost paged attention,
per call, at VERIFY's shapes (SmolLM2: 9 query heads, 3 KV heads, head dim 64, bf16).

On an H100 (2026-12-05, bench_tree_verify_gpu.py --kernels) a tree's VERIFY spent 152.8 µs
in attention at 5 rows against the chain's 107.7 at 4 (the same BLOCK_M of 16: the
visibility words alone), and from 6 rows the rule's BLOCK_M of 32 spills in an offline
sm_90 compile (Triton 3.9: 28 bytes with the tree, 12 without; 16 rows: none). For each
query token count T (batch 1, one context) this times the one kernel (S = 1) with and
without the tree's words (the words of a chain: row t sees rows 0..t, so both compute the
same bits, checked; int64 words: int32 ones shifted in 32 bits were slower on an H100,
10.2 against 9.1 us at 16 tokens, and went) at BLOCK_M
16, 32 and the rule's, each in a CUDA graph of ``--calls``
calls (the model's 30 layers; one cache per call); ``--split-mins``: split-KV too, its
splits from the shapes as in the engine, rows split from that many positions. Prints µs
per call; JSON to --out.

    python bench/bench_tree_attention_gpu.py [--tokens 4,5,8,16,32] [--context 320]
    python bench/bench_tree_attention_gpu.py --device cpu --tokens 4,6 --context 40 \\
        --max-len 64 --calls 2 --repeats 1 --replays 1      # a smoke test (interpreted)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
from bench_paged_attention import HKV, HQ, make_inputs, time_per_call  # noqa: E402

from specloop.models import _kernels  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", default="4,5,8,16,32", help="query tokens (1 + tree nodes)")
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--block-ms", default="16,32")
    ap.add_argument("--split-mins", default="",
                    help="also split-KV (splits from the shapes, as the engine) with these "
                         "split_min values, int64 words at the rule's BLOCK_M: e.g. 64,128")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{args.device}: us a call, batch 1, context {args.context}, S = 1")
    for T in (int(x) for x in args.tokens.split(",")):
        caches, q, table, slots, starts = make_inputs(1, T, args.context, args, args.device,
                                                      gen)
        bits = torch.tensor([(1 << (t + 1)) - 1 for t in range(T)], device=q.device)
        rule = _kernels._row_blocks(T, HQ, HKV)[0]
        row = {"T": T, "query_rows": T * HQ // HKV, "rule_block_m": rule, "us": {}}
        ref: dict[int, torch.Tensor] = {}
        for tree in (None, 64):
            for bm in dict.fromkeys([*(int(x) for x in args.block_ms.split(",")), rule]):
                def call(i, tree=tree, bm=bm):
                    k, v = caches[i]
                    return _kernels.paged_attention(
                        q, k, v, table, slots, starts, splits=1, block_m=bm,
                        **({"tree_bits": bits} if tree else {}))
                us, out = time_per_call(call, args.calls, args.device, args.replays,
                                        args.repeats)
                # The chain's words see what the causal mask sees: the same bits at a
                # BLOCK_M; another BLOCK_M groups the rows in other tiles (near enough).
                want = ref.setdefault(bm, out)
                assert torch.equal(out, want), (T, tree, bm)
                torch.testing.assert_close(out.float(), ref[next(iter(ref))].float(),
                                           rtol=2e-2, atol=2e-2)
                row["us"][f"{f'tree{tree}' if tree else 'chain'} m{bm}"] = round(us, 3)
        for smin in (int(x) for x in args.split_mins.split(",") if x):
            for tree in (None, 64):
                def call(i, tree=tree, smin=smin):
                    k, v = caches[i]
                    return _kernels.paged_attention(
                        q, k, v, table, slots, starts, split_min=smin,
                        **({"tree_bits": bits} if tree else {}))
                us, out = time_per_call(call, args.calls, args.device, args.replays,
                                        args.repeats)
                torch.testing.assert_close(out.float(), ref[rule].float(), rtol=2e-2,
                                           atol=2e-2)
                row["us"][f"{f'tree{tree}' if tree else 'chain'} m{rule} "
                          f"split>={smin}"] = round(us, 3)
        rows.append(row)
        print(f"  T {T:2d} ({row['query_rows']:2d} rows, rule m{rule}): " + ", ".join(
            f"{k} {v:.2f}" for k, v in row["us"].items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": args.device, "context": args.context,
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
