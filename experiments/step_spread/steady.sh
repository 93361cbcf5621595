#!/usr/bin/env bash
# The FP8 and bf16 training steps as a training loop sees them (README.md): on a GPU machine,
# from the repository root, epflow-bench built once (Release, no tests), then at each token
# count of TOKENS (default 2048,8192,512) one process of `epflow-bench --dtype fp8 --backward`
# with long loops (--warmup 200 before each timed loop of --iters 100, 2 s settling) and
# --repeats 3 (FP8 and bf16 alternate: every figure is the median of three), SM clock, power and
# throttle reasons sampled every 200 ms throughout (every GPU's). Outputs to $OUT (default
# /tmp): steady_output.txt (the consoles) and steady_clocks.csv. About 6 minutes on one H200.
# EP=2: both GPUs of a two-GPU machine (the bench's --ep). BENCH=path: an epflow-bench already
# built (otherwise this builds one in /tmp/steady_build).
set -uo pipefail
out=${OUT:-/tmp}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
bench=${BENCH:-}
if [ -z "$bench" ]; then
  NCCL_ROOT=${NCCL_ROOT:-$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])')}
  b=/tmp/steady_build
  cmake -S . -B $b -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPFLOW_BUILD_TESTS=OFF \
    -DEPFLOW_NCCL_ROOT=$NCCL_ROOT > /tmp/steady_cfg.log 2>&1 &&
    cmake --build $b -j "$(nproc)" --target epflow-bench > /tmp/steady_build.log 2>&1 ||
    { tail -30 /tmp/steady_cfg.log /tmp/steady_build.log; exit 1; }
  bench=$b/epflow-bench
fi
nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 200 > $out/steady_clocks.csv 2>/dev/null &
sampler=$!
for t in $(echo ${TOKENS:-2048,8192,512} | tr ',' ' '); do
  echo "== $t tokens/rank, begin $(date +%s.%N)"
  $bench --ep ${EP:-1} --dtype fp8 --backward --tokens $t --warmup ${WARMUP:-200} --iters ${ITERS:-100} \
    --settle-ms 2000 --repeats ${REPEATS:-3} --baselines none
  echo "== $t tokens/rank, end $(date +%s.%N)"
done 2>&1 | tee $out/steady_output.txt
kill $sampler
