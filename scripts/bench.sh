#!/usr/bin/env bash
# Builds EPFlow and runs the main job, epflow-bench, with any arguments given. On GPUs it runs the
# layer on the GPUs present; without one it runs the CPU reference on the small "tiny" preset.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh >/dev/null
exec "${BUILD_DIR:-build}/epflow-bench" "$@"
