"""Programmatic Dependent Launch (specloop.samplers._pdl): the switch, and the rules of its
module doc checked in each converted kernel's sm_90 PTX, compiled offline on the CPU
(triton.compile for GPUTarget("cuda", 90, 32), no GPU needed) with GDC True and
launch_pdl: the PTX before the first ``griddepcontrol.wait`` is straight-line code (no
branch, no return: every program reaches the wait), holds no store, atomic or reduction,
and loads only through the pointer arguments the test names as the kernel's weights, all
of them (a taint walk: each register carries the pointer parameters its value derives
from, through arithmetic and loads); there is exactly one wait and one launch_dependents.
For three kernels (a weight-prefetching skinny GEMM, the norm GEMM, split-KV attention
with its atomics) the SASS too: ptxas keeps the order (ACQBULK is the wait).

A compile costs ~0.3-1 s (Triton's cache makes a repeat nearly free): one variant per
kernel, the one the hot path runs most (decode shapes), and the paths that differ in
where the wait must sit (attention split with "last" combine; skinny tl.dot, broadcast,
tile and split-K).
"""

from __future__ import annotations

import itertools
import re
import warnings

import pytest
import torch

from specloop.graphs._cuda import capture_graph
from specloop.samplers import _pdl

triton = pytest.importorskip("triton")

_REG = re.compile(r"%[a-z]+[0-9]+")
_PARAM = re.compile(r"\[\s*(\w+)_param_(\d+)\s*\]")


def _split_dest(operands: str) -> tuple[str, str]:
    """(destination part, source part) of an instruction's operand text."""
    operands = operands.strip()
    if operands.startswith("{"):
        end = operands.index("}") + 1
    else:
        end = operands.find(",")
        end = len(operands) if end < 0 else end
    return operands[:end], operands[end:]


def pre_wait_report(ptx: str) -> dict:
    """Walks the PTX up to the first griddepcontrol.wait: the pointer parameters the loads
    there read through, and whether a store/atomic/branch/return comes first."""
    body = ptx[ptx.index("{", ptx.index(".entry")):]
    pointer_params = {int(i) for i in re.findall(r"\.param \.u64 \.ptr[^\n]*_param_(\d+)",
                                                  ptx)}
    taint: dict[str, frozenset[int]] = {}
    loads: set[int] = set()
    bad: list[str] = []
    waited = False
    for raw in body.splitlines():
        line = raw.split("//")[0].strip().rstrip(";").strip()
        if not line or line.endswith(":") or line.startswith((".", "{", "}")):
            continue
        line = re.sub(r"^@!?%p[0-9]+\s+", "", line)  # a predicate guards, not a branch
        op, _, operands = line.partition(" ")
        if op.startswith("griddepcontrol.wait"):
            waited = True
            break
        stores = op.startswith("st.") and not op.startswith(("st.shared", "st.local"))
        if stores or op.startswith(("atom", "red", "bra", "ret", "exit", "cp.", "multimem")):
            bad.append(line)
            continue
        dest, src = _split_dest(operands)
        if op.startswith("ld.param"):
            m = _PARAM.search(operands)
            sources = frozenset({int(m.group(2))} if m else ())
        else:
            sources = frozenset().union(*(taint.get(r, frozenset())
                                          for r in _REG.findall(src)))
        if op.startswith("ld.global") or op.startswith("ld."):
            if not op.startswith("ld.param"):
                loads |= set(sources & pointer_params)
        for r in _REG.findall(dest):
            taint[r] = sources
    return {"waited": waited, "loads": loads, "bad": bad,
            "waits": ptx.count("griddepcontrol.wait"),
            "launches": ptx.count("griddepcontrol.launch_dependents")}


def compile_ptx(fn, signature: dict[str, str], constexprs: dict, num_warps: int = 4,
                gdc: bool = True) -> str:
    return _compile(fn, signature, constexprs, num_warps, gdc).asm["ptx"]


def sass_prefix(cubin: bytes) -> list[str] | None:
    """The SASS instructions before the first ACQBULK (griddepcontrol.wait; PREEXIT is
    launch_dependents), or None where Triton brings no cuobjdump."""
    import os
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    ops = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9.]+)",
                                             text)]
    assert "ACQBULK" in ops, "no ACQBULK in the SASS"
    return ops[:ops.index("ACQBULK")]


def _compile(fn, signature: dict[str, str], constexprs: dict, num_warps: int = 4,
             gdc: bool = True):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    consts = {**constexprs, "GDC": gdc}
    sig["GDC"] = "constexpr"
    with warnings.catch_warnings():  # Triton's own deprecation notices (FP fusion default)
        warnings.simplefilter("ignore")
        k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": num_warps, "launch_pdl": gdc})
    return k


