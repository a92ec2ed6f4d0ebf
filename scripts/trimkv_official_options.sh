#!/usr/bin/env bash
# The trimkv policy's official-cache options (DESIGN.md, "The trimkv policy") against kvbound's default, on
# held-out text: TRIM-KV gates of configs/trimkv/stories260k.yaml (train them first) under the protocol of
# configs/eval/stories260k_reference.yaml (64 windows of BOS + 256 TinyStories validation tokens, decoded token by
# token, scored from position 64) at M = 16/32/64, for three window seeds; h2o and snapkv on the same windows for
# reference. Prints a Markdown table: KL to the full cache, top-1 agreement and NLL, mean ± std over the seeds.
# Usage: scripts/trimkv_official_options.sh BUILD_DIR GATES [THREADS] [SEEDS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:?BUILD_DIR}
gates=${2:?GATES (kvbound export runs/trimkv/stories260k --best --out FILE)}
threads=${3:-2}
seeds=${4:-"0 1 2"}
out=runs/eval/trimkv_official_options
mkdir -p "$out"
run() {  # name policy [--set overrides]
  local name=$1 policy=$2
  shift 2
  for seed in $seeds; do
    [ -f "$out/$name/seed$seed/results.json" ] && continue
    "$build"/kvbound eval configs/eval/stories260k_reference.yaml --set model.threads="$threads" \
      --set eval.policies="[$policy]" --set trimkv.gates="$gates" --set eval.seed="$seed" \
      --set eval.out_dir="$out/$name/seed$seed" "$@" >/dev/null 2>"$out/$name.seed$seed.log"
  done
}
run default trimkv
run offset2_official trimkv --set trimkv.score_offset=2                           # the official cache, buffer_size 1
run official_buffer2 trimkv --set trimkv.score_offset=2 --set trimkv.cut=reaches --set eval.buffer=2
run lookahead4 trimkv --set trimkv.lookahead=4
run lookahead32 trimkv --set trimkv.lookahead=32
run window4 trimkv --set trimkv.sliding_window=4
run window8 trimkv --set trimkv.sliding_window=8
run h2o h2o
run snapkv snapkv
.venv/bin/python - "$out" $seeds <<'PY'
import json, os, statistics, sys
out, seeds = sys.argv[1], sys.argv[2:]
names = ["default", "offset2_official", "official_buffer2", "lookahead4", "lookahead32", "window4", "window8", "h2o", "snapkv"]
budgets = [16, 32, 64]
def cell(values, digits):
    m = statistics.mean(values)
    s = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{m:.{digits}f} ± {s:.{digits}f}"
print(f"{len(seeds)} seeds x 64 windows; mean ± std over seeds")
print("| variant | " + " | ".join(f"M={b} KL | top-1 | NLL" for b in budgets) + " |")
print("|:---|" + "---:|" * (3 * len(budgets)))
for name in names:
    rows = {}
    for seed in seeds:
        with open(os.path.join(out, name, f"seed{seed}", "results.json")) as f:
            for row in json.load(f)["rows"]:
                rows.setdefault(row["budget"], []).append(row["metrics"])
    cells = []
    for b in budgets:
        ms = rows[b]
        cells += [cell([m["kl_to_full"] for m in ms], 4), cell([m["top1_agree"] for m in ms], 3), cell([m["nll"] for m in ms], 4)]
    print(f"| {name} | " + " | ".join(cells) + " |")
PY
