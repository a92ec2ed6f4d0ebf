#!/usr/bin/env bash
# The GPU check: one call on the GPU machine (README "GPU" says what its image holds and lacks). It
# builds kvbound there against the image's PyTorch (CUDA 13) with the features the image lacks turned off
# (ICU, cairo, protobuf, gloo headers: CMakeLists.txt KVBOUND_WITH_*), runs every CUDA test
# (kvbound_device_tests: each kernel against its reference, and the CLI on stories260K on CUDA against the CPU in
# float32 and bfloat16), then the ops benchmark beside its peers measured in the same run (FlexAttention with the
# same score_mod, and the naive formula), decode at 32K context on a random-weight model with Llama-3.2-1B's shapes
# (full vs trimkv and h2o at M = 1024), training updates there against their peers (TRIM-KV: the official package's;
# IndexMem stage 1: bench/peers/indexmem_step.py), and prints a summary table last.
#
# Usage: scripts/gpu_check.sh OUT_DIR [T ...]
#   through the device tool:  run(command="scripts/gpu_check.sh \"$OUT\"", carry=[".whl"], timeout_s=570)
#   (.whl/ from scripts/gpu_wheels.sh: the official TRIM-KV package for the training peer)
# GPU_CHECK_MODE=diagnose runs, after the same build, what says why a kernel is wrong or slow instead of the tests
# and benchmarks: compute-sanitizer's memcheck and racecheck (out-of-bounds accesses, shared-memory races of the
# cp.async tile pipelines) over the kernel tests, and Nsight Compute (ncu, clocks left alone) on one launch of each
# retention_attention kernel at T = 8192 and of each pooled kernel at T = 4096 (memcheck.txt, racecheck.txt,
# ncu_*.txt). Sanitizer errors make the exit status 1.
# OUT_DIR receives gpu_check.log (everything), device_tests.xml, ops.jsonl (kernel and naive), ops_flex.jsonl
# (FlexAttention), decode.jsonl, train.jsonl and summary.md. The whole check keeps inside GPU_CHECK_SECONDS
# (default 540, under the device call's 570 s): each stage after the build runs under `timeout` with its own cap,
# cut to what is left, so a slow stage costs its own numbers and not the later stages' or the summary (a stage
# that timed out or was skipped is named in the log and makes the exit status 1).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [T ...]}
shift
lengths=("$@")
[ ${#lengths[@]} -gt 0 ] || lengths=(1024 4096 8192)
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1
build=${KVBOUND_GPU_BUILD:-build-gpu}
python=${PYTHON:-python3}
start=$(date +%s)
stage() { echo "[gpu_check +$(($(date +%s) - start))s] $*"; }
status=0
deadline=$((start + ${GPU_CHECK_SECONDS:-540} - 25))  # 25 s kept for the summary
# bounded CAP COMMAND...: runs COMMAND under a timeout of CAP seconds or what is left before the deadline.
bounded() {
  local cap=$1 left=$((deadline - $(date +%s)))
  shift
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 10 ]; then
    echo "gpu_check: skipped for lack of time: $*"
    return 1
  fi
  timeout "$cap" "$@"
  local rc=$?
  [ $rc = 124 ] && echo "gpu_check: stopped after ${cap}s: $*"
  return $rc
}

stage "machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
torch_prefix=$("$python" -c 'import torch, torch.utils; print(torch.utils.cmake_prefix_path)') || {
  echo "gpu_check: $python cannot import torch"; exit 1; }
stage "configure ($build, torch at $torch_prefix)"
mkdir -p "$build"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_prefix" -DKVBOUND_CUDA=ON \
  -DKVBOUND_WITH_ICU=OFF -DKVBOUND_WITH_PLOTS=OFF -DKVBOUND_WITH_TENSORBOARD=OFF -DKVBOUND_WITH_GLOO=OFF \
  -DKVBOUND_PYTHON="$(command -v "$python")" >"$build/configure.log" 2>&1 || {
  tail -40 "$build/configure.log"; echo "gpu_check: configure failed"; exit 1; }
stage "build"
# -k 0: one failed build shows every broken file, not the first (the whole log is copied to OUT_DIR).
cmake --build "$build" -j "$(nproc)" --target kvbound kvbound_device_tests bench_cuda_ops bench_decode bench_train_step \
  -- -k 0 >"$build/build.log" 2>&1 || {
  cp "$build/build.log" "$out/build.log"; grep -E "error:|FAILED:" "$build/build.log" | head -40
  echo "gpu_check: build failed"; exit 1; }

