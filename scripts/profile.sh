#!/usr/bin/env bash
# Where does the forward megakernel spend its time? On the GPU machine, writes into OUTDIR:
#  - trace-*.csv, trace.md, trace.png: every megakernel task of the last call (taken, ready after
#    its counter waits, done) at EP = all GPUs, summarised by bench/trace_summary.py;
#  - megakernel.ncu-rep: Nsight Compute's throughput, warp-state and scheduler sections for one
#    megakernel launch at EP=1
#    (no cross-GPU waits, so kernel replay is safe).
# Usage: scripts/profile.sh OUTDIR [PRESET] [TOKENS]     (default deepseek-v3, 8192)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/profile.sh OUTDIR [PRESET] [TOKENS]}
preset=${2:-deepseek-v3}
tokens=${3:-8192}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$out"
scripts/build.sh >/dev/null
build/epflow-bench --preset "$preset" --tokens "$tokens" --iters 3 --warmup 2 --baselines none \
  --trace "$out/trace" >"$out/trace-bench.log"
python3 bench/trace_summary.py "$out"/trace-*.csv --png "$out/trace.png" | tee "$out/trace.md"
# Only the sections read: --set full runs too long for a device call.
ncu --clock-control none --kernel-name "regex:moe_megakernel<.*ForwardPass" --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SchedulerStats \
  -f -o "$out/megakernel" \
  build/epflow-bench --preset "$preset" --tokens "$tokens" --ep 1 --iters 1 --warmup 2 \
  --baselines none >"$out/ncu.log" 2>&1
ncu --import "$out/megakernel.ncu-rep" --page details --section SpeedOfLight \
  --section WarpStateStats >"$out/ncu-summary.txt"
echo "profile: $out (trace.md, trace.png, megakernel.ncu-rep, ncu-summary.txt)"
