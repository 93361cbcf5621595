#!/usr/bin/env bash
# What transposing the dgrad GEMMs' weight stages in shared memory would cost the FP8 backward
# megakernel (README.md). On a GPU machine, from the repository root:
#   experiments/dgrad_transpose/run.sh [VARIANT...]   (default: in_place_timing)
# builds main and each VARIANT.patch (experiments/build_variants.sh), times the FP8 backward at
# TOKENS (default 2048,8192), one process per count, three rounds alternating, and prints the
# megakernel stage per variant (summarize.py). Timing only: the patched builds compute wrong
# gradients by design, so no tests run. Outputs to $OUT (default /tmp). About four minutes.
set -uo pipefail
here=experiments/dgrad_transpose
out=${OUT:-/tmp}
variants=${*:-in_place_timing}
source experiments/build_variants.sh
build_variants $here /tmp/dt base $variants || exit 1
ROUNDS=3 PER_TOKEN_PROCESS=1 time_variants /tmp/dt ${TOKENS:-2048,8192} \
  "tokens/rank|backward  |its stages|training step|FP8 over" base $variants \
  > $out/dgrad_transpose_output.txt 2>&1
python3 $here/summarize.py $out/dgrad_transpose_output.txt
