#!/usr/bin/env bash
# One H200 call: the shipped eagle3 head from examples/train-smollm2-eagle3.toml (run 5).
#   bash bench/train_eagle3_h200.sh PROMPTS.jsonl
exec bash "$(dirname "$0")/train_head_h200.sh" "$1" examples/train-smollm2-eagle3.toml eagle3
