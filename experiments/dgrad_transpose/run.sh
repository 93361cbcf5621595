#!/usr/bin/env bash
# The dgrad GEMMs' weight stages transposed in shared memory (README.md). On a GPU machine, from
# the repository root:
#   experiments/dgrad_transpose/run.sh [VARIANT...]   (default: in_place in_place_after_promotion)
# builds main and each VARIANT.patch (experiments/build_variants.sh, with the FP8 tests), runs
# the quantization and FP8 EP = 1 backward tests on each variant, then times the FP8 step at
# TOKENS (default 2048,8192), one process per count, three rounds alternating, and prints the FP8 backward megakernel's stage (summarize.py) and the step's
# parts (experiments/step_ceilings/summarize.py) per variant. Outputs to $OUT (default /tmp).
# About six minutes with two variants.
set -uo pipefail
here=experiments/dgrad_transpose
out=${OUT:-/tmp}
variants=${*:-in_place in_place_after_promotion}
export VARIANT_TESTS="test_fp8_quantize_gpu test_layer_backward_gpu"
source experiments/build_variants.sh
build_variants $here /tmp/dt base $variants || exit 1
for v in $variants; do
  echo "== tests: $v"
  t=/tmp/dt_$v/build/tests
  timeout 120 $t/test_fp8_quantize_gpu 2>&1 | grep -E "^\[  (PASSED|FAILED) |Failure"
  timeout 200 $t/test_layer_backward_gpu --gtest_filter='*Fp8*Ep1*:-*DeepSeekV3*' 2>&1 |
    grep -E "^\[  (PASSED|FAILED) |Failure|FAILED  \]"
done
ROUNDS=3 PER_TOKEN_PROCESS=1 time_variants /tmp/dt ${TOKENS:-2048,8192} \
  "tokens/rank|backward  |its stages|training step|FP8 over" base $variants \
  > $out/dgrad_transpose_output.txt 2>&1
python3 $here/summarize.py $out/dgrad_transpose_output.txt
python3 experiments/step_ceilings/summarize.py $out/dgrad_transpose_output.txt
