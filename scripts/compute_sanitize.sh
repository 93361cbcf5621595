#!/usr/bin/env bash
# compute-sanitizer runs of the GPU tests: memcheck, racecheck and synccheck on the
# one-GPU tests of small shapes (the DeepSeek-V3-shape tests take hours under the tools; the
# forced-timeout tests trap on purpose). Needs a built tree (scripts/build.sh) and one GPU.
#   scripts/compute_sanitize.sh [memcheck|racecheck|synccheck ...]   (default: all three)
# LOG_DIR (default build/compute-sanitizer) gets one log per tool and binary; TOOL_TIMEOUT
# (seconds, default 240) bounds each binary's run; ONLY (a regex) keeps the binaries it matches.
# Exits non-zero if a tool reported an error or a run did not finish. API errors are not
# reported: NCCL probes its kernels and cuMem permissions at init and handles the errors itself
# (they were all of memcheck's "errors" on the layer tests before); EPFlow turns its own into a
# Status, which fails the test.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck synccheck)
log_dir=${LOG_DIR:-build/compute-sanitizer}
mkdir -p "$log_dir"
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# binary : gtest filter (small shapes, one GPU)
runs=(
  "test_routing_schedule_gpu:RoutingScheduleGpu.MatchesHostOnRandomAndAdversarialRoutings"
  "test_expert_ffn_gpu:ExpertFfnGpu.RaggedSegmentsSmallShapes"
  "test_expert_ffn_dgrad_gpu:ExpertDgradGpu.DownInputGradientRaggedSegments:ExpertDgradGpu.GateUpInputGradientSplitK"
  "test_expert_ffn_wgrad_gpu:ExpertWgradGpu.RaggedSegmentsSmallShapes:ExpertWgradGpu.FewCtasManyTilesEach:ExpertWgradGpu.Fp32AccumulatedAndWideLhsRows"
  "test_layer_gpu:LayerGpu.Ep1UniformRoutingRepeatedCalls:LayerGpu.Ep1ImbalancedEmptyExpertsAndOneHotExpert:LayerGpu.RingSmallerThanRoutedRowsEp1:LayerGpu.UnfusedChainMatchesReferenceEp1"
  "test_layer_backward_gpu:LayerBackwardGpu.Ep1UniformImbalancedAndEmptySlots:LayerBackwardGpu.Ep1AccumulatedAndBf16Gradients"
  "test_layer_robustness_gpu:LayerRobustnessGpu.ReportsOutOfRangeAndRepeatedExpertsOnce:LayerRobustnessGpu.NanAndInfStayInTheirTokens"
)
failed=0
for tool in "${tools[@]}"; do
  for run in "${runs[@]}"; do
    bin=${run%%:*}
    filter=${run#*:}
    [[ -n "${ONLY:-}" && ! "$bin" =~ $ONLY ]] && continue
    log="$log_dir/$tool-$bin.log"
    start=$(date +%s)
    timeout "${TOOL_TIMEOUT:-240}" "$sanitizer" --tool "$tool" --error-exitcode 99 \
      --report-api-errors no \
      --target-processes all "build/tests/$bin" --gtest_filter="$filter" --gtest_brief=1 \
      > "$log" 2>&1
    rc=$?
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1)
    printf '%-10s %-28s rc=%-3s %4ss  %s\n' "$tool" "$bin" "$rc" "$(( $(date +%s) - start ))" \
      "${summary:-no summary}"
    [ "$rc" -ne 0 ] && failed=1
  done
done
exit $failed
