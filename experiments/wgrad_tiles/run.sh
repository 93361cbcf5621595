#!/usr/bin/env bash
# The FP8 weight-gradient GEMM's tiles (README.md). On a GPU machine, from the repository root
# (GoogleTest in .deps/googletest for the tests, as scripts/build.sh takes it there):
#   experiments/wgrad_tiles/run.sh timeline    EPFlow built with timeline.patch (/tmp/wt_timeline),
#       timeline.cu compiled against it, one stamped launch per shape at TOKENS (default 2048
#       and 8192 tokens per rank), then summarize.py. About a minute. TIMELINES="timeline
#       timeline_X": each of those patches in turn (timeline_X.patch: timeline.patch with X's
#       change).
#   experiments/wgrad_tiles/run.sh ab VARIANT    VARIANT.patch against the tree (a_registers,
#       b_multicast, scales_ahead, a_scales_kmajor, warp_arrive, early_group_warp_arrive,
#       first_block_sets, passes_cp_async):
#       the weight-gradient tests on the patched build, then the FP8 step at 512 /
#       2048 / 8192 tokens, one process per count, three rounds alternating
#       (experiments/step_ceilings/summarize.py OUTPUT reads it). About three minutes.
# Outputs go to $OUT (default /tmp).
set -uo pipefail
here=experiments/wgrad_tiles
out=${OUT:-/tmp}
case ${1:-timeline} in
timeline)
  source experiments/build_variants.sh
  timelines=${TIMELINES:-timeline}
  build_variants $here /tmp/wt $timelines || exit 1
  for v in $timelines; do
    d=/tmp/wt_$v
    nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -I$d/src -I$d/include -I$d/bench \
      $here/timeline.cu $d/build/src/libepflow.a -lcuda -o $d/timeline || exit 1
    files=()
    for t in $(echo ${TOKENS:-2048,8192} | tr ',' ' '); do
      $d/timeline $t $out/${v}_stamps_$t.csv || exit 1
      files+=($out/${v}_stamps_$t.csv)
    done
    echo "== $v"
    python3 $here/summarize.py "${files[@]}"
  done
  ;;
ab)
  v=${2:?usage: $0 ab VARIANT}
  export VARIANT_TESTS="test_fp8_wgrad_gpu test_expert_ffn_wgrad_gpu test_layer_backward_gpu test_fp8_quantize_gpu"
  source experiments/build_variants.sh
  build_variants $here /tmp/wt base $v || exit 1
  t=/tmp/wt_$v/build/tests
  for x in test_fp8_wgrad_gpu test_expert_ffn_wgrad_gpu test_fp8_quantize_gpu; do
    timeout 120 $t/$x 2>&1 | grep -E "^\[  (PASSED|FAILED) |Failure"
  done
  timeout 150 $t/test_layer_backward_gpu --gtest_filter='*Ep1*:-*DeepSeekV3*' 2>&1 |
    grep -E "^\[  (PASSED|FAILED) |Failure"
  ROUNDS=3 PER_TOKEN_PROCESS=1 time_variants /tmp/wt 512,2048,8192 \
    "tokens/rank|backward  |its stages|training step|FP8 over" base $v \
    > $out/wgrad_${v}_ab_output.txt 2>&1
  python3 experiments/step_ceilings/summarize.py $out/wgrad_${v}_ab_output.txt
  ;;
*) echo "usage: $0 timeline | ab VARIANT" >&2; exit 2 ;;
esac
