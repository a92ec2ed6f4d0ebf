#!/usr/bin/env bash
# Distillation text for the default model: every prompt of configs/data/distill_prompts.txt (60 openings of
# letters, stories, essays, dialogues; none from the held-out evaluation text, Pride and Prejudice) continued
# SAMPLES times by SmolLM2-135M-Instruct itself at temperature 1, MAX_NEW tokens each, then tokenised into an
# HDF5 token dataset beside it. The TRIM-KV / IndexMem losses compare the model with itself, so text in the
# model's own distribution is as valid a training signal as any book, and there is as much of it as time allows.
# Usage: scripts/smollm2_distill_data.sh BUILD_DIR [SAMPLES=16] [MAX_NEW=512] [THREADS=all] [PROMPTS=60]
#   -> runs/data/smollm2_distill/samples.jsonl and samples.h5 (train with data.train_text=.../samples.h5)
# PROMPTS takes the file's first PROMPTS openings: SAMPLES is the batch, so few prompts x many samples is the
# fast way to a given number of tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
samples=${2:-16}
max_new=${3:-512}
threads=${4:-0}
prompts=${5:-60}
out=runs/data/smollm2_distill
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$out"
head -n "$prompts" configs/data/distill_prompts.txt > "$out/prompts.txt"
"$build"/kvbound generate --model "$model" --prompts "$out/prompts.txt" --samples "$samples" \
  --temperature 1 --max-new-tokens "$max_new" --threads "$threads" --seed 0 --out "$out/samples.jsonl"
"$build"/kvbound prepare --tokenizer "$model" --output "$out/samples.h5" --add-eos --force "$out/samples.jsonl"
