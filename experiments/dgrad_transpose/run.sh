#!/usr/bin/env bash
# The dgrad GEMMs' weight stages transposed in shared memory (README.md). On a GPU machine, from
# the repository root:
#   experiments/dgrad_transpose/run.sh [VARIANT...]   (default: in_place_timing in_place)
# builds main and each VARIANT.patch (experiments/build_variants.sh, with the FP8 tests), runs
# the quantization, weight-gradient and EP = 1 backward tests on each variant that computes
# gradients (not the *_timing ones, which transpose what is already transposed: timing only),
# then times the FP8 step at TOKENS (default 512,2048,8192), one process per count, three rounds
# alternating, and prints the FP8 backward megakernel's stage (summarize.py) and the step's
# parts (experiments/step_ceilings/summarize.py) per variant. Outputs to $OUT (default /tmp).
# About six minutes with two variants.
set -uo pipefail
here=experiments/dgrad_transpose
out=${OUT:-/tmp}
variants=${*:-in_place_timing in_place}
export VARIANT_TESTS="test_fp8_quantize_gpu test_fp8_wgrad_gpu test_layer_backward_gpu"
source experiments/build_variants.sh
build_variants $here /tmp/dt base $variants || exit 1
for v in $variants; do
  case $v in *_timing) continue ;; esac
  echo "== tests: $v"
  t=/tmp/dt_$v/build/tests
  for x in test_fp8_quantize_gpu test_fp8_wgrad_gpu; do
    timeout 120 $t/$x 2>&1 | grep -E "^\[  (PASSED|FAILED) |Failure"
  done
  timeout 200 $t/test_layer_backward_gpu --gtest_filter='*Ep1*:-*DeepSeekV3*' 2>&1 |
    grep -E "^\[  (PASSED|FAILED) |Failure|FAILED  \]"
done
ROUNDS=3 PER_TOKEN_PROCESS=1 time_variants /tmp/dt ${TOKENS:-512,2048,8192} \
  "tokens/rank|backward  |its stages|training step|FP8 over" base $variants \
  > $out/dgrad_transpose_output.txt 2>&1
python3 $here/summarize.py $out/dgrad_transpose_output.txt
python3 experiments/step_ceilings/summarize.py $out/dgrad_transpose_output.txt
