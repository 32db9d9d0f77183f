"""H200/H100: the stream norm (``SPECLOOP_SKINNY_STREAM_NORM=1``) piece by piece, against the
default path, on SmolLM2-135M's layer shapes (random bf16 weights, 30 layers' copies so the
weights stream from HBM), at the row counts a step sees (1 request x 1..32 rows, 8 x 1 and
8 x 4): each timing replays a CUDA graph of the 30 layers' calls (bench_skinny_gemm's
``time_graph``), us per layer, median of 7 replays.

Pieces, each "default -> stream":
  o        the o GEMM -> the o GEMM adding the residual in its epilogue
  norm     add_rms_norm (what the prologue saves)
  gate_up  gate-up + SwiGLU on the normed rows -> the same normalising the stream it loads
  down     the down GEMM -> the same adding the residual in its epilogue
  qkv      norm_linear_rope (norm + qkv + RoPE + cache write) with the MLP's delta -> with
           none (the stream, normed as loaded where the rows run a one-tile tl.dot)
Then the chains in each SPECLOOP_SKINNY_STREAM_NORM mode (0, qkv, mlp, 1, qkv,mlp-b), as the
decoder runs them:
  mlp      out_norm_mlp (o, norm, gate-up, down; feeds_stream where the next qkv takes it)
  layer    mlp, then the next layer's qkv on its output (no attention)
Each row also names the configurations the table gives the rows, so a slow piece can be
traced to its kernel. No model weights needed.

    python bench/bench_stream_norm_gpu.py --out rows.jsonl
    # tables in turns in one process (rows tagged "table"; bench/tables/README.md):
    python bench/bench_stream_norm_gpu.py --tables code,$PWD/bench/tables/unsliced_1205.json
"""

from __future__ import annotations

import argparse
import json

import torch

LAYERS = 30
SHAPES_BT = ((1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 6), (1, 8), (1, 16), (1, 32),
             (8, 1), (8, 4))