if [ "${GPU_CHECK_MODE:-check}" = diagnose ]; then
  tool() { command -v "$1" || ls /usr/local/cuda/bin/"$1" /opt/nvidia/nsight-compute/*/"$1" 2>/dev/null | head -1; }
  sanitizer=$(tool compute-sanitizer)
  ncu=$(tool ncu)
  kernel_tests='RmsNormOp.Cuda*:RetentionAttentionCuda.*:RetentionSumCuda.*:PooledOpsCuda.*'
  for check in memcheck racecheck; do
    stage "compute-sanitizer --tool $check on the kernel tests"
    if [ -z "$sanitizer" ]; then echo "gpu_check: no compute-sanitizer here"; status=1; continue; fi
    bounded 150 "$sanitizer" --tool "$check" --error-exitcode 3 --print-limit 20 "$build"/tests/kvbound_device_tests \
      --gtest_filter="$kernel_tests" >"$out/$check.txt" 2>&1 || status=1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|\[  (PASSED|FAILED|SKIPPED) " "$out/$check.txt"
  done
  if [ -z "$ncu" ]; then
    echo "gpu_check: no ncu here"
    status=1
  else
    profile() {  # NAME SKIP COUNT REGEX BENCH_ARGS...: ncu's detailed sections of COUNT launches after SKIP
      local name=$1 skip=$2 count=$3 regex=$4
      shift 4
      stage "ncu: $name"
      bounded 120 "$ncu" --clock-control none --kernel-name-base demangled -k "regex:$regex" --launch-skip "$skip" \
        --launch-count "$count" --set detailed "$build"/bench/bench_cuda_ops "$@" >"$out/ncu_$name.txt" 2>&1 || status=1
      grep -E "_kernel<|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy" \
        "$out/ncu_$name.txt" | head -40
    }
    # The forward's 12 timed launches come first; the first forward + backward then launches forward, dQ, dK/dV.
    profile retention_attention 12 3 '(query_rows|key_rows)_kernel<c10::BFloat16, 128' --only retention_attention 8192
    profile pooled_importance 0 2 '(row_lse|key_pool)_kernel' --only pooled
    profile pooled_index_score 0 1 'index_score_kernel' --only pooled
  fi
  stage "done (exit $status)"
  exit $status
fi

stage "CUDA tests (kvbound_device_tests)"
# Every test's RUN line is printed (a crash then names its test); failures name the op, dtype, device and values.
bounded 200 "$build"/tests/kvbound_device_tests --gtest_output="xml:$out/device_tests.xml"
tests_failed=$(grep -o 'failures="[0-9]*"' "$out/device_tests.xml" 2>/dev/null | head -1 | grep -o '[0-9]*')
tests_skipped=$(grep -c 'result="skipped"' "$out/device_tests.xml" 2>/dev/null)
tests_total=$(grep -o 'tests="[0-9]*"' "$out/device_tests.xml" 2>/dev/null | head -1 | grep -o '[0-9]*')
# On a GPU nothing may skip: a skip means the CUDA module did not load or saw no device.
[ "${tests_failed:-1}" = 0 ] && [ "${tests_skipped:-1}" = 0 ] || status=1

stage "ops benchmark: kernels and the naive formula (T = ${lengths[*]})"
bounded 100 "$build"/bench/bench_cuda_ops "${lengths[@]}" | tee "$out/ops.jsonl" || status=1
stage "ops benchmark: FlexAttention peer"
PYTHONUNBUFFERED=1 bounded 90 "$python" bench/peers/flex_retention_attention.py "${lengths[@]}" | tee "$out/ops_flex.jsonl" ||
  status=1

stage "decode: random Llama-3.2-1B shapes, context 32768, batch 4, bf16: full vs trimkv and h2o at M = 1024"
model_dir=${TMPDIR:-/tmp}/kvbound_random_llama1b
bounded 60 "$python" bench/peers/make_random_llama.py "$model_dir" || status=1
: >"$out/decode.jsonl"
for run in "full 1" "trimkv 1024" "h2o 1024"; do
  set -- $run
  bounded 60 "$build"/bench/bench_decode "$model_dir" 32768 "$1" "$2" 8 64 1024 cuda 4 bfloat16 | tee -a "$out/decode.jsonl" ||
    status=1
done

stage "training: one TRIM-KV update at T = 8192, B 1, bf16 (gate width 512, M_train 512), and IndexMem stage 1"
bounded 60 "$build"/bench/bench_train_step "$model_dir" trimkv 8192 1 4 cuda bfloat16 trimkv.gate_hidden=512 trimkv.budget=512 |
  tee "$out/train.jsonl" || status=1
bounded 60 "$build"/bench/bench_train_step "$model_dir" indexmem 8192 1 4 cuda bfloat16 | tee -a "$out/train.jsonl" || status=1
# The peers run with the carried wheels (scripts/gpu_wheels.sh: the official TRIM-KV package and the transformers
# it pins). The official package's update compiles FlexAttention in its first step (65 s on the H200), so it gets
# 150 s; the IndexMem peer is bench/peers/indexmem_step.py, the same formulas as the CPU comparison's, on CUDA.
if ls .whl/trimkv-*.whl >/dev/null 2>&1; then
  peer_site=${TMPDIR:-/tmp}/kvbound_peer_site
  "$python" -m pip install -q --no-index --no-deps --no-compile --target "$peer_site" .whl/*.whl || status=1
  PYTHONPATH="$peer_site" PYTHONUNBUFFERED=1 bounded 150 "$python" bench/peers/official_trimkv_step.py 8192 |
    tee -a "$out/train.jsonl" || status=1
  PYTHONPATH="$peer_site" PYTHONUNBUFFERED=1 bounded 90 "$python" bench/peers/indexmem_step.py "$model_dir" \
    8192 1 4 1 32 32 bfloat16 cuda | tee -a "$out/train.jsonl" || status=1
else
  echo "gpu_check: no .whl/ carried: the official TRIM-KV peer cannot run (scripts/gpu_wheels.sh, then carry .whl)"
  status=1
fi

stage "summary"
"$python" - "$out" "${tests_total:-?}" "${tests_failed:-?}" "${tests_skipped:-?}" <<'PY' | tee "$out/summary.md"
import json, pathlib, sys
out, total, failed, skipped = pathlib.Path(sys.argv[1]), *sys.argv[2:]
rows = []
for name in ("ops.jsonl", "ops_flex.jsonl"):
    path = out / name
    if path.exists():
        rows += [json.loads(l) for l in path.read_text().splitlines() if l.startswith("{")]
print(f"CUDA tests: {total} run, {failed} failed, {skipped} skipped\n")
print("| op | pass | T | kernel ms (TFLOP/s) | flex ms | naive ms | kernel / flex speed | kernel / naive speed | kernel rel. error | naive bf16 rel. error |")
print("|---|---|---|---|---|---|---|---|---|---|")
by = {}
for r in rows:
    by[(r["op"], r["pass"], r.get("T", str(r.get("shape"))), r["impl"])] = r
keys = sorted({k[:3] for k in by}, key=lambda k: (k[0], k[1], str(k[2])))
for op, p, T in keys:
    kern, flex, naive = (by.get((op, p, T, i)) for i in ("kernel", "flex", "naive"))
    ms = lambda r: f"{r['ms']:.3f}" if r else "—"
    ratio = lambda a, b: f"{b['ms'] / a['ms']:.2f}x" if a and b else "—"
    err = lambda r: f"{r['rel_error_vs_float64']:.2e}" if r and "rel_error_vs_float64" in r else "—"
    tf = f" ({kern['tflops']:.0f})" if kern and kern.get("tflops") else ""
    print(f"| {op} | {p} | {T} | {ms(kern)}{tf} | {ms(flex)} | {ms(naive)} | {ratio(kern, flex)} | {ratio(kern, naive)} | {err(kern)} | {err(naive)} |")
train = out / "train.jsonl"
steps = [json.loads(l) for l in train.read_text().splitlines() if l.startswith("{")] if train.exists() else []
ours = {r["method"]: r for r in steps if r.get("impl") == "kvbound"}
peer = next((r for r in steps if r.get("peer") and "tokens_per_s" in r), None)
indexmem_peer = next((r for r in steps if r.get("impl") == "pytorch" and r.get("method") == "indexmem"), None)
if steps:
    print("\n| training update (T 8192, B 1, bf16) | ms | tokens/s | vs its peer |")
    print("|---|---|---|---|")
    for name, r in ours.items():
        vs = "—"
        if peer and name == "trimkv":
            vs = f"{r['tok_s'] / peer['tokens_per_s']:.2f}x the official TRIM-KV package"
        if indexmem_peer and name == "indexmem":
            vs = f"{r['tok_s'] / indexmem_peer['tok_s']:.2f}x PyTorch (bench/peers/indexmem_step.py)"
        print(f"| kvbound {name} | {r['ms_per_update']:.0f} | {r['tok_s']:.0f} | {vs} |")
    if peer:
        print(f"| official trimkv 0.1.5 | {peer['median_ms']:.0f} | {peer['tokens_per_s']:.0f} | |")
    if indexmem_peer:
        print(f"| PyTorch IndexMem stage 1 | {indexmem_peer['ms_per_update']:.0f} | {indexmem_peer['tok_s']:.0f} | |")
decode = out / "decode.jsonl"
runs = [json.loads(l) for l in decode.read_text().splitlines() if l.startswith("{")] if decode.exists() else []
full = next((r for r in runs if r["policy"] == "full"), None)
if runs:
    print("\n| decode (context 32768, batch 4, bf16) | M | tokens/s | vs full | peak KV MiB |")
    print("|---|---|---|---|---|")
    for r in runs:
        vs = f"{r['decode_tok_s'] / full['decode_tok_s']:.2f}x" if full else "—"
        print(f"| {r['policy']} | {r['budget'] or '—'} | {r['decode_tok_s']:.1f} | {vs} | {r['peak_kv_bytes'] / 2**20:.0f} |")
PY
stage "done (exit $status)"
exit $status
