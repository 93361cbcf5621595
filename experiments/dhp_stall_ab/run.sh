#!/usr/bin/env bash
# Builds the tree as it is and once per patch here (each in /tmp/dhpab_NAME), then
# (1) times the FP8 and bf16 forward and backward at DeepSeek-V3, 2048 and 8192 tokens, two rounds
# in alternating order, and (2) reads the FP8 megakernels' L2 hit rates and DRAM bytes under ncu
# at 2048 tokens (clocks left alone), without and with the L2 policy. Run from the repository root
# on a GPU machine; about 9 min.
set -uo pipefail
here=experiments/dhp_stall_ab
vars="base weights_evict_last dhp_no_swiglu_bwd dhp_gu_batched_loads"
source experiments/build_variants.sh
build_variants $here /tmp/dhpab $vars || exit 1
time_variants /tmp/dhpab 2048,8192 "tokens/rank|megakernel \(fused|backward  |its stages" $vars
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for v in base weights_evict_last; do
  echo "== ncu, $v"
  timeout 150 $NCU --clock-control none --kernel-name-base demangled -k regex:moe_megakernel \
    --launch-count 6 --section SpeedOfLight \
    --metrics lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum \
    /tmp/dhpab_$v/build/epflow-bench --dtype fp8 --backward --tokens 2048 --repeats 1 --warmup 1 \
    --iters 1 --baselines none 2>&1 | grep -E "moe_megakernel|Duration|hit_rate|dram__bytes|lts__t_bytes" \
    | sed 's/(const __grid_constant__.*//'
done