H, I, HQ, HKV, D = 576, 1536, 9, 3, 64
EPS = 1e-5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="", help="JSON lines here too")
    ap.add_argument("--shapes", default="", help="B x T list, e.g. 1x4,1x5 (default: all)")
    ap.add_argument("--tables", default="",
                    help="skinny tables to time in turns, in this process: 'code' (the "
                         "shipped one) and SPECLOOP_SKINNY_TABLE files, comma-separated")
    args = ap.parse_args()
    from bench_skinny_gemm import time_graph
    from specloop.models import _kernels, _linear, _skinny
    from specloop.models._linear import PackedLinear, stream_modes

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(1)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).bfloat16()

    weights = [(rand((HQ + 2 * HKV) * D, H, scale=0.05), rand(H, H, scale=0.05),
                rand(2 * I, H, scale=0.05), rand(H, I, scale=0.05)) for _ in range(LAYERS)]
    nw = 1 + rand(H, scale=0.1)
    inv = 1.0 / 100000.0 ** (torch.arange(0, D, 2, device=dev).float() / D)
    angles = torch.arange(2048, device=dev).float()[:, None] * inv[None, :]
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    P = 16
    table = torch.arange(8 * 16, device=dev, dtype=torch.int32).view(8, 16)
    kc, vc = rand(8 * 16 + 1, P, HKV, D), rand(8 * 16 + 1, P, HKV, D)
    modes = {}
    for mode in ("0", "qkv", "mlp", "1", "qkv,mlp-b"):
        lin = PackedLinear(skinny=True)
        lin.qkv_stream, lin.mlp_stream, lin.mlp_stream_b = stream_modes(mode)
        modes[mode] = lin
    shapes = SHAPES_BT if not args.shapes else tuple(
        tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))
    rows_out = []

    def measure(B: int, T: int) -> dict:
        """One row: the pieces and the chains at B x T, by the table in force."""
        M = B * T
        x, delta, o_in = rand(B, T, H), rand(B, T, H), rand(B, T, H)
        rope = _skinny.RopeWrite(torch.full((B,), 40, device=dev),
                                 torch.arange(B, device=dev), table, 256, 8 * 16, cos, sin,
                                 kc, vc, HQ)
        lin0, lin1 = modes["0"], modes["1"]
        x2, o2 = x.view(M, H), o_in.view(M, H)
        h = _kernels.add_rms_norm(x2, None, nw, EPS)[0]
        act = torch.randn(M, I, device=dev, generator=gen).bfloat16()
        c_o = lin0._skinny_config(o2, weights[0][1], None, silu_mul=False)
        c_gu = lin0._skinny_config(x2, weights[0][2], None, silu_mul=False)
        c_down = lin0._down_config(act, weights[0][3])
        c_qkv = lin0._skinny_config(x2, weights[0][0], None, silu_mul=False)
        c_qkv_norm = lin0._norm_config(x, delta, nw, weights[0][0], None)
        tags = {"o": c_o and c_o.tag(), "gate_up": c_gu and c_gu.tag(),
                "down": c_down and c_down.tag(), "qkv": c_qkv and c_qkv.tag(),
                "qkv_norm_fused": c_qkv_norm is not None}
        res: dict[str, list] = {}

        def both(name, off, on):
            res[name] = [round(time_graph(off, LAYERS)[0], 2),
                         round(time_graph(on, LAYERS)[0], 2) if on is not None else None]

        fits_res_o = c_o is not None and _skinny.residual_fits(c_o, H)
        fits_norm_gu = c_gu is not None and _skinny.norm_prologue_fits(c_gu, H) and \
            _skinny.glu_fits(c_gu, H)
        fits_res_down = c_down is not None and _skinny.residual_fits(c_down, I)
        both("o", lambda i: lin0(o2, weights[i][1]),
             (lambda i: _skinny.skinny_linear(o2, weights[i][1], None, c_o, residual=x2))
             if fits_res_o else None)
        both("norm", lambda i: _kernels.add_rms_norm(x2, o2, nw, EPS)[0], None)
        both("gate_up",
             (lambda i: _skinny.skinny_linear(h, weights[i][2], None, c_gu, glu=True))
             if c_gu is not None and _skinny.glu_fits(c_gu, H) else
             (lambda i: lin0(h, weights[i][2])),
             (lambda i: _skinny.skinny_linear(x2, weights[i][2], None, c_gu, glu=True,
                                              norm=(nw, EPS))) if fits_norm_gu else None)
        both("down", lambda i: lin0._down(act, weights[i][3], c_down),
             (lambda i: _skinny.skinny_linear(act, weights[i][3], None, c_down,
                                              residual=x2)) if fits_res_down else None)
        both("qkv",
             lambda i: lin0.norm_linear_rope(x, delta, nw, EPS, weights[i][0], None, None,
                                             rope)[0],
             lambda i: lin1.norm_linear_rope(x, None, nw, EPS, weights[i][0], None, None,
                                             rope)[0])
        # The chains, in each SPECLOOP_SKINNY_STREAM_NORM mode: the MLP after attention,
        # and it then the next layer's qkv (as _decoder runs them: feeds_stream where that
        # qkv takes the stream).
        for mode, lin in modes.items():
            def mlp(i, lin=lin):
                wqkv, wo, wgu, wd = weights[i]
                feeds = lin.takes_stream(x, nw, wqkv, None, D)
                return lin.out_norm_mlp(x, o_in, wo, nw, EPS, wgu, wd, feeds)[1]

            def layer(i, lin=lin):
                wqkv, wo, wgu, wd = weights[i]
                feeds = lin.takes_stream(x, nw, wqkv, None, D)
                out, stream = lin.out_norm_mlp(x, o_in, wo, nw, EPS, wgu, wd, feeds)
                return lin.norm_linear_rope(stream, out, nw, EPS, wqkv, None, None, rope)[0]
            res.setdefault("mlp", {})[mode] = round(time_graph(mlp, LAYERS)[0], 2)
            res.setdefault("layer", {})[mode] = round(time_graph(layer, LAYERS)[0], 2)
        row = {"B": B, "T": T, "rows": M, "us_per_layer": res, "configs": tags,
               "device": torch.cuda.get_device_name()}
        return row

    tables = [t for t in args.tables.split(",") if t] or ["code"]
    loaded = {t: _linear.SKINNY_TABLE if t == "code" else _linear._table_from_file(t)
              for t in tables}
    for B, T in shapes:
        for name, skinny_table in loaded.items():   # in turns, one process: drift shared
            _linear.SKINNY_TABLE = skinny_table
            row = measure(B, T)
            if len(loaded) > 1:
                row["table"] = name
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    if args.out:
        with open(args.out, "w") as f:
            for row in rows_out:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
