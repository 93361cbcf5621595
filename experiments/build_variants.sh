# Sourced by an experiment's run.sh (from the repository root): build_variants PATCH_DIR PREFIX
# VARIANT... copies the tree to PREFIX_VARIANT for each variant, applies PATCH_DIR/VARIANT.patch
# (none for "base") and builds epflow-bench there, the variants in parallel. Sourcing it sets
# the no-multicast environment and NCCL_ROOT (the nvidia-nccl wheel's, unless set).
# VARIANT_TESTS="test_a test_b": those GPU tests are built too (GoogleTest from
# .deps/googletest, as scripts/build.sh takes it on the GPU machine).
# time_variants PREFIX TOKENS PATTERN VARIANT... then times each variant's FP8 (and bf16) backward
# with epflow-bench at TOKENS, two rounds (ROUNDS), the even ones in reverse order, keeping the
# lines that match PATTERN; PER_TOKEN_PROCESS=1: a process per token count; MARKS=FILE: a
# "VARIANT TOKENS ROUND begin|end SECONDS" line around each run (bench/clock_windows.py's marks).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL_ROOT=${NCCL_ROOT:-$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])')}
build_variants() {
  local here=$1 prefix=$2 v d
  shift 2
  local jobs=$(( $(nproc) / $# > 1 ? $(nproc) / $# : 1 ))
  for v in "$@"; do
    d=${prefix}_$v; rm -rf $d; mkdir -p $d
    cp -r CMakeLists.txt cmake src include bench tests examples python scripts $d/
    [ -d .deps ] && ln -sfn $PWD/.deps $d/.deps
    [ $v = base ] || (cd $d && patch -s -p1 < $OLDPWD/$here/$v.patch) || { echo "patch $v failed"; return 1; }
    local tests=(-DEPFLOW_BUILD_TESTS=OFF)
    [ -n "${VARIANT_TESTS:-}" ] && tests=(-DEPFLOW_BUILD_TESTS=ON)
    [ -n "${VARIANT_TESTS:-}" ] && [ -d .deps/googletest ] &&
      tests+=(-DEPFLOW_GTEST_SOURCE_DIR=$PWD/.deps/googletest)
    ( cmake -S $d -B $d/build -G Ninja -DCMAKE_BUILD_TYPE=Release "${tests[@]}" \
        -DEPFLOW_NCCL_ROOT=$NCCL_ROOT > $d/cfg.log 2>&1 &&
      cmake --build $d/build -j $jobs --target epflow-bench ${VARIANT_TESTS:-} > $d/build.log 2>&1 ||
      echo "build $v failed" ) &
  done
  wait
}

time_variants() {
  local prefix=$1 tokens=$2 pattern=$3 round v order t
  shift 3
  # Token counts in one process each (PER_TOKEN_PROCESS=1, outermost) or all in one.
  local groups=$tokens
  [ -n "${PER_TOKEN_PROCESS:-}" ] && groups=$(echo $tokens | tr ',' ' ')
  for t in $groups; do
    for round in $(seq 1 ${ROUNDS:-2}); do
      order="$*"; [ $((round % 2)) = 0 ] && order=$(echo "$@" | tr ' ' '\n' | tac | tr '\n' ' ')
      for v in $order; do
        [ -x ${prefix}_$v/build/epflow-bench ] || { echo "== $v: no build"; continue; }
        echo "== $v, round $round"
        [ -n "${MARKS:-}" ] && echo "$v $t $round begin $(date +%s.%N)" >> $MARKS
        ${prefix}_$v/build/epflow-bench --dtype fp8 --backward --tokens $t --warmup 5 --iters 10 \
          --settle-ms 500 --baselines none | grep -E "$pattern"
        [ -n "${MARKS:-}" ] && echo "$v $t $round end $(date +%s.%N)" >> $MARKS
      done
    done
  done
}
