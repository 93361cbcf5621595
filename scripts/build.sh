#!/usr/bin/env bash
# Configures and builds EPFlow into ${BUILD_DIR:-build}. Finds NCCL explicitly: $NCCL_ROOT if set,
# else the nvidia-nccl wheel of python3 (the GPU machine: the NCCL that torch loads), else the
# CUDA toolkit's (/usr/local/cuda on the CPU machines).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
if [ -z "${NCCL_ROOT:-}" ]; then
  NCCL_ROOT=$(python3 -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
  if [ -z "$NCCL_ROOT" ] || [ ! -f "$NCCL_ROOT/include/nccl.h" ]; then
    NCCL_ROOT=$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")
  fi
fi
# GoogleTest: the installed package, else sources in .deps/googletest (the GPU machine has no
# package and no network; copy /usr/share or /usr/src/googletest there before a device run).
GTEST_ARGS=()
if [ -z "${EPFLOW_GTEST_SOURCE_DIR:-}" ] && [ -d .deps/googletest ]; then
  EPFLOW_GTEST_SOURCE_DIR=$PWD/.deps/googletest
fi
[ -n "${EPFLOW_GTEST_SOURCE_DIR:-}" ] && GTEST_ARGS=(-DEPFLOW_GTEST_SOURCE_DIR="$EPFLOW_GTEST_SOURCE_DIR")
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD_DIR" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_COMPILER="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" \
    -DEPFLOW_NCCL_ROOT="$NCCL_ROOT" "${GTEST_ARGS[@]}"
fi
cmake --build "$BUILD_DIR" -j "$(nproc)"