def check_kernel(fn, signature: dict[str, str], constexprs: dict, weights: set[str],
                 num_warps: int = 4, sass: bool = False) -> None:
    """``weights``: the pointer arguments the kernel reads before its wait (exactly those:
    weights only, and the prefetch the kernel means to do is there). ``sass``: the SASS
    too (a disassembly costs ~0.3 s: a few kernels only)."""
    k = _compile(fn, signature, constexprs, num_warps)
    r = pre_wait_report(k.asm["ptx"])
    names = [n for n in signature]      # the kernel's parameters: its non-constexpr args
    read = {names[i] for i in r["loads"]}
    where = fn.__name__ if hasattr(fn, "__name__") else str(fn)
    assert r["waited"], f"{where}: no griddepcontrol.wait"
    assert r["waits"] == 1 and r["launches"] == 1, (where, r)
    assert not r["bad"], f"{where}: before the wait: {r['bad'][:3]}"
    assert read <= weights, f"{where}: reads {sorted(read - weights)} before the wait"
    assert read == weights, f"{where}: {sorted(weights - read)} not loaded before the wait"
    # ptxas keeps the order: in the SASS too, no store, atomic, branch or exit before the
    # wait, and global loads there only where the PTX has them.
    sass = sass_prefix(k.asm["cubin"]) if sass else None
    if sass is not None:
        bad = [op for op in sass if op.startswith(("STG", "ST.", "ATOMG", "ATOM.", "RED.", "BRA", "EXIT",
                                                   "RET", "LDGSTS", "UBLKCP", "UTMA"))]
        assert not bad, f"{where}: SASS before the wait: {bad[:3]}"
        assert bool(weights) == any(op.startswith("LDG") for op in sass), (where, sass)


def test_switch_off_on_cpu_and_keywords_paired():
    x = torch.zeros(2)
    assert not _pdl.enabled(x) and _pdl.launch_kw(x) == {"GDC": False}
    # GDC True only ever comes with launch_pdl=True, and the other way round.
    assert _pdl.ON == {"GDC": True, "launch_pdl": True}
    assert "launch_pdl" not in _pdl.OFF


def test_checker_catches_a_load_or_store_before_the_wait():
    # The walk must see a non-weight load, a store and an early return before the wait.
    import triton.language as tl

    @triton.jit
    def bad_load(x_ptr, w_ptr, y_ptr, GDC: tl.constexpr):
        w = tl.load(w_ptr)
        x = tl.load(x_ptr)
        if GDC:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        tl.store(y_ptr, x + w)

    sig = {"x_ptr": "*fp32", "w_ptr": "*fp32", "y_ptr": "*fp32"}
    r = pre_wait_report(compile_ptx(bad_load, sig, {}))
    assert r["loads"] == {0, 1} and not r["bad"]

    @triton.jit
    def bad_store(x_ptr, y_ptr, GDC: tl.constexpr):
        if tl.program_id(0) > 0:
            return
        tl.store(y_ptr, 1.0)
        if GDC:
            tl.extra.cuda.gdc_wait()
        tl.store(y_ptr, tl.load(x_ptr))

    k = _compile(bad_store, {"x_ptr": "*fp32", "y_ptr": "*fp32"}, {})
    r = pre_wait_report(k.asm["ptx"])
    assert r["bad"] and r["loads"] == set()
    sass = sass_prefix(k.asm["cubin"])
    assert sass is None or {"STG.E", "EXIT"} & set(sass), sass


def test_kernels_wait_before_reading_activations_or_storing():
    from specloop.models import _kernels as K

    norm = {"x_ptr": "*bf16", "d_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16",
            "out_ptr": "*bf16", "copy_ptr": "*bf16", "pick_ptr": "*i64", "H": "i32",
            "copy_stride": "i32", "T": "i32", "eps": "fp32"}
    check_kernel(K._add_rms_norm_kernel, norm,
                 {"W_ROWS": 1, "HAS_DELTA": True, "HAS_COPY": True, "PICK": False,
                  "BLOCK": 1024}, weights={"w_ptr"})
    # With a pick the weight's row depends on the picked row: read after the wait.
    check_kernel(K._add_rms_norm_kernel, norm,
                 {"W_ROWS": 1, "HAS_DELTA": True, "HAS_COPY": False, "PICK": True,
                  "BLOCK": 1024}, weights=set())
    for rows in (False, True):      # a tree's parents by index: the constant table before
        check_kernel(K._eagle_prologue_kernel,
                     {"tok_ptr": "*i64", "emb_ptr": "*bf16", "hid_ptr": "*bf16",
                      "ew_ptr": "*bf16", "hw_ptr": "*bf16", "out_ptr": "*bf16",
                      "rows_ptr": "*i64", "H": "i32", "eps": "fp32", "T": "i32",
                      "tok_sb": "i32", "tok_st": "i32", "hid_sb": "i32", "hid_st": "i32"},
                     {"BLOCK": 1024, "ROWS": rows},
                     weights={"ew_ptr", "hw_ptr"} | ({"rows_ptr"} if rows else set()))
    for dest in (False, True):     # a draft tree's children, into their nodes' columns too
        check_kernel(K._topk_map_kernel,
                     {"x_ptr": "*bf16", "map_ptr": "*i64", "out_ptr": "*i64",
                      "dest_ptr": "*i64", "N": "i32", "out_stride": "i32", "E": "i32"},
                     {"K": 3, "K_P2": 4, "MAP": 2, "BLOCK": 4096, "DEST": dest}, weights=set(),
                     num_warps=16)
    check_kernel(K._argmax_map_kernel,
                 {"x_ptr": "*bf16", "map_ptr": "*i64", "out_ptr": "*i64", "N": "i32",
                  "out_stride": "i32"}, {"MAP": 2, "BLOCK": 4096}, weights=set(),
                 num_warps=16)
    # Their split form: the keys' scratch and the row's counter after the wait too.
    for dest, nan_max in ((False, True), (True, False)):
        check_kernel(K._topk_split_kernel,
                     {"x_ptr": "*bf16", "map_ptr": "*i64", "keys_ptr": "*i64",
                      "cnt_ptr": "*i32", "out_ptr": "*i64", "dest_ptr": "*i64", "N": "i32",
                      "out_stride": "i32", "E": "i32"},
                     {"K": 3, "K_P2": 4, "MAP": 2, "CHUNK": 1024, "S_P2": 16,
                      "NAN_MAX": nan_max, "DEST": dest}, weights=set())
    # With a draft tree's rows too: their RoPE offsets are read after the wait.
    for tree in (False, True):
        check_kernel(K._rope_write_kernel,
                     {"qkv_ptr": "*bf16", "q_ptr": "*bf16", **CACHE_SIG},
                     {"HQ": 9, "HKV": 3, "D": 64, "PAGE": 16, "BLOCK_QK": 16, "BLOCK_V": 4,
                      "TREE": tree}, weights=set())
    check_kernel(K._silu_mul_kernel, {"gu_ptr": "*bf16", "out_ptr": "*bf16", "inter": "i32"},
                 {"BLOCK": 1024}, weights=set())
    for first in (False, True):     # VERIFY's first token and position written too
        check_kernel(K._draft_glue_kernel,
                     {"v_ptr": "*i64", "meta_ptr": "*i64", "len_ptr": "*i64",
                      "last_ptr": "*i64", "tok_ptr": "*i64", "start_ptr": "*i64",
                      "first_ptr": "*i64", "pos_ptr": "*i64", "W": "i32", "s_v": "i32",
                      "s_meta": "i32", "s_len": "i32", "s_first": "i32"},
                     {"BLOCK_W": 4, "FIRST": first, "POS": first}, weights=set(),
                     num_warps=1)


