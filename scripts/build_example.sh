#!/usr/bin/env bash
# Uses EPFlow as an installed package, as a C++ user would: installs the build in
# ${BUILD_DIR:-build} (scripts/build.sh) into ${INSTALL_PREFIX:-a temporary folder}, builds
# examples/cpp against it with find_package(epflow) and runs it. Without a GPU the example prints
# validate()'s message for a bad config and that there is no device, and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=${INSTALL_PREFIX:-$tmp/epflow-install}
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake --install "$BUILD_DIR" --prefix "$prefix"
cmake -S examples/cpp -B "$tmp/example-build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix"
cmake --build "$tmp/example-build" -j "$(nproc)"
"$tmp/example-build/minimal_layer"
