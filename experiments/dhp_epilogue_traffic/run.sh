#!/usr/bin/env bash
# The FP8 backward's dhp epilogue traffic (README.md): builds the tree and each patch here
# (/tmp/dt_VARIANT), runs the EP = 1 backward layer tests on the stwb build, then times the FP8
# and bf16 backward and the FP8 training step at 2048 and 8192 tokens, three rounds alternating,
# one process per token count, and summarizes. From the repository root on a GPU machine
# (GoogleTest in .deps/googletest); about seven minutes. Output in $OUT (default /tmp).
set -uo pipefail
here=experiments/dhp_epilogue_traffic
out=${OUT:-/tmp}
vars=${VARIANTS:-"base stwb no_bf16_dgu"}
export VARIANT_TESTS="test_layer_backward_gpu"
source experiments/build_variants.sh
build_variants $here /tmp/dt $vars || exit 1
timeout 200 /tmp/dt_stwb/build/tests/test_layer_backward_gpu --gtest_filter='*Ep1*' 2>&1 |
  grep -E "^\[  (PASSED|FAILED) |Failure|tests ran" | tee $out/dhp_epilogue_traffic_tests.txt
ROUNDS=3 PER_TOKEN_PROCESS=1 time_variants /tmp/dt ${TOKENS:-2048,8192} \
  "tokens/rank|backward  |its stages|training step|FP8 over" $vars \
  > $out/dhp_epilogue_traffic_output.txt 2>&1
python3 $here/summarize.py $out/dhp_epilogue_traffic_output.txt
