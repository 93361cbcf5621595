#!/usr/bin/env bash
# Sanitizer runs of the CPU-portable code: the routing schedule's property tests and
# the megakernel task-list simulation under AddressSanitizer + UndefinedBehaviorSanitizer, with
# more random schedule shapes than the default suite (EPFLOW_FUZZ_CASES), and the megakernel's
# hand-off protocol run by real threads under ThreadSanitizer. Builds only these CPU targets, in
# build-asan/ and build-tsan/ (BUILD_PREFIX to move them). Exits non-zero on any report.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=${BUILD_PREFIX:-build}
GTEST_ARGS=()
[ -n "${EPFLOW_GTEST_SOURCE_DIR:-}" ] && GTEST_ARGS=(-DEPFLOW_GTEST_SOURCE_DIR="$EPFLOW_GTEST_SOURCE_DIR")
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
configure() {  # dir sanitizers
  mkdir -p "$1"
  cmake -S . -B "$1" "${GEN[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEPFLOW_BUILD_BENCH=OFF \
    -DCMAKE_CUDA_COMPILER="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" \
    -DEPFLOW_SANITIZE="$2" "${GTEST_ARGS[@]}" > "$1/configure.log"
}
configure "$prefix-asan" address,undefined
cmake --build "$prefix-asan" -j "$(nproc)" --target test_routing_schedule test_megakernel_tasks
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1
EPFLOW_FUZZ_CASES=400 "$prefix-asan/tests/test_routing_schedule" --gtest_brief=1
"$prefix-asan/tests/test_megakernel_tasks" --gtest_brief=1
configure "$prefix-tsan" thread
cmake --build "$prefix-tsan" -j "$(nproc)" --target test_megakernel_protocol_threads
TSAN_OPTIONS=halt_on_error=1 "$prefix-tsan/tests/test_megakernel_protocol_threads" --gtest_brief=1
echo "sanitize.sh: no reports"
