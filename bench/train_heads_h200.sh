#!/usr/bin/env bash
# One H200 call (after scripts/device_env.sh made smollm2-135m-instruct resolve): train the
# mtp_eagle head (batched distillation + training), then the eagle3 head on the same
# answers; cards, heads and logs go to $OUT.  bash bench/train_heads_h200.sh PROMPTS
set -u
prompts=$1
run() {  # name config
  local dir=/root/runs/$1
  mkdir -p "$dir"
  [ "$1" = eagle3 ] && cp /root/runs/mtp/sequences.pt /root/runs/mtp/prompts.jsonl "$dir"/
  python3 -m specloop.train._cli --config "$2" --prompts "$prompts" \
    --out "$dir" --device cuda > "$OUT/$1-summary.json" 2> "$dir/stderr.log"
  echo "$1 rc=$?"
  tail -c 3000 "$dir/stderr.log" | grep -v "it/s\]" | tail -12
  cp "$dir"/*.safetensors "$dir"/*.json "$OUT"/ 2>/dev/null
  [ -f "$dir/train-log.jsonl" ] && cp "$dir/train-log.jsonl" "$OUT/$1-train-log.jsonl"
  cat "$OUT/$1-summary.json"
}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
run mtp examples/train-smollm2-eagle-h200.toml
run eagle3 examples/train-smollm2-eagle3.toml
