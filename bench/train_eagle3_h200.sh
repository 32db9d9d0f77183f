#!/usr/bin/env bash
# One H200 call (after scripts/device_env.sh made smollm2-135m-instruct resolve): the
# shipped eagle3 head from examples/train-smollm2-eagle3.toml (batched distillation,
# training, held-out evaluation with n-gram beside it); head, card and logs go to $OUT.
#   bash bench/train_eagle3_h200.sh PROMPTS.jsonl
set -u
dir=/root/runs/eagle3
mkdir -p "$dir"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
date -u +%T
python3 -m specloop.train._cli --config examples/train-smollm2-eagle3.toml --prompts "$1" \
  --out "$dir" --device cuda > "$OUT/summary.json" 2> "$dir/stderr.log"
echo "rc=$? $(date -u +%T)"
tail -c 4000 "$dir/stderr.log" | grep -v "it/s\]" | tail -16
cp "$dir"/*.safetensors "$dir"/smollm2-*.json "$dir"/train-log.jsonl "$dir"/distill.json "$OUT"/ 2>/dev/null
cat "$OUT/summary.json"
