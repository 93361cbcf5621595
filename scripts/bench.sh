#!/usr/bin/env bash
# Builds EPFlow and runs the main job, epflow-bench, with any arguments given. On GPUs it runs the
# layer on the GPUs present; without one it runs the CPU reference on the small "tiny" preset.
set -euo pipefail
cd "$(dirname "$0")/.."
# The first build compiles the CUDA library for minutes: its progress goes to stderr, so that the
# wait shows and stdout stays the benchmark's own.
echo "bench.sh: building EPFlow (the first build takes a few minutes)..." >&2
scripts/build.sh >&2
exec "${BUILD_DIR:-build}/epflow-bench" "$@"