ATTENTION_SIG = {"q_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "table_ptr": "*i32",
                 "slot_ptr": "*i64", "start_ptr": "*i64", "o_ptr": "*bf16", "m_ptr": "*fp32",
                 "l_ptr": "*fp32", "acc_ptr": "*fp32", "cnt_ptr": "*i32", "tree_ptr": "*i64",
                 "T": "i32", "pos_offset": "i32", "tree_back": "i32", "scale": "fp32",
                 "s_page": "i32", "s_off": "i32", "s_table": "i32", "pages_per_slot": "i32"}


def test_attention_waits_before_its_early_return_and_counters():
    from specloop.models import _kernels as K

    # Split-KV with the last program combining: the early return of idle splits and the
    # counter atomics all come after the wait.
    check_kernel(K._paged_attention_kernel, ATTENTION_SIG,
                 {"HQ": 9, "HKV": 3, "D": 64, "PAGE": 16, "BLOCK_M": 16, "BLOCK_N": 64,
                  "SPLITS": 8, "SPLIT_MIN": 512, "LAST_COMBINES": True, "SC": 4,
                  "S_BLOCK": 8, "TREE": False}, weights=set(), sass=True)
    # A draft tree's rows: the visibility words are read after the wait.
    check_kernel(K._paged_attention_kernel, {**ATTENTION_SIG, "tree_ptr": "*i64"},
                 {"HQ": 9, "HKV": 3, "D": 64, "PAGE": 16, "BLOCK_M": 16, "BLOCK_N": 64,
                  "SPLITS": 1, "SPLIT_MIN": 0, "LAST_COMBINES": False, "SC": 1,
                  "S_BLOCK": 1, "TREE": True}, weights=set())
    check_kernel(K._attention_combine_kernel,
                 {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "o_ptr": "*bf16",
                  "start_ptr": "*i64", "n_rows": "i32", "T": "i32", "pos_offset": "i32"},
                 {"HQ": 9, "HKV": 3, "D": 64, "BLOCK_M": 16, "BLOCK_N": 64, "SPLITS": 8,
                  "SPLIT_MIN": 512, "S_BLOCK": 8, "ROWS": 8}, weights=set())


def test_greedy_kernels_wait_first():
    from specloop.samplers import _triton_greedy as G

    partials, combine, row, tree = G._kernels()
    imax = G._INT_MAX
    check_kernel(partials, {"x_ptr": "*bf16", "pv_ptr": "*fp32", "pi_ptr": "*i32", "V": "i32",
                            "T": "i32", "s_b": "i32", "s_t": "i32", "S": "i32"},
                 {"CHUNK": 2048, "BLOCK": 1024, "IMAX": imax}, weights=set())
    check_kernel(combine, {"pv_ptr": "*fp32", "pi_ptr": "*i32", "d_ptr": "*i64",
                           "out_ptr": "*i64", "K": "i32", "S": "i32", "s_d": "i32"},
                 {"T_P2": 4, "S_P2": 32, "IMAX": imax, "COUNT": True}, weights=set(),
                 num_warps=1)
    check_kernel(row, {"x_ptr": "*bf16", "d_ptr": "*i64", "out_ptr": "*i64", "V": "i32",
                       "K": "i32", "s_b": "i32", "s_t": "i32", "s_d": "i32"},
                 {"T_P2": 4, "BLOCK": 8192, "IMAX": imax, "COUNT": True}, weights=set(),
                 num_warps=16)
    # A draft tree's walk (its targets through memory, or in registers): the tree's tables
    # (constants) before the wait, at the warps the launcher gives the 15- and 31-node
    # trees (tree_warps).
    for registers, t_p2 in itertools.product((False, True), (16, 32)):
        check_kernel(tree, {"pv_ptr": "*fp32", "pi_ptr": "*i32", "tok_ptr": "*i64",
                            "tgt_ptr": "*i64", "par_ptr": "*i64", "anc_ptr": "*i64",
                            "dep_ptr": "*i64", "out_ptr": "*i64", "path_ptr": "*i64",
                            "R": "i32", "D": "i32", "S": "i32", "s_tok": "i32"},
                     {"T_P2": t_p2, "S_P2": 32, "D_P2": 8, "IMAX": imax,
                      "REGISTERS": registers},
                     weights={"par_ptr", "anc_ptr", "dep_ptr"},
                     num_warps=G.tree_warps(t_p2, 32))


