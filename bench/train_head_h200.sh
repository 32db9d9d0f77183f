#!/usr/bin/env bash
# One H200 call (after scripts/device_env.sh made smollm2-135m-instruct resolve): train a
# head from a recipe (batched distillation, training, held-out evaluation); head, card,
# train log and distill.json go to $OUT.
#   bash bench/train_head_h200.sh PROMPTS.jsonl CONFIG RUN
# e.g. the shipped mtp_eagle head: bash bench/train_head_h200.sh prompts.jsonl
#      examples/train-smollm2-eagle-h200.toml mtp  (bench/train_eagle3_h200.sh: eagle3)
set -u
dir=/root/runs/$3
mkdir -p "$dir"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
date -u +%T
python3 -m specloop.train._cli --config "$2" --prompts "$1" \
  --out "$dir" --device cuda > "$OUT/summary.json" 2> "$dir/stderr.log"
echo "rc=$? $(date -u +%T)"
tail -c 4000 "$dir/stderr.log" | grep -v "it/s\]" | tail -16
cp "$dir"/*.safetensors "$dir"/smollm2-*.json "$dir"/train-log.jsonl "$dir"/distill.json "$OUT"/ 2>/dev/null
cat "$OUT/summary.json"
