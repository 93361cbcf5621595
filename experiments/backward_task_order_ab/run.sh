#!/usr/bin/env bash
# Builds the tree as it is and once per patch here (each in /tmp/var_NAME), then times the FP8 and
# bf16 backward at DeepSeek-V3, 8192 tokens, two rounds in alternating order. Run from the
# repository root on a GPU machine (NCCL_ROOT as scripts/build.sh finds it).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL_ROOT=${NCCL_ROOT:-$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])')}
here=experiments/backward_task_order_ab
vars="base no_x_pull dhp_n_fastest no_lag"
for v in $vars; do
  d=/tmp/var_$v; rm -rf $d; mkdir -p $d
  cp -r CMakeLists.txt cmake src include bench tests examples python scripts $d/
  [ -d .deps ] && ln -sfn $PWD/.deps $d/.deps
  [ $v = base ] || (cd $d && patch -s -p1 < $OLDPWD/$here/$v.patch) || { echo "patch $v failed"; exit 1; }
  ( cmake -S $d -B $d/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPFLOW_BUILD_TESTS=OFF \
      -DEPFLOW_NCCL_ROOT=$NCCL_ROOT > $d/cfg.log 2>&1 &&
    cmake --build $d/build -j 4 --target epflow-bench > $d/build.log 2>&1 || echo "build $v failed" ) &
done
wait
for round in 1 2; do
  order="$vars"; [ $round = 2 ] && order=$(echo $vars | tr ' ' '\n' | tac | tr '\n' ' ')
  for v in $order; do
    echo "== $v, round $round"
    /tmp/var_$v/build/epflow-bench --dtype fp8 --backward --tokens 8192 --warmup 5 --iters 10 \
      --settle-ms 500 --baselines none | grep -E "backward  |its stages"
  done
done