def test_tree_path_move_waits_first():
    from specloop.models import _kernels as K

    for rows in (False, True):      # with the path's feature rows gathered too
        check_kernel(K._keep_path_kernel,
                     {"k_ptr": "*bf16", "v_ptr": "*bf16", "table_ptr": "*i32",
                      "slot_ptr": "*i64", "start_ptr": "*i64", "path_ptr": "*i64",
                      "src_ptr": "*bf16", "dst_ptr": "*bf16", "D1": "i32", "s_layer": "i32",
                      "s_page": "i32", "s_off": "i32", "s_table": "i32",
                      "pages_per_slot": "i32", "max_seq_len": "i32", "scratch_page": "i32",
                      "R": "i32", "F": "i32"},
                     {"WIDTH": 192, "PAGE": 16, "D_P2": 4, "BLOCK": 256, "ROWS": rows,
                      "F_BLOCK": 2048 if rows else 1}, weights=set())


# The arguments every kernel that writes RoPE'd heads takes last (RopeWrite.kernel_args).
CACHE_SIG = {"kc_ptr": "*bf16", "vc_ptr": "*bf16", "start_ptr": "*i64", "slot_ptr": "*i64",
             "table_ptr": "*i32", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "rope_ptr": "*i64",
             "T": "i32", "pos_offset": "i32", "max_pos": "i32", "s_page": "i32",
             "s_off": "i32", "s_table": "i32", "pages_per_slot": "i32", "max_seq_len": "i32",
             "scratch_page": "i32"}
SKINNY_SIG = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32",
              "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
              "stride_ym": "i32", "k_per_split": "i32", "r_ptr": "*bf16", "nw_ptr": "*bf16",
              "eps": "fp32", "p_ptr": "*fp32", "cnt_ptr": "*i32"}
NORM_SIG = {"x_ptr": "*bf16", "d_ptr": "*bf16", "nw_ptr": "*bf16", "w_ptr": "*bf16",
            "b_ptr": "*bf16", "y_ptr": "*bf16", "s_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32",
            "N": "i32", "K": "i32", "stride_wn": "i32", "stride_ym": "i32",
            "stride_cm": "i32", "eps": "fp32", **CACHE_SIG}


@pytest.mark.parametrize("path", ["broadcast", "tile", "dot_split", "dot_one_pass",
                                  "dot_one_pass_glu", "dot_pieces", "tile_res",
                                  "dot_pieces_res", "dot_pieces_norm_glu",
                                  "dot_sliced_norm_glu", "dot_slice_programs_res"])
