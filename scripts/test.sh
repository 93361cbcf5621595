#!/usr/bin/env bash
# Builds EPFlow and runs the whole test suite. GPU tests (label gpu) skip with a message where
# there is no CUDA device; pass extra ctest arguments through, e.g. `scripts/test.sh -L gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure "$@"
