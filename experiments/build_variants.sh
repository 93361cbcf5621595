# Sourced by an experiment's run.sh (from the repository root): build_variants PATCH_DIR PREFIX
# VARIANT... copies the tree to PREFIX_VARIANT for each variant, applies PATCH_DIR/VARIANT.patch
# (none for "base") and builds epflow-bench there, the variants in parallel. NCCL_ROOT as
# scripts/build.sh finds it.
build_variants() {
  local here=$1 prefix=$2 v d
  shift 2
  local jobs=$(( $(nproc) / $# > 1 ? $(nproc) / $# : 1 ))
  for v in "$@"; do
    d=${prefix}_$v; rm -rf $d; mkdir -p $d
    cp -r CMakeLists.txt cmake src include bench tests examples python scripts $d/
    [ -d .deps ] && ln -sfn $PWD/.deps $d/.deps
    [ $v = base ] || (cd $d && patch -s -p1 < $OLDPWD/$here/$v.patch) || { echo "patch $v failed"; return 1; }
    ( cmake -S $d -B $d/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPFLOW_BUILD_TESTS=OFF \
        -DEPFLOW_NCCL_ROOT=$NCCL_ROOT > $d/cfg.log 2>&1 &&
      cmake --build $d/build -j $jobs --target epflow-bench > $d/build.log 2>&1 || echo "build $v failed" ) &
  done
  wait
}