def test_skinny_loads_its_weight_tile_before_the_wait(path):
    from specloop.models import _skinny as S

    # Broadcast (the 1-row decode GEMMs, silu-down's prologue): W and the bias before;
    # tile: W before, the bias at the store; tl.dot split-K: the wait first; tl.dot in one
    # pass: W before (d16x1024, as the sweep and qkv / gate-up run it: BLOCK_K 1024 ~0.6 s
    # to compile cold, where the SwiGLU prologue at 2048, a form the sweep leaves out, took
    # ~22 s).
    meta = {"broadcast": dict(ACT=1, HAS_BIAS=True, DOT=False, SPLIT_K=1, BLOCK_M=1,
                              BLOCK_N=2, BLOCK_K=1024, TILE=False, ONE_PASS=False),
            "tile": dict(ACT=0, HAS_BIAS=True, DOT=False, SPLIT_K=1, BLOCK_M=4, BLOCK_N=4,
                         BLOCK_K=1024, TILE=True, ONE_PASS=False),
            "dot_split": dict(ACT=0, HAS_BIAS=False, DOT=True, SPLIT_K=2, BLOCK_M=16,
                              BLOCK_N=16, BLOCK_K=128, TILE=False, ONE_PASS=False),
            "dot_one_pass": dict(ACT=0, HAS_BIAS=False, DOT=True, SPLIT_K=1, BLOCK_M=16,
                                 BLOCK_N=16, BLOCK_K=1024, TILE=False, ONE_PASS=True),
            # gate-up with SwiGLU in the epilogue (norm_mlp): its two halves of W before
            "dot_one_pass_glu": dict(ACT=0, HAS_BIAS=False, DOT=True, SPLIT_K=1, BLOCK_M=16,
                                     BLOCK_N=64, BLOCK_K=1024, TILE=False, ONE_PASS=True,
                                     GLU=True),
            # K = 576 as two tiles, 512 + 64 (one_pass_piece): both halves of W before
            "dot_pieces": dict(ACT=0, HAS_BIAS=False, DOT=True, SPLIT_K=1, BLOCK_M=16,
                               BLOCK_N=16, BLOCK_K=1024, TILE=False, ONE_PASS=True,
                               PIECE=64),
            # the o GEMM with the residual add (out_norm_mlp): the stream after the wait
            "tile_res": dict(ACT=0, HAS_BIAS=False, DOT=False, SPLIT_K=1, BLOCK_M=2,
                             BLOCK_N=4, BLOCK_K=1024, TILE=True, ONE_PASS=False, RES=True),
            "dot_pieces_res": dict(ACT=0, HAS_BIAS=False, DOT=True, SPLIT_K=1, BLOCK_M=16,
                                   BLOCK_N=64, BLOCK_K=1024, TILE=False, ONE_PASS=True,
                                   PIECE=64, RES=True),
            # gate-up with the stream's RMSNorm in the prologue: its weight before too
            "dot_pieces_norm_glu": dict(ACT=0, HAS_BIAS=False, DOT=True, SPLIT_K=1,
                                        BLOCK_M=16, BLOCK_N=64, BLOCK_K=1024, TILE=False,
                                        ONE_PASS=True, PIECE=64, GLU=True, NORM=True),
            # the same in four slices of K, each its own tl.dot: every slice's W before
            "dot_sliced_norm_glu": dict(ACT=0, HAS_BIAS=False, DOT=True, SPLIT_K=1,
                                        BLOCK_M=16, BLOCK_N=64, BLOCK_K=1024, TILE=False,
                                        ONE_PASS=True, PIECE=64, GLU=True, NORM=True,
                                        SLICES=4),
            # the down GEMM's three slices of K = 1536, a program each, the residual add
            # in the last: its slice of W before; the scratch, counter and stream after
            "dot_slice_programs_res": dict(ACT=0, HAS_BIAS=False, DOT=True, SPLIT_K=1,
                                           BLOCK_M=16, BLOCK_N=32, BLOCK_K=2048,
                                           TILE=False, ONE_PASS=True, PIECE=512, RES=True,
                                           SLICES=2, SLICE_PROGRAMS=3)}[path]
    meta.setdefault("GLU", False)
    meta.setdefault("PIECE", 0)
    meta.setdefault("RES", False)
    meta.setdefault("NORM", False)
    meta.setdefault("SLICES", 1)
    meta.setdefault("SLICE_PROGRAMS", 0)
    before = {"broadcast": {"w_ptr", "b_ptr"}, "tile": {"w_ptr"}, "dot_split": set(),
              "dot_one_pass": {"w_ptr"}, "dot_one_pass_glu": {"w_ptr"},
              "dot_pieces": {"w_ptr"}, "tile_res": {"w_ptr"}, "dot_pieces_res": {"w_ptr"},
              "dot_pieces_norm_glu": {"w_ptr", "nw_ptr"},
              "dot_sliced_norm_glu": {"w_ptr", "nw_ptr"},
              "dot_slice_programs_res": {"w_ptr"}}[path]
    sig = dict(SKINNY_SIG, y_ptr="*fp32") if meta["SPLIT_K"] > 1 else SKINNY_SIG
    check_kernel(S._skinny_kernel, sig, meta, weights=before, sass=path == "broadcast")


@pytest.mark.parametrize("piece, tree, gather", [(64, True, False), (0, False, False),
                                                 (64, False, True)])
def test_skinny_rope_loads_weight_and_bias_before_the_wait(piece, tree, gather):
    """The qkv GEMM with RoPE and the cache write as its epilogue: W's tiles and the bias
    before the wait; positions, slots, the block table, x, the rotation tables after
    (with the tree and the norm: its K in four slices, each its own tl.dot). ``gather``
    (the first layer's embedding lookup, with the norm): the tokens and the table's rows
    after the wait too."""
    from specloop.models import _skinny as S

    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "q_ptr": "*bf16",
           "nw_ptr": "*bf16", "M": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
           "eps": "fp32", **CACHE_SIG, "tok_ptr": "*i64", "stream_ptr": "*bf16"}
    # (NORM with the tree: the stream's norm in the prologue, its weight before the wait;
    # and half a head a program)
    norm = tree or gather
    check_kernel(S._skinny_rope_kernel, sig,
                 dict(HQ=9, HKV=3, D=64, PAGE=16, HAS_BIAS=True, BLOCK_M=16, BLOCK_K=1024,
                      PIECE=piece, TREE=tree, NORM=norm, SLICES=4 if tree else 1,
                      BLOCK_N=32 if tree else 0, GATHER=gather),
                 weights={"w_ptr", "b_ptr"} | ({"nw_ptr"} if norm else set()), num_warps=8)


