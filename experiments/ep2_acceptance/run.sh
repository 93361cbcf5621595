#!/usr/bin/env bash
# The FP8 training issue's acceptance at EP = 2 (README.md), on a machine with two GPUs joined by
# NVLink, from the repository root, in phases that each fit one device call (a later phase needs
# the build of an earlier call on the same, still warm, machine; carry .deps for GoogleTest):
#   experiments/ep2_acceptance/run.sh build   Release build with the tests and the PyTorch
#                                             binding into build-ep2 (~4 min on 32 cores)
#   experiments/ep2_acceptance/run.sh ctest   ctest -L gpu (EP = 1 and EP = 2 tests; on one
#                                             H200 the EP = 1 ones and the PyTorch tests took
#                                             7-9 minutes together)
#   experiments/ep2_acceptance/run.sh pytest  python3 -m pytest tests/python (its EP = 2
#                                             cases run where two GPUs are present)
#   experiments/ep2_acceptance/run.sh steps   the FP8 and bf16 backward and training step at
#                                             EP = 2 in long loops with repeats
#                                             (experiments/step_spread/steady.sh)
#   experiments/ep2_acceptance/run.sh train   examples/train_moe.py --dtype fp8 under torchrun,
#                                             one process per GPU
# Phases can be chained in one call where they fit (run.sh steps train). Outputs to $OUT (default /tmp):
# ep2_<phase>_output.txt, and steady.sh's files for `steps`.
set -uo pipefail
out=${OUT:-/tmp}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
b=build-ep2
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$gpus" -ge 2 ] || { echo "run.sh: $gpus GPU(s) here; EP = 2 needs two" >&2; exit 2; }
for phase in "$@"; do
  log=$out/ep2_${phase}_output.txt
  case $phase in
  build)
    NCCL_ROOT=${NCCL_ROOT:-$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])')}
    { cmake -S . -B $b -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPFLOW_BUILD_PYTHON=ON \
        -DEPFLOW_NCCL_ROOT=$NCCL_ROOT -DEPFLOW_GTEST_SOURCE_DIR=$PWD/.deps/googletest &&
      time cmake --build $b -j "$(nproc)"; } > $log 2>&1 || { tail -40 $log; exit 1; }
    tail -3 $log
    ;;
  ctest)
    timeout 580 ctest --test-dir $b -L gpu --output-on-failure > $log 2>&1
    grep -E "tests passed|tests failed|\*\*\*Failed|Timeout" $log | tail -12
    ;;
  pytest)
    timeout 580 python3 -m pytest tests/python -q > $log 2>&1
    tail -5 $log
    ;;
  steps)
    EP=2 BENCH=$b/epflow-bench OUT=$out bash experiments/step_spread/steady.sh > $log 2>&1
    python3 experiments/step_spread/steady_table.py $out/steady_output.txt
    ;;
  train)
    timeout 540 torchrun --standalone --nproc_per_node 2 examples/train_moe.py --dtype fp8 \
      > $log 2>&1
    tail -8 $log
    ;;
  *) echo "usage: $0 build|ctest|pytest|steps|train ..." >&2; exit 2 ;;
  esac
done
