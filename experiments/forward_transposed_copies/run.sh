#!/usr/bin/env bash
# Builds epflow-bench and the FP8 tests from the tree as it is (base) and with
# forward_writes_transposed.patch (in /tmp/ftc_NAME), runs the FP8 layer tests on the patched
# build (a wrong copy shows in the backward's gradients), then times the FP8 and bf16 training
# steps of both at DeepSeek-V3, 512 / 2048 / 8192 tokens, one process per token count, three
# rounds in alternating order; tables by experiments/step_ceilings/summarize.py. Run from the
# repository root on a GPU machine (GoogleTest in .deps/googletest, as for scripts/build.sh).
set -uo pipefail
here=experiments/forward_transposed_copies
export VARIANT_TESTS="test_layer_backward_gpu test_layer_fp8_gpu test_fp8_quantize_gpu"
source experiments/build_variants.sh
build_variants $here /tmp/ftc base forward_writes_transposed || exit 1
echo "built at ${SECONDS}s"
t=/tmp/ftc_forward_writes_transposed/build/tests
timeout 60 $t/test_fp8_quantize_gpu 2>&1 | grep -E "^\[  (PASSED|FAILED) |Failure"
timeout 120 $t/test_layer_fp8_gpu --gtest_filter='*Ep1' 2>&1 | grep -E "^\[  (PASSED|FAILED) |Failure"
timeout 300 $t/test_layer_backward_gpu --gtest_filter='*Fp8*Ep1' 2>&1 |
  grep -E "^\[  (PASSED|FAILED|  OK) |^\[       OK|FAILED|Failure"
echo "tests done at ${SECONDS}s"
ROUNDS=3 PER_TOKEN_PROCESS=1 time_variants /tmp/ftc ${TOKENS:-512,2048,8192} \
  "tokens/rank|backward  |its stages|training step|FP8 over" base forward_writes_transposed
