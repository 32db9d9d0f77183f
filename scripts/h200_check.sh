# The standard H200 battery, for a lent GPU machine (one H200); run from the project root
# after the SmolLM2 parts have travelled (scripts/device_env.sh, docs/performance.md):
#
#   source scripts/device_env.sh; bash scripts/h200_check.sh tests profile steady
#
# Each step writes its rows under $OUT (the device tool brings them back) and prints a
# short summary; steps run in the order given. ~2 min each for tests, profile, busy and
# closed, ~4 min for steady: split them over calls (10 minutes a call at most).
#   tests    the GPU test suite (no SmolLM2 needed)
#   bars     the open issues' speed bars in one table (bench/open_bars.py): batch 1 in two
#            processes (none, n-gram K=4, the 31-node tree; the ab step), then a server's
#            load at BARS_BATCHES (default 1,8,32; none, K=2, K=3, adaptive<=3; the process
#            step; BARS_STEADY_ROUNDS, default 8: requests a run as a multiple of the
#            batch; BARS_CONFIGS to run others, e.g. with "eagle3 K=2 twin", what a
#            rule always drafting K = 2 reads, the bar's noise floor), ~6 min; a second
#            call with BARS_AB=0 BARS_BATCHES=64,128,256 for the rest (then open_bars.py
#            here over both calls' files)
#   profile  eagle3 against no speculation, batch 1 and 32, closed rounds (issue 13)
#   trees    draft trees at batch 1 (issue 13's 1.6x bar): the chain of 3 and the fitted
#            trees of 7, 15 and 31 nodes, adaptive K with the 15-node tree, against no
#            speculation, greedy (TREE_CONFIGS; TREE_TEMPERATURE=0.7 for sampled rows,
#            with "eagle3 K=3 rejection" beside them)
#   serving  the same at batch 32 with graphs for every bucket (the engine's default)
#   busy     GPU busy / wall at batch 1, no speculation, 256 tokens (issue 12)
#   steady   adaptive against none and K = 3 under steady load, batch 1 .. 256 (issue 13;
#            BATCHES, RUNS as for closed; STEADY_CONFIGS replaces "none,K=3,adaptive<=3")
#   curve    the throughput curve, specloop against transformers compiled, batch 1 .. 256
#            (CURVE, HF_CURVE: the batch sizes), and batch 64's table; a PNG (issue 12)
#   process  the engine core in its own process (ProcessEngine) against AsyncEngine and
#            adaptive K over the best fixed config in each (PROCESS_BATCHES, PROCESS_CONFIGS,
#            PROCESS_KINDS, PROCESS_ARRIVAL (closed | steady), RUNS, MIN_ROUNDS, STEADY_ROUNDS
#            (steady: requests a run as a multiple of the batch, default 4; the timed window
#            is STEADY_ROUNDS - 2 batches of finishes; STEADY_QUEUE: requests waiting beyond
#            the batch as a share of it, so the batch stays full, default 0.25, 0 the load
#            before the fifty-fifth session; STEADY_TEXT=on: the requests ask for text, as
#            before the fifty-eighth session, off (default) token ids only, which the
#            client then keeps up with at 256); bench_process_gpu.py;
#            PROCESS_CORE_TIMERS=1: each core's own host time a call and a state, µs an
#            iteration over its timed runs (bench/_host_timers.py CoreTimers: the engine as
#            served, no front door of this process in it; JITFunction._do_compile: Triton
#            compiling during the runs; PROCESS_TIMERS=1 is the in-process engines');
#            PROCESS_CORE_LOG=info: the core's adaptive_k events, every 256 choices, in
#            $OUT/process.log or codeab's logs; REPLICAS=N: N ProcessEngine cores a
#            config, each its own draw of the host's speed, runs spread over them;
#            ONE_ENGINE=1: one engine a config (and replica) for every batch, built for
#            the largest and capped at each (set_max_running): one start a config, not
#            one a batch, so batch 1 .. 256 fits one call)
#   closed   the same in closed rounds (BATCHES, RUNS, MIN_ROUNDS: bench_adaptive_gpu.py's
#            --batches, --runs, --min-rounds; MIN_ROUNDS defaults to 4)
#   host     each iteration's wall and the host's wait for the GPU (HOST_BATCH, HOST_CONFIGS,
#            HOST_SETS, HOST_PROFILE=1: cProfile too; batch 1's three configs ~1.5 min)
#   syncs    batch 1: synchronizing CUDA calls outside the read-back, by engine line
#   kernels  one steady batch-1 iteration's device work in order, by launch (KERNEL_CONFIGS,
#            default "none,eagle3 tree31"; bench/trace_kernels.py on profiler traces):
#            $OUT/kernels_<config>.txt
#   ttft     where a batch-1 request's time to first output goes (bench/probe_ttft_gpu.py:
#            the front door, the prefill's host and device time, the first iteration, the
#            timed calls inside; TTFT_CONFIGS, default "none,ngram K=4,eagle3 tree31";
#            ENVS as for ab, one process each; TTFT_ARGS: more options, e.g.
#            "--spin-us 3000" to keep the core busy before each request): $OUT/ttft_<env>.jsonl
#   skinny, attention  the kernel benches (no SmolLM2 needed)
#   tail     the skinny GEMM's tl.dot tail at 32-256 rows against cuBLAS (no SmolLM2 needed)
#   pagesync PageTable.sync's host time a call, the staging ring against the earlier syncs,
#            and a small input's copy through the ring against to_device (no SmolLM2 needed)
#   hostops  the host time of single torch / CUDA calls an iteration is made of (no SmolLM2)
#   treeverify  a draft tree's VERIFY (4-31 nodes) against the chain's and plain decoding's
#            forward at batch 1, each captured: device time a step, and each step's critical
#            path over TREE_KERNELS (50) profiled replays (bench_tree_verify_gpu.py)
#   treeattn paged attention at VERIFY's rows (4-32 tokens): a tree's visibility words
#            and BLOCK_M 16 / 32 against the chain's mask, split-KV with --split-mins
#            (bench_tree_attention_gpu.py; no SmolLM2; TREEATTN_ARGS: more options)
#   topk     a draft tree's top-k calls a tree (bench_topk_gpu.py; TOPK_AGAINST: an older
#            models/_kernels.py to time against; no SmolLM2)
#   adp      ADP: 1 then 2 ranks (torch.distributed.run --standalone) of bench/adp_run.py,
#            128 equal greedy requests of 256 tokens, batch 64 a rank, 3 rounds of one
#            generate_batch and 3 of a task per request, the exchange through shared
#            memory; bench/adp_trace.py's summary and the 1-rank/2-rank output check. On
#            nvidia-h200-x2 the ratio is ADP's scaling; on one H200 both ranks share the
#            GPU and only the exchange's cost means something (ADP_ROUNDS, ADP_METHOD;
#            ADP_MODEL_ARGS, ADP_TOKENS, ADP_REQUESTS, ADP_BATCH for a smoke run, e.g.
#            ADP_MODEL_ARGS=--tiny on the CPU)
#   adpproc  ADP served from one process: bench/adp_process.py, a ProcessEngine of 1 then
#            2 ranks (it spawns the cores; no torchrun), the adp step's workload, the
#            consumers in the calling process; the ratio and the output check (ADP_WORLDS,
#            and the adp step's variables)
#   probe    Triton kernels compiled after warm-up, eagle3 and n-gram under adaptive K
#            through every move of K with ragged prompts, and eagle3 through K = 0
#            stretches (a tiny model: no SmolLM2 needed; eagle3 crashed on 2026-12-02
#            until the argmax fix, docs/performance-history.md, "Leaving a K = 0 stretch")
#   pdl      what Programmatic Dependent Launch would give 30 layers of decode GEMMs
#   greedy   the all-greedy VERIFY epilogue: torch against the Triton kernels
#   tables   the skinny tables in $TABLES (space-separated skinny_table.json files; "code"
#            is the shipped one) taking turns $ROUNDS times (default 2), none / n-gram K=4 / eagle3 K=3 at
#            batch 1 and 32, one process each (the fifth session's A/B, as one step);
#            CONFIGS and BATCHES (profile_spec_gpu.py's --configs, --batches) replace those
#   tabletests  the GPU tests that read the skinny table (tests/models/test_skinny.py and
#            test_pdl.py -m gpu: a row's bits within the prefix, the tail's against
#            F.linear, the chained step under PDL) with each table file in $TABLES: run it
#            before shipping a table the tables step liked
#   codeab   the code in $OLD (a folder laid out as this repository, e.g. made here by
#            `mkdir -p .dev/old && git archive <commit> engine models samplers graphs comm |
#            tar -x -C .dev/old`, or only the files that changed since, carried) against
#            this tree's, one process each, taking
#            turns $ROUNDS times (default 2): profile_spec_gpu.py's CONFIGS (default none /
#            n-gram adaptive<=4 on warm-up's times / learned) at BATCHES (default 1) --
#            the same machine for both, whose host speed differs between machines;
#            CODEAB_BENCH=process: bench_process_gpu.py instead, PROCESS_* as for process
#            (defaults: batch 64, ProcessEngine, steady load, none / eagle3 K=2 / adaptive);
#            CODEAB_BENCH=steady: the steady step's runs (BATCHES default 64,128,256, RUNS,
#            STEADY_CONFIGS);
#            CODEAB_BENCH=adp: the adp step's 1- and 2-rank runs (ADP_*; nvidia-h200-x2),
#            each rank's tok/s, AL and chained steps queued / taken
#   pin      CPU placement: the same runs unpinned and pinned to $CPUS (taskset), in turns
#   layer    the layer bench alone (bench_skinny_gemm.py --layer-only: + norms, + glu)
#   ab       eagle3 K=3 against none at batch 1 and 32 with each kernel switch turned off
#            in turn (default, SPECLOOP_PDL=0, SPECLOOP_SKINNY=0,
#            SPECLOOP_ATTENTION_MAX_SPLITS=1, SPECLOOP_SKINNY_NORM=0: the norm prologue,
#            which the shipped table runs for qkv and gate-up at 1 row), one process each;
#            ENVS (e.g. "DEFAULT=1 SPECLOOP_SKINNY_GLU=0"), CONFIGS, BATCHES, ROUNDS replace them
# PROMPTS: the held-out prompts file (default bench/prompts_heldout.jsonl, shipped: the eval
# split of build_prompts(5000, 400, 0), bench/held_out_prompts.py). profile and
# tables run 16 distinct prompts a run at batch 1 (--min-prompts 16; the figures up to the
# fifth session, 2026-12-01, ran batch 1 on the first held-out prompt alone, whose
# acceptance is not the head's average: eagle3 K=3 AL 2.229 there, 1.946 on 32 prompts).
set -u
# Every step imports the project from /tmp/site, which device_env.sh's exports put on the
# path; `source scripts/device_env.sh | tail -1` runs it in a subshell and loses them (every
# step then failed behind its own output filter, 2026-12-01): say so once, here.
if ! python3 -c "import specloop.engine" 2>/dev/null; then
  echo "h200_check: specloop does not import; run 'source scripts/device_env.sh' first (not piped: its exports are needed)"
  exit 1