def test_norm_skinny_and_splitk_reduce():
    from specloop.models import _skinny as S

    # rope: the qkv GEMM with RoPE + the cache write as its epilogue (positions and slots
    # after the wait, with x), one row at a time and in one reduction.
    for tile, glu, rope, before in ((False, False, False, {"nw_ptr", "w_ptr", "b_ptr"}),
                                    (True, False, False, {"nw_ptr", "w_ptr"}),
                                    (False, True, False, {"nw_ptr", "w_ptr", "b_ptr"}),
                                    (False, False, True, {"nw_ptr", "w_ptr", "b_ptr"}),
                                    (True, False, True, {"nw_ptr", "w_ptr"})):
        extra = dict(ROPE=True, HQ=9, HKV=3, D=64, PAGE=16, TREE=tile) if rope else \
            dict(ROPE=False, HQ=1, HKV=1, D=2, PAGE=1, TREE=False)   # (the defaults)
        check_kernel(S._norm_skinny_kernel, NORM_SIG,
                     dict(HAS_DELTA=True, HAS_COPY=True, HAS_BIAS=True, BLOCK_M=4 if tile else 1,
                          BLOCK_N=4 if glu or rope else 2, BLOCK_K=1024, TILE=tile, GLU=glu,
                          **extra),
                     weights=before, sass=tile)
    check_kernel(S._splitk_reduce_kernel,
                 {"p_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32",
                  "stride_ym": "i32"}, dict(HAS_BIAS=True, SPLIT_K=2, BLOCK=1024),
                 weights=set())


def test_rejection_and_ngram_kernels_wait_first():
    from specloop.models.drafters import _ngram_device as N
    from specloop.samplers import _triton_rejection as R
    from specloop.samplers._rng import Stream

    chunk_sums, sample = R._kernels()
    sig = {"d_ptr": "*i64", "t_ptr": "*bf16", "q_ptr": "*bf16", "seeds_ptr": "*i64",
           "pos_ptr": "*i64", "sums_ptr": "*fp64", "tau_ptr": "*i64"}
    strides = {"V": "i32", "st_b": "i32", "st_k": "i32", "sq_b": "i32", "sq_k": "i32"}
    common = dict(K=3, NCH=12, HAS_Q=True, CHUNK=R._CHUNK, CPP=R._CHUNKS_PER_PROGRAM,
                  START0=R._CHAIN_STARTS[0], START1=R._CHAIN_STARTS[1])
    check_kernel(chunk_sums, {**sig, **strides}, dict(common, ACCEPT=int(Stream.ACCEPT)),
                 weights=set(), num_warps=8)
    check_kernel(sample, {**sig, "out_ptr": "*i64", **strides},
                 dict(common, NCH_P2=16, K1_P2=4, RESIDUAL=int(Stream.RESIDUAL),
                      BONUS=int(Stream.BONUS)), weights=set())
    check_kernel(N._ngram_chain_kernel,
                 {"hist_ptr": "*i64", "stride": "i32", "ver_ptr": "*i64", "ver_stride": "i32",
                  "acc_ptr": "*i64", "meta_ptr": "*i64", "out_ptr": "*i64",
                  "bonus_ptr": "*i64", "pos_ptr": "*i64", "next_ptr": "*i64", "rows": "i32"},
                 dict(S=2048, W=4, WP=4, K=3, KP=4, NMIN=1, NMAX=3, BLOCK=512, NEXT=True),
                 weights=set())


