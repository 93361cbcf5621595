#!/usr/bin/env bash
# Builds dg_vs_epflow (README.md): fetches DeepGEMM and the CUTLASS commit it pins (headers only;
# nothing of them enters EPFlow), then compiles the experiment against an EPFlow build's library.
#   experiments/deepgemm_same_run/build.sh [BUILD_DIR]   (default: build, from scripts/build.sh)
# DEEPGEMM_DIR / CUTLASS_DIR: checkouts at those commits to use instead of fetching.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
build=$(cd "${1:-$repo/build}" && pwd)
deps="$here/.deps"
DEEPGEMM_COMMIT=54e22612409371d6364144b69086735beb54e98b
CUTLASS_COMMIT=f3fde58372d33e9a5650ba7b80fc48b3b49d40c8  # DeepGEMM's third-party/cutlass
fetch() {  # fetch DIR URL COMMIT
  if [ ! -d "$1/.git" ]; then git init -q "$1" && git -C "$1" remote add origin "$2"; fi
  git -C "$1" fetch -q --depth 1 origin "$3" && git -C "$1" checkout -q FETCH_HEAD
}
dg=${DEEPGEMM_DIR:-$deps/DeepGEMM}
cutlass=${CUTLASS_DIR:-$deps/cutlass}
[ -n "${DEEPGEMM_DIR:-}" ] || fetch "$dg" https://github.com/deepseek-ai/DeepGEMM.git "$DEEPGEMM_COMMIT"
[ -n "${CUTLASS_DIR:-}" ] || fetch "$cutlass" https://github.com/NVIDIA/cutlass.git "$CUTLASS_COMMIT"
[ -f "$build/src/libepflow.a" ] || { echo "build.sh: no $build/src/libepflow.a (run scripts/build.sh)" >&2; exit 1; }
nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
  --expt-extended-lambda --ptxas-options=--register-usage-level=10 -diag-suppress=174,177 \
  -I"$dg/deep_gemm/include" -I"$cutlass/include" -I"$repo/src" -I"$repo/include" \
  -I"$repo/bench" "$here/dg_vs_epflow.cu" "$build/src/libepflow.a" -o "$build/dg_vs_epflow"
echo "built $build/dg_vs_epflow"
