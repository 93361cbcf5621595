#!/usr/bin/env bash
# Builds the tree as it is and once per patch here (each in /tmp/var_NAME), then times the FP8 and
# bf16 backward at DeepSeek-V3, 8192 tokens, two rounds in alternating order. Run from the
# repository root on a GPU machine (NCCL_ROOT as scripts/build.sh finds it).
set -uo pipefail
here=experiments/backward_task_order_ab
vars="base no_x_pull dhp_n_fastest no_lag"
source experiments/build_variants.sh
build_variants $here /tmp/var $vars || exit 1
time_variants /tmp/var 8192 "backward  |its stages" $vars