class _Recorder:
    """Stands in for a jitted kernel: records each launch's keywords (no kernel runs)."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((self.name, kw))


def test_every_launch_of_a_step_passes_the_switch(monkeypatch):
    """Every launcher of a step's Triton kernels launches with _pdl.launch_kw's keywords
    (here forced on, the kernels recorded, not run): GDC True with launch_pdl True, at
    every launch (split-KV both combines, split-K's reduce, both greedy modes included)."""
    from specloop.models import _kernels as K
    from specloop.models import _skinny as S
    from specloop.models._skinny import SkinnyConfig
    from specloop.models.drafters import _ngram_device as N
    from specloop.samplers import _triton_greedy as G
    from specloop.samplers import _triton_rejection as R

    calls: list = []
    monkeypatch.setattr(_pdl, "launch_kw", lambda t: _pdl.ON)
    for mod, names in ((K, ["_add_rms_norm_kernel", "_eagle_prologue_kernel",
                            "_argmax_map_kernel", "_topk_map_kernel", "_topk_split_kernel",
                            "_rope_write_kernel", "_paged_attention_kernel",
                            "_attention_combine_kernel", "_silu_mul_kernel",
                            "_draft_glue_kernel"]),
                       (S, ["_skinny_kernel", "_norm_skinny_kernel", "_splitk_reduce_kernel",
                            "_skinny_rope_kernel"]),
                       (N, ["_ngram_chain_kernel"])):
        for name in names:
            monkeypatch.setattr(mod, name, _Recorder(name, calls))
    monkeypatch.setattr(G, "_kernels", lambda: tuple(
        _Recorder(n, calls) for n in ("partials", "combine", "row", "tree")))
    monkeypatch.setattr(R, "_kernels", lambda: tuple(
        _Recorder(n, calls) for n in ("chunk_sums", "sample")))
    f, i64 = torch.float32, torch.int64
    x = torch.zeros(2, 8)
    K.add_rms_norm(x, x, torch.ones(8), 1e-5)
    K.eagle_prologue(torch.zeros(2, dtype=i64), torch.zeros(10, 8), x, torch.ones(8),
                     torch.ones(8), 1e-5)
    K.argmax_map(torch.zeros(2, 16), None, split=False)
    K.topk_map(torch.zeros(2, 16), 3, None, split=False)
    K.topk_map(torch.zeros(2, 16), 2, None, out=torch.zeros(1, 5, dtype=i64),
               dest=torch.zeros(2, 2, dtype=i64), split=False)
    K.argmax_map(torch.zeros(2, 16), None, split=True)
    K.topk_map(torch.zeros(2, 16), 3, None, split=True)
    kc = torch.zeros(8, 16, 1, 16)
    table, one = torch.zeros(1, 64, dtype=torch.int32), torch.zeros(1, dtype=i64)
    K.rope_cache_write(torch.zeros(1, 1, 4 * 16), one, one, table, 1024, 0,
                       torch.zeros(64, 16), torch.zeros(64, 16), kc, kc, num_heads=2)
    q = torch.zeros(1, 1, 2, 16)
    for splits, combine in ((1, "last"), (4, "last"), (4, "kernel")):
        K.paged_attention(q, kc, kc, table, one, one, splits=splits, combine=combine)
    K.silu_mul(torch.zeros(2, 16))
    K.draft_glue(torch.zeros(2, 3, dtype=i64), torch.zeros(4, 2, dtype=i64),
                 torch.zeros(2, 2, dtype=i64))
    w = torch.zeros(4, 64)
    S.skinny_linear(torch.zeros(1, 64), w, None, SkinnyConfig(False, 2, 1024))
    S.skinny_linear(torch.zeros(1, 64), w, None, SkinnyConfig(True, 16, 16, split_k=2))
    S.skinny_norm_linear(torch.zeros(1, 64), None, torch.ones(64), 1e-5, w, None,
                         SkinnyConfig(False, 2, 1024))
    S.skinny_norm_linear(torch.zeros(1, 2, 64), None, torch.ones(64), 1e-5,
                         torch.zeros(4 * 16, 64), None, SkinnyConfig(False, 4, 1024),
                         rope=S.RopeWrite(one, one, table, 1024, 0, torch.zeros(64, 16),
                                          torch.zeros(64, 16), kc, kc, num_heads=2))
    S.skinny_rope_linear(torch.zeros(1, 2, 64), torch.zeros(4 * 16, 64), None,
                         SkinnyConfig(True, 16, 64),
                         S.RopeWrite(one, one, table, 1024, 0, torch.zeros(64, 16),
                                     torch.zeros(64, 16), kc, kc, num_heads=2))
    logits, d = torch.zeros(1, 3, 16, dtype=f), torch.zeros(1, 2, dtype=i64)
    G.greedy_verify(d, logits, mode="split")
    G.greedy_verify(d, logits, mode="row")
    R.token_rejection_sample(d, logits, None, one, one)
    N._chain_step_triton(torch.zeros(2, 32, dtype=i64), torch.zeros(1, 3, dtype=i64), one,
                         torch.zeros(4, dtype=i64), k=2, ngram_min=1, ngram_max=2,
                         bonus=one.clone(), start_pos=one.clone())
    launched = {name for name, _ in calls}
    assert launched == {"_add_rms_norm_kernel", "_eagle_prologue_kernel", "_argmax_map_kernel",
                        "_topk_map_kernel", "_topk_split_kernel", "_rope_write_kernel",
                        "_paged_attention_kernel",
                        "_attention_combine_kernel", "_silu_mul_kernel",
                        "_draft_glue_kernel", "_skinny_kernel",
                        "_norm_skinny_kernel", "_splitk_reduce_kernel", "_skinny_rope_kernel",
                        "_ngram_chain_kernel",
                        "partials", "combine", "row", "chunk_sums", "sample"}, launched
    wrong = [name for name, kw in calls if kw.get("GDC") is not True
             or kw.get("launch_pdl") is not True]
    assert not wrong, wrong


# On the GPU: PDL changes when a kernel starts, not what it computes, so the same bits
# with the switch on and off, eager and in a CUDA graph (where a misplaced wait would let a
# kernel read its predecessor's output unfinished: a replay would then differ).

@pytest.fixture
def pdl_switch(monkeypatch):
    """set(on): the process's switch (read once from SPECLOOP_PDL at import) for this test."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not _pdl.device_supports(torch.cuda.current_device()):
        pytest.skip("PDL needs sm_90+ and Triton's gdc_wait")

    def set_(on: bool) -> None:
        monkeypatch.setattr(_pdl, "_ENV_ON", on)
        assert _pdl.enabled(torch.zeros(1, device="cuda")) is on
    return set_


def _replayed(fn, inputs: list[torch.Tensor], feeds: list[list[torch.Tensor]]):
    """fn() captured in a CUDA graph (after a warm-up on a side stream); for each feed,
    copied into ``inputs`` and replayed: the outputs, cloned."""
    graph, out = capture_graph(fn)
    outs = []
    for feed in feeds:
        for dst, src in zip(inputs, feed):
            dst.copy_(src)
        graph.replay()
        outs.append([t.clone() for t in out])
    torch.cuda.synchronize()
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_skinny_chain_same_bits_with_pdl(pdl_switch, rows):
    """SmolLM2's layer GEMMs chained as in the model (norm + qkv, o, norm + gate-up,
    silu-down, each reading the one before; 3 layers; the shipped table's configurations
    for these rows, the norm fused where they take it, else add_rms_norm first; a split-K
    tl.dot o for the reduce kernel), on two inputs: eager with
    PDL == eager without, and graph replays with == replays without (each graph captured
    under its switch)."""
    from specloop.models import _kernels, _linear
    from specloop.models._skinny import SkinnyConfig, skinny_linear, skinny_norm_linear

    gen = torch.Generator(device="cuda").manual_seed(0)
    dt, H, eps = torch.bfloat16, 576, 1e-5

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dt)

    def cfg(n, k, silu=False):
        c = _linear.skinny_config(rows, n, k, silu)
        return c if c is not None else SkinnyConfig(False, 2, 2048 if k > 1024 else 1024)

    layers = [dict(nw=1 + rand(H, scale=0.1), qkv=rand(960, H, scale=H ** -0.5),
                   o=rand(H, H, scale=H ** -0.5), gu=rand(3072, H, scale=H ** -0.5),
                   down=rand(H, 1536, scale=1536 ** -0.5)) for _ in range(3)]
    c_qkv, c_gu, c_down = cfg(960, H), cfg(3072, H), cfg(H, 1536, True)
    c_o = SkinnyConfig(True, 16, 128, split_k=2)      # tl.dot + the split-K reduce
    x = rand(rows, H)

    def norm_gemm(stream, delta, nw, w, c):
        # As PackedLinear.norm_linear dispatches: the norm in the prologue where the table
        # fuses it for these rows, else add_rms_norm and the GEMM (e.g. a tl.dot tail).
        if _linear.skinny_config(rows, w.shape[0], H, norm=True) == c:
            return skinny_norm_linear(stream, delta, nw, eps, w, None, c)
        h, stream = _kernels.add_rms_norm(stream, delta, nw, eps)
        return skinny_linear(h, w, None, c), stream

    def chain():
        stream, delta = x, None
        for w in layers:
            qkv, stream = norm_gemm(stream, delta, w["nw"], w["qkv"], c_qkv)
            o = skinny_linear(qkv[:, :H], w["o"], None, c_o)
            gu, stream = norm_gemm(stream, o, w["nw"], w["gu"], c_gu)
            delta = skinny_linear(gu, w["down"], None, c_down, silu_mul=True)
        return [stream, delta]

    feeds = [[rand(rows, H)] for _ in range(2)]

    def eager():
        outs = []
        for (f,) in feeds:
            x.copy_(f)
            outs.append([t.clone() for t in chain()])
        return outs

    got = {}
    for pdl in (False, True):
        pdl_switch(pdl)
        got[pdl, False] = eager()
        got[pdl, True] = _replayed(chain, [x], feeds)
    for graph in (False, True):
        assert all(torch.equal(a, b) for r, o in zip(got[False, graph], got[True, graph])
                   for a, b in zip(r, o)), graph


@pytest.mark.gpu
@pytest.mark.parametrize("combine", ["last", "kernel"])
def test_gpu_decode_step_same_bits_with_pdl(tiny_dirs, pdl_switch, combine, monkeypatch):
    """The fused bf16 decoder (norms, rope + cache write, split-KV attention over ~600
    positions with either combine, silu-mul) then the greedy verify kernels, three decode
    steps: with PDL the same bits as without, eager and replayed in a CUDA graph (each
    captured under its switch): logits, tokens and the KV cache written."""
    from specloop.models import _kernels, load_model
    from specloop.samplers import _triton_greedy

    monkeypatch.setattr(_kernels, "_COMBINE", combine)
    model = load_model(tiny_dirs["llama"], dtype=torch.bfloat16, device="cuda").model
    assert model.uses_kernels
    B, S, L = 2, 1024, 600
    gen = torch.Generator().manual_seed(3)
    V = model.args.vocab_size
    prompt = torch.randint(0, V, (B, L), generator=gen).cuda()
    slots = torch.tensor([0, 1], device="cuda")
    tokens = torch.zeros(B, 1, dtype=torch.long, device="cuda")
    start = torch.full((B,), L, dtype=torch.long, device="cuda")
    drafts = torch.zeros(B, 0, dtype=torch.long, device="cuda")
    steps = torch.randint(0, V, (3, B, 1), generator=gen).cuda()

    def fresh_cache():
        cache = model.make_cache(B, S)
        model(prompt, torch.zeros(B, dtype=torch.long, device="cuda"), slots, cache)
        return cache

    def step(cache):
        logits = model.logits(model(tokens, start, slots, cache, kv_len=S))
        return [logits, _triton_greedy.greedy_verify(drafts, logits)]

    feeds = [[t, torch.full((B,), L + i, dtype=torch.long, device="cuda")]
             for i, t in enumerate(steps)]

    def run(graph):
        cache = fresh_cache()
        if graph:
            # The warm-up runs at the last step's position: it writes an entry no earlier
            # replay reads, and the last replay rewrites it.
            tokens.copy_(feeds[-1][0])
            start.copy_(feeds[-1][1])
            return _replayed(lambda: step(cache) + [cache.k], [tokens, start], feeds)
        outs = []
        for t, pos in feeds:
            tokens.copy_(t)
            start.copy_(pos)
            outs.append([o.clone() for o in step(cache)] + [cache.k.clone()])
        return outs

    got = {}
    for pdl in (False, True):
        pdl_switch(pdl)
        for graph in (False, True):
            got[pdl, graph] = run(graph)
    for graph in (False, True):
        off, on = got[False, graph], got[True, graph]
        for r, g in zip(off, on):     # logits and packed tokens of each step
            assert torch.equal(r[0], g[0]) and torch.equal(r[1], g[1]), graph
        assert torch.equal(off[-1][2], on[-1][2]), graph  # the KV cache written
