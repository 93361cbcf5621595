#!/usr/bin/env bash
# Builds the tree as it is and once per patch named (default: both patches here), each in
# /tmp/eoab_NAME with the GPU tests the patches touch, runs those tests on each patched build,
# then times the FP8 and bf16 forward and backward at DeepSeek-V3, 512 / 2048 / 8192 tokens,
# two rounds in alternating order. Run from the repository root on a GPU machine (GoogleTest in .deps/googletest, as for
# scripts/build.sh there). Arguments: the patches to take (two took 200-260 s on one H200).
set -uo pipefail
here=experiments/epilogue_operand_ab
patched="${*:-quad_transpose operand_passes_pipelined}"
vars="base $patched"
export VARIANT_TESTS="test_layer_backward_gpu test_fp8_quantize_gpu test_fp8_wgrad_gpu"
source experiments/build_variants.sh
build_variants $here /tmp/eoab $vars || exit 1
# Bitwise-equal changes: the tests that hold their kernels to the references.
backward="LayerBackwardGpu.Ep1UniformImbalancedAndEmptySlots:LayerBackwardGpu.RingWrapAndIntermediateTailEp1"
backward+=":LayerBackwardGpu.Fp8MatchesTheReferencesEp1:LayerBackwardGpu.Fp8ContextsInFlightInAnyOrderEp1"
for v in $patched; do
  t=/tmp/eoab_$v/build/tests
  echo "== tests, $v"
  timeout 150 $t/test_layer_backward_gpu --gtest_filter=$backward 2>&1 | grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure"
  [ $v = operand_passes_pipelined ] && timeout 60 $t/test_fp8_quantize_gpu 2>&1 | grep -E "^\[  (PASSED|FAILED) |Failure"
  [ $v = quad_transpose ] || timeout 60 $t/test_fp8_wgrad_gpu 2>&1 | grep -E "^\[  (PASSED|FAILED) |Failure"
done
time_variants /tmp/eoab 512,2048,8192 "tokens/rank|megakernel \(fused|backward  |its stages" $vars