fi
OUT=$(realpath -m "${OUT:-/tmp/h200_out}")   # absolute: the bench steps cd bench
PROMPTS=$(realpath "${PROMPTS:-bench/prompts_heldout.jsonl}")
mkdir -p "$OUT"

# Select skinny table $1 for this (sub)shell: "code" is the shipped one, also where
# SPECLOOP_SKINNY_TABLE is exported (the skinny step's /root/skinny_table.json); else a file,
# and a missing one is said and fails (the steps' greps would hide Python's error).
use_table() {
  if [ "$1" = code ]; then unset SPECLOOP_SKINNY_TABLE; return 0; fi
  if [ ! -f "$1" ]; then echo "no such table file: $1"; return 1; fi
  export SPECLOOP_SKINNY_TABLE=$(realpath "$1")
}
# The steady step's runs into $1 (BATCHES defaulting to $2, RUNS, STEADY_CONFIGS), the
# project from $PYTHONPATH as set (codeab's old tree, or the installed one).
steady_runs() {
  (cd bench && python3 bench_adaptive_gpu.py --prompts "$PROMPTS" \
    --out "$1" --runs "${RUNS:-3}" --buckets serving --arrival steady \
    --batches "${BATCHES:-$2}" \
    --configs "${STEADY_CONFIGS:-none,K=3,adaptive<=3}" 2>&1 | grep "max(")
}
# The adp step's runs: 1 then 2 ranks under torchrun into folder $1 (o1.json, w1.log, ...),
# the project from $PYTHONPATH as set (codeab's old tree, or the installed one).
adp_runs() {
  local d=$1 w
  mkdir -p "$d"
  for w in 1 2; do
    # shellcheck disable=SC2086  # ADP_MODEL_ARGS: several arguments
    python3 -m torch.distributed.run --standalone --nproc-per-node $w bench/adp_run.py \
      ${ADP_MODEL_ARGS:---model smollm2-135m-instruct --dtype bfloat16 --graphs} \
      --balanced-tokens "${ADP_TOKENS:-256}" --requests "${ADP_REQUESTS:-128}" \
      --batch "${ADP_BATCH:-64}" --buckets "${ADP_BATCH:-64}" --rounds "${ADP_ROUNDS:-3}" \
      --method "${ADP_METHOD:-none}" --consumer batch,stream --shared-memory-exchange \
      --trace-out "$d" --out "$d/o$w.json" > "$d/w$w.log" 2>&1 || tail -20 "$d/w$w.log"
  done
}
for step in "$@"; do
  echo "== $step $(date -u +%H:%M:%S)"
  case $step in
    tests)
      # In $TEST_WORKERS pytest-xdist workers (default 8) where xdist imports (the device
      # image has it; scripts/device_carry.sh carries the .venv's): a bare machine compiles
      # every Triton kernel the suite launches, CPU work that the workers share out; the
      # GPU has room for all of them.
      par=""
      if python3 -c "import xdist" 2>/dev/null; then par="-n ${TEST_WORKERS:-8} --dist loadgroup"; fi
      # The whole log in $OUT/tests.log: a later step's output can push the summary out of
      # the call's output tail (fiftieth session).
      python3 -m pytest -q -m gpu tests -p no:cacheprovider -p no:benchmark --tb=short $par 2>&1 \
        | grep -v CUDAGraph.cpp | tee "$OUT/tests.log" | tail -15 ;;
    profile)
      (cd bench && python3 profile_spec_gpu.py --prompts "$PROMPTS" --out "$OUT/spec.jsonl" \
        --configs "none,eagle3 K=3,eagle3 K=5" --batches 1,32 --runs 3 --min-prompts 16 2>&1 \
        | grep '^{' | cut -c1-160) ;;
    trees)
      configs="none,eagle3 K=3,eagle3 tree7,eagle3 tree15,eagle3 tree31,eagle3 adaptive<=3 tree15"
      if [ -n "${TREE_TEMPERATURE:-}" ]; then configs="$configs,eagle3 K=3 rejection"; fi
      (cd bench && python3 profile_spec_gpu.py --prompts "$PROMPTS" \
        --out "$OUT/trees_b1.jsonl" --configs "${TREE_CONFIGS:-$configs}" --batches 1 \
        --runs 3 --min-prompts 16 --temperature "${TREE_TEMPERATURE:-0}" 2>&1 \
        | grep '^{\|^gpu:' | cut -c1-200) ;;
    serving)
      (cd bench && python3 profile_spec_gpu.py --prompts "$PROMPTS" \
        --out "$OUT/spec_serving.jsonl" --configs "none,eagle3 K=3" --batches 32 --runs 3 \
        --buckets serving 2>&1 | grep '^{' | cut -c1-160) ;;
    busy)
      (cd bench && python3 bench_gpu_e2e.py --out "$OUT/e2e_b1.json" --runs 3 --tokens 256 \
        --batches 1 --methods none --skip-hf --curve "" --hf-curve "" --profile-batches 1 \
        2>&1 | grep -i "busy\|tok/s" | cut -c1-200 | tail -6) ;;
    steady)
      steady_runs "$OUT/adaptive_steady.jsonl" 1,8,32,64,128,256 ;;
    curve)
      # Tokens/s over batch 1 ... 256 (CURVE), specloop (a generate task per request, one
      # run a batch) against transformers compiled (HF_CURVE), after the batch-64 table
      # (3 runs, both consumers, transformers beside it); the PNG beside the rows.
      (cd bench && python3 bench_gpu_e2e.py --out "$OUT/curve.json" --runs 3 --tokens 256 \
        --batches 64 --hf-batches 64 --methods none --profile-batches "" \
        --curve "${CURVE:-1,2,4,8,16,32,64,128,256}" --hf-curve "${HF_CURVE:-1,8,64,256}" \
        --process-curve "${PROCESS_CURVE:-1,8,32,64,128,256}" \
        2>&1 | grep '^{' | cut -c1-300
       python3 plot_curve.py "$OUT/curve.json" "$OUT/throughput_h200.png") ;;
    host)
      # Host- or GPU-bound: the host's wait for the GPU per iteration at HOST_BATCH (1) for
      # HOST_CONFIGS (none, n-gram K = 4, n-gram adaptive by match length; each engine
      # alone in turn); HOST_PROFILE=1 then each again under cProfile (the JSON has them).
      (cd bench && python3 host_wait_gpu.py --prompts "$PROMPTS" --sets "${HOST_SETS:-16}" \
        --batch "${HOST_BATCH:-1}" \
        --configs "${HOST_CONFIGS:-none,ngram K=4,ngram adaptive<=4}" \
        $([ "${HOST_PROFILE:-0}" = 1 ] && echo --profile) \
        --out "$OUT/host_wait.json" 2>&1 | grep '^{') ;;
    syncs)
      # Synchronizing CUDA calls outside the read-back, by engine line (n-gram K = 4 and
      # adaptive on warm-up's times, batch 1, 4 held-out prompts x 64 tokens).
      (cd bench && python3 sync_points_gpu.py --prompts "$PROMPTS" --out "$OUT/syncs.json" \
        2>&1 | grep '^{' | cut -c1-900) ;;
    bars)
      if [ "${BARS_AB:-1}" = 1 ]; then
        OUT=$OUT ENVS="DEFAULT=1 DEFAULT=2" CONFIGS="none,ngram K=4,eagle3 tree31" BATCHES=1 \
          ROUNDS=1 bash "$0" ab
      fi
      # Windows of 8 batches of requests a run (6 timed): at 4 a run at batch 32 timed
      # ~0.2 s on an H100, and one pause moved a run by a quarter (fifty-first session).
      OUT=$OUT PROCESS_ARRIVAL=steady PROCESS_BATCHES="${BARS_BATCHES:-1,8,32}" RUNS=3 \
        STEADY_ROUNDS="${BARS_STEADY_ROUNDS:-8}" \
        PROCESS_CONFIGS="${BARS_CONFIGS:-none,eagle3 K=2,eagle3 K=3,eagle3 adaptive<=3}" \
        bash "$0" process
      python3 bench/open_bars.py $(ls "$OUT"/ab_DEFAULT_[12]_1.jsonl 2>/dev/null) "$OUT/process.jsonl" ;;
    process)
      (cd bench && python3 bench_process_gpu.py --prompts "$PROMPTS" --out "$OUT/process.jsonl" \
        --runs "${RUNS:-3}" --buckets serving --min-prompts 32 --min-rounds "${MIN_ROUNDS:-4}" \
        --batches "${PROCESS_BATCHES:-1,8,32,64,128,256}" --kinds "${PROCESS_KINDS:-process}" \
        --arrival "${PROCESS_ARRIVAL:-closed}" --steady-rounds "${STEADY_ROUNDS:-4}" --steady-queue "${STEADY_QUEUE:-0.25}" --steady-text "${STEADY_TEXT:-off}" --core-log-level "${PROCESS_CORE_LOG:-warning}" \
        --replicas "${REPLICAS:-1}" $([ "${ONE_ENGINE:-0}" = 1 ] && echo --one-engine) \
        $([ "${PROCESS_TIMERS:-0}" = 1 ] && echo --timers) \
        $([ "${PROCESS_CORE_TIMERS:-0}" = 1 ] && echo --core-timers) \
        --configs "${PROCESS_CONFIGS:-none,eagle3 K=1,eagle3 K=2,eagle3 K=3,eagle3 adaptive<=3}" \
        2>&1 | grep -v Warn | tee "$OUT/process.log" | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        print(line.rstrip()); continue
    print(r["batch"], r["kind"], r["config"], r["median"], "vs none", r["vs_none"], "AL", r["al"],
          "vs in-process", r["vs_in_process"], "ms/it", r["iteration_ms"],
          "median", r.get("iteration_ms_median"), "host", r["host_python_us"],
          "overlapped", r.get("overlapped"), "vs mix", r.get("vs_mix"),
          "mix vs best", r.get("mix_vs_best"),
          "replicas", r.get("replica_medians"),
          "rows", r.get("rows_runs"),
          "K", r["iterations_per_k"])
    for extra in ("states_us", "timers_us", "core_states_us", "core_timers_us", "core_moves_us"):
        if r.get(extra):
            print("   ", extra, r[extra])') ;;
    closed)
      # MIN_ROUNDS (4): rounds a run at least (batch 32-64: one round of ~0.1-0.2 s a run
      # spread the runs by +-8 % until 2026-12-02; MIN_ROUNDS=1 is the runs before).
      (cd bench && python3 bench_adaptive_gpu.py --prompts "$PROMPTS" \
        --out "$OUT/adaptive_closed.jsonl" --runs "${RUNS:-3}" --buckets serving --min-prompts 16 \
        --min-rounds "${MIN_ROUNDS:-4}" --batches "${BATCHES:-1,8,32,64,128,256}" \
        --configs "none,K=3,adaptive<=3" 2>&1 | grep "max(") ;;
    hostops)
      (cd bench && python3 bench_host_ops_gpu.py --calls 2000 --rounds 3 2>&1 | grep -v Warn) ;;
    treeverify)
      # A draft tree's VERIFY against the chain's at batch 1, captured (the premise of
      # tree drafting on the GPU; SmolLM2 needed).
      python3 bench/bench_tree_verify_gpu.py --rounds 5 --replays 200 --trees 4,7,15,23,31 \
        --kernels "${TREE_KERNELS:-50}" \
        --out "$OUT/tree_verify.json" 2>&1 | grep -v Warn ;;
    treeattn)
      # Paged attention at VERIFY's rows: a tree's visibility words and BLOCK_M 16 / 32
      # against the chain's causal mask (no SmolLM2 needed).
      # TREEATTN_ARGS: more of its options (e.g. --split-mins 64,128 --context 200,320).
      python3 bench/bench_tree_attention_gpu.py --out "$OUT/tree_attention.json" \
        ${TREEATTN_ARGS:-} 2>&1 | grep -v Warn ;;
    topk)
      # A draft tree's top-k calls a tree, this tree's kernel against $TOPK_AGAINST (a copy
      # of an older models/_kernels.py, carried) when set (no SmolLM2 needed).
      python3 bench/bench_topk_gpu.py --out "$OUT/topk.json" \
        ${TOPK_AGAINST:+--against "$TOPK_AGAINST"} 2>&1 | grep -v Warn ;;
    pagesync)
      (cd bench && python3 bench_page_sync_gpu.py --calls 2000 --rounds 3 2>&1 | grep -v Warn) ;;
    tail)
      # The skinny GEMM's tl.dot tail above 32 rows against cuBLAS: times and bits (~20 s).
      (cd bench && python3 bench_skinny_tail.py 2>&1 | grep -v Warn) ;;
    skinny)
      # Also keeps the measured table where later calls on this machine find it:
      # SPECLOOP_SKINNY_TABLE=/root/skinny_table.json (models/_linear.py).
      python3 bench/bench_skinny_gemm.py 2>&1 | tail -45
      cp "$OUT/skinny_table.json" /root/skinny_table.json ;;
    pdl)
      python3 bench/bench_pdl.py 2>&1 | tail -4 ;;
    probe)
      for run in "eagle3 every" "ngram every" "eagle3 stretches"; do
        set -- $run
        echo "-- $1, $2"
        timeout 200 python3 bench/probe_compiles_gpu.py "$1" --pattern "$2" \
          > "$OUT/probe_$1_$2.txt" 2>&1
        echo "rc $?"; grep -v "^20..-\|^frame\|Assertion" "$OUT/probe_$1_$2.txt" | tail -12 | cut -c1-300
      done ;;
    greedy)
      python3 bench/bench_greedy_verify_gpu.py 2>&1 | tail -12 ;;
    attention)
      python3 bench/bench_paged_attention.py --tiles '' 2>&1 | grep -i "auto picked\|warn" ;;
    tables)
      # ~1.5-2 min a table and round (3 configs x batch 1 and 32): two tables, two rounds
      # fit one 10-minute call; more tables: ROUNDS=1 or split them over calls.
      for round in $(seq 1 "${ROUNDS:-2}"); do
        i=0
        for t in ${TABLES:-code}; do
          i=$((i + 1))
          echo "-- table $t (round $round)"
          (use_table "$t" || exit
           cd bench && python3 profile_spec_gpu.py --prompts "$PROMPTS" \
             --out "$OUT/tables_${i}_$(basename "$t" .json)_$round.jsonl" \
             --configs "${CONFIGS:-none,ngram K=4,eagle3 K=3}" --batches "${BATCHES:-1,32}" \
             --runs 3 --min-prompts 16 \
             > "$OUT/tables_${i}_$round.log" 2>&1; rc=$?
           grep '^{\|^gpu:' "$OUT/tables_${i}_$round.log" | cut -c1-150
           # A failed run says why (the rows' grep alone would hide Python's traceback).
           [ $rc -eq 0 ] || tail -6 "$OUT/tables_${i}_$round.log")
        done
      done ;;
    tabletests)
      for t in ${TABLES:-code}; do
        echo "-- table $t"
        (use_table "$t" || exit
         python3 -m pytest -q -m gpu tests/models/test_skinny.py tests/models/test_pdl.py \
           -p no:cacheprovider \
           --tb=short 2>&1 | grep -v CUDAGraph.cpp | tail -8)
      done ;;
    ab)
      # SPECLOOP_SKINNY_NORM=0: the shipped table fuses qkv's and gate-up's norms at 1 row.
      # ENVS, CONFIGS, BATCHES and ROUNDS (default 1) replace the defaults; an ENVS entry
      # A=1+B=2 sets both in one process.
      envs=${ENVS:-"DEFAULT=1 SPECLOOP_PDL=0 SPECLOOP_SKINNY=0 SPECLOOP_ATTENTION_MAX_SPLITS=1 SPECLOOP_SKINNY_NORM=0"}
      for round in $(seq 1 "${ROUNDS:-1}"); do
        for env in $envs; do
          echo "-- $env (round $round)"
          (IFS=+ read -ra _vars <<< "$env"; export "${_vars[@]}"; cd bench && python3 profile_spec_gpu.py --prompts "$PROMPTS" \
            --out "$OUT/ab_${env//[^A-Za-z0-9_]/_}_$round.jsonl" --configs "${CONFIGS:-none,eagle3 K=3}" \
            --batches "${BATCHES:-1,32}" --runs 3 --min-prompts 16 2>&1 | grep '^{' | python3 -c '
import json, sys
for line in sys.stdin:   # a row: the ratio, its wall and GPU an iteration, where a request goes
    r = json.loads(line)
    print(r["batch"], r["config"], r["tok_s"], "vs none", r["vs_none"], "AL", r["al"],
          "wall/GPU ms", r.get("iteration_ms"), r.get("gpu_union_ms_per_iter"),
          "ttft/output/end ms", r.get("ttft_ms"), r.get("ms_per_output"), r.get("end_ms"))')
        done
      done ;;
    ttft)
      for env in ${ENVS:-DEFAULT=1}; do
        echo "-- $env"
        (IFS=+ read -ra _vars <<< "$env"; export "${_vars[@]}"; cd bench && python3 probe_ttft_gpu.py --prompts "$PROMPTS" \
          --out "$OUT/ttft_${env//[^A-Za-z0-9_]/_}.jsonl" --configs "${TTFT_CONFIGS:-none,ngram K=4,eagle3 tree31}" \
          --runs 2 ${TTFT_ARGS:-} 2>&1 | grep '^{' | python3 -c '
import json, sys
for line in sys.stdin:   # a row: the parts of a ttft (us, medians), the timed calls
    r = json.loads(line)
    print(r["config"], {k: r[k] for k in ("door", "hop_in", "target", "drafter", "hop_out",
                                          "first_iter", "ttft", "target_gpu", "drafter_gpu")})
    print("   states", r["states"], "calls", r["calls"])
    print("   prefill graph us", r.get("prefill_graph", {}).get("replay_us"))')
      done ;;
    kernels)
      rm -rf /tmp/kernel_traces && mkdir -p /tmp/kernel_traces
      (cd bench && python3 profile_spec_gpu.py --prompts "$PROMPTS" --out /tmp/kernel_traces/rows.jsonl \
        --configs "${KERNEL_CONFIGS:-none,eagle3 tree31}" --batches 1 --runs 1 --min-prompts 16 \
        --trace-dir /tmp/kernel_traces 2>&1 | grep '^{' | cut -c1-150)
      for t in /tmp/kernel_traces/trace_b1_*.json; do
        n=$(basename "$t" .json); n=${n#trace_b1_}
        python3 bench/trace_kernels.py "$t" --top 20 --out "$OUT/kernels_$n.txt" | tail -24
      done ;;
    layer)
      # A SmolLM2 layer without attention (30 layers' weights, CUDA graphs) through the
      # dispatcher at 1, 4, 5 and 8 rows: cuBLAS, the code's table, + norms, + glu.
      (cd bench && python3 bench_skinny_gemm.py --layer-only 2>&1 | grep "layer\|wrote") ;;
    codeab)
      # The installed package (/tmp/site/specloop) with each file $OLD holds in place of
      # its own (whole package folders, or only the files that changed: a file $OLD lacks
      # stays this tree's); the files that differ are listed, so an A/B of a tree against
      # itself shows.
      if [ ! -d "${OLD:-}/engine" ]; then
        echo "codeab: set OLD to a folder laid out as this repository (no ${OLD:-<unset>}/engine)"
        continue
      fi
      old=$(realpath "$OLD")
      rm -rf /tmp/old && mkdir -p /tmp/old && cp -r /tmp/site/specloop /tmp/old/specloop
      for pkg in engine samplers graphs comm models serve train; do
        if [ -d "$old/$pkg" ]; then
          cp -r "$old/$pkg/." "/tmp/old/specloop/$pkg/"
        fi
      done
      echo "codeab: files that differ:"
      diff -rq -x __pycache__ /tmp/site/specloop /tmp/old/specloop | grep -v "^Only in /tmp/site" | head -20
      for round in $(seq 1 "${ROUNDS:-2}"); do
        for v in old new; do
          path=/tmp/site:/root/smolpkg; [ $v = old ] && path=/tmp/old:$path
          echo "-- $v (round $round)"
          if [ "${CODEAB_BENCH:-profile}" = adp ]; then
            # The adp step's runs (ADP_* settings; run on nvidia-h200-x2), traces dropped
            # (the device tool brings 8 files back): each rank's rates, AL, chained steps.
            PYTHONPATH=$path adp_runs "$OUT/adp_${v}_$round"
            rm -f "$OUT/adp_${v}_$round"/trace_*.json
            grep -h "tok/s per round\|acceptance length" "$OUT/adp_${v}_$round"/w*.log
            continue
          fi
          if [ "${CODEAB_BENCH:-profile}" = steady ]; then
            # The steady step's runs (BATCHES, RUNS, STEADY_CONFIGS as there)
            PYTHONPATH=$path steady_runs "$OUT/codeab_${v}_$round.jsonl" 64,128,256
            continue
          fi
          if [ "${CODEAB_BENCH:-profile}" = process ]; then
            # bench_process_gpu.py as the process step runs it (PROCESS_* settings)
            (cd bench && PYTHONPATH=$path python3 bench_process_gpu.py --prompts "$PROMPTS" \
               --out "$OUT/codeab_${v}_$round.jsonl" --runs "${RUNS:-3}" --buckets serving \
               --min-prompts 32 --min-rounds "${MIN_ROUNDS:-4}" \
               --batches "${PROCESS_BATCHES:-64}" --kinds "${PROCESS_KINDS:-process}" \
               --arrival "${PROCESS_ARRIVAL:-steady}" --steady-rounds "${STEADY_ROUNDS:-4}" --core-log-level "${PROCESS_CORE_LOG:-warning}" \
               --replicas "${REPLICAS:-1}" \
               $([ "${PROCESS_TIMERS:-0}" = 1 ] && echo --timers) \
               $([ "${PROCESS_CORE_TIMERS:-0}" = 1 ] && echo --core-timers) \
               --configs "${PROCESS_CONFIGS:-none,eagle3 K=2,eagle3 adaptive<=3}" \
               > "$OUT/codeab_${v}_$round.log" 2>&1 || tail -6 "$OUT/codeab_${v}_$round.log"
             grep '^{' "$OUT/codeab_${v}_$round.log" | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r["batch"], r["kind"], r["config"], r["median"], "vs none", r["vs_none"], "AL", r["al"],
          "ms/it", r["iteration_ms"], "overlapped", r.get("overlapped"), "vs mix", r.get("vs_mix"),
          "replicas", r.get("replica_medians"),
          "K", r["iterations_per_k"])
    for extra in ("timers_us", "core_timers_us"):  # PROCESS_TIMERS=1, PROCESS_CORE_TIMERS=1:
        if r.get(extra):                         # µs an iteration, calls of 5 µs or more
            print("   ", extra, {k: v for k, v in r[extra].items() if v >= 5})
    for extra in ("core_states_us", "core_moves_us"):
        if r.get(extra):
            print("   ", extra, r[extra])')
            continue
          fi
          (cd bench && PYTHONPATH=$path python3 profile_spec_gpu.py --prompts "$PROMPTS" \
             --out "$OUT/codeab_${v}_$round.jsonl" --batches "${BATCHES:-1}" --runs 3 \
             --configs "${CONFIGS:-none,ngram adaptive<=4 warm-up times,ngram adaptive<=4}" \
             --min-prompts 16 > "$OUT/codeab_${v}_$round.log" 2>&1 || tail -6 "$OUT/codeab_${v}_$round.log"
           grep '^{' "$OUT/codeab_${v}_$round.log" | cut -c1-150)
        done
      done ;;
    pin)
      # CPU placement: profile_spec_gpu.py's CONFIGS (default none / eagle3 K = 3) at
      # BATCHES (default 1), one process unpinned and one pinned (taskset -c $CPUS, default
      # 2-5: away from CPU 0's interrupts), taking turns $ROUNDS times (default 2) -- host
      # speed differed up to 1.9x between processes on one machine (2026-12-02).
      nvidia-smi topo -m 2>&1 | head -4; lscpu | grep -i "^numa\|^model name\|^socket\|^thread"
      for round in $(seq 1 "${ROUNDS:-2}"); do
        for v in free pinned; do
          pre=""; [ $v = pinned ] && pre="taskset -c ${CPUS:-2-5}"
          echo "-- $v (round $round)"
          (cd bench && $pre python3 profile_spec_gpu.py --prompts "$PROMPTS" \
             --out "$OUT/pin_${v}_$round.jsonl" --batches "${BATCHES:-1}" --runs 3 \
             --configs "${CONFIGS:-none,eagle3 K=3}" --min-prompts 16 \
             > "$OUT/pin_${v}_$round.log" 2>&1 || tail -6 "$OUT/pin_${v}_$round.log"
           grep '^{' "$OUT/pin_${v}_$round.log" | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    host = [m.get("host") for m in (r.get("by_move_states_us") or {}).values()]
    print(r["batch"], r["config"], r["tok_s"], r["vs_none"], r["iteration_ms"], "host_us", host)')
        done
      done ;;
    adp)
      d="$OUT/adp"; adp_runs "$d"
      python3 bench/adp_trace.py "$d" | tee "$OUT/adp_summary.txt"
      python3 bench/adp_run.py --compare "$d/o1.json" "$d/o2.json" ;;
    adpproc)
      # ADP served from one process: ProcessEngine spawns the ranks (no torchrun), the
      # consumers run here; 1 rank, then ADP_WORLDS' others, outputs compared.
      # shellcheck disable=SC2086  # ADP_MODEL_ARGS: several arguments
      python3 bench/adp_process.py \
        ${ADP_MODEL_ARGS:---model smollm2-135m-instruct --dtype bfloat16 --graphs} \
        --balanced-tokens "${ADP_TOKENS:-256}" --requests "${ADP_REQUESTS:-128}" \
        --batch "${ADP_BATCH:-64}" --buckets "${ADP_BATCH:-64}" --rounds "${ADP_ROUNDS:-3}" \
        --method "${ADP_METHOD:-none}" --worlds "${ADP_WORLDS:-1,2}" --consumer stream,batch \
        --out "$OUT/adp_process.json" 2>&1 | tee "$OUT/adp_process.txt" ;;
    *) echo "unknown step: $step" ;;
  esac
done
