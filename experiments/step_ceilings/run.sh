#!/usr/bin/env bash
# Builds epflow-bench from the tree as it is (base) and once per patch (timing-only patches that
# take one part of the FP8 training step away; all_three: the three applied together), each in
# /tmp/sc_NAME, then times the FP8 and bf16 layers' backward and training step of each at
# DeepSeek-V3, one process per token count, two rounds in alternating order, with nvidia-smi
# sampling the SM clock and power beside them. Run from the repository root on a GPU machine.
# Environment: TOKENS (default "512,2048,8192"), VARIANTS (default: base and every patch here,
# then all_three), OUT (where the clock samples go; default /tmp).
set -uo pipefail
singles="no_transposed_requant no_wgrad_epilogue no_operand_passes"
vars=${VARIANTS:-"base $singles all_three"}
out=${OUT:-/tmp}
patches=$(mktemp -d)
cp experiments/step_ceilings/*.patch $patches/
for p in $singles; do cat experiments/step_ceilings/$p.patch; done > $patches/all_three.patch
source experiments/build_variants.sh
build_variants $patches /tmp/sc $vars || exit 1
echo "built at ${SECONDS}s"
nvidia-smi -i 0 --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv,noheader -lms 100 > $out/step_ceilings_smi.csv 2>/dev/null &
smi=$!
: > $out/step_ceilings_marks.txt
MARKS=$out/step_ceilings_marks.txt PER_TOKEN_PROCESS=1 time_variants /tmp/sc ${TOKENS:-512,2048,8192} \
  "tokens/rank|backward  |its stages|training step|FP8 over" $vars
kill $smi 2>/dev/null
echo "== clocks"
python3 bench/clock_windows.py $out/step_ceilings_smi.csv $out/step_ceilings_marks.txt
