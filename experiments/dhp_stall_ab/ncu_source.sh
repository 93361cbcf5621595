#!/usr/bin/env bash
# Where the FP8 backward megakernel's warps stall, by source line: builds epflow-bench with
# -lineinfo (build-prof), takes one backward megakernel launch at DeepSeek-V3, 2048 tokens under
# ncu (warp-stall sampling, clocks left alone) and summarises it with source_stalls.py. Run from
# the repository root on a GPU machine; about a minute. Writes to ${OUT:-/tmp}. Another kernel:
# KERNEL (a regex of its demangled name), SKIP and COUNT (its launches to pass over, then to
# profile), TOKENS, NAME (of the output files); e.g. the weight gradients' operand passes:
# KERNEL=quantize_transposed SKIP=4 COUNT=4 NAME=passes.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL_ROOT=${NCCL_ROOT:-$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])')}
out=${OUT:-/tmp}
cmake -S . -B build-prof -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPFLOW_BUILD_TESTS=OFF \
  -DCMAKE_CUDA_FLAGS=-lineinfo -DEPFLOW_NCCL_ROOT=$NCCL_ROOT > /dev/null &&
  cmake --build build-prof -j "$(nproc)" --target epflow-bench > /dev/null || exit 1
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
name=${NAME:-fp8_bwd}
$NCU --clock-control none --kernel-name-base demangled -k regex:${KERNEL:-Fp8BackwardPass} \
  --launch-skip ${SKIP:-1} --launch-count ${COUNT:-1} --section SpeedOfLight --section WarpStateStats \
  --section SourceCounters --section Occupancy --section MemoryWorkloadAnalysis \
  --import-source yes -o $out/$name -f \
  build-prof/epflow-bench --dtype fp8 --backward --tokens ${TOKENS:-2048} --repeats 1 --warmup 1 \
  --iters 1 --baselines none > $out/${name}_run.txt 2>&1 || exit 1
$NCU --import $out/$name.ncu-rep --page details > $out/${name}_details.txt
$NCU --import $out/$name.ncu-rep --page source --csv --print-source cuda,sass > $out/${name}_source.csv
python3 experiments/dhp_stall_ab/source_stalls.py $out/${name}_source.csv | tee $out/${name}_source_stalls.txt
