#!/usr/bin/env bash
# Builds epflow-bench from the tree as it is and once per patch (timing-only patches that take
# one part of the FP8 training step away), each in /tmp/sc_NAME, then times the FP8 and bf16
# layers' backward and training step of each at DeepSeek-V3, one process per token count (the
# operand-pass patch runs the passes in a process's first calls only), two rounds in alternating
# order, with nvidia-smi sampling the SM clock and power beside them. Run from the repository
# root on a GPU machine. Environment: TOKENS (default "512 2048 8192"), VARIANTS (default: base
# and every patch here), OUT (where the clock samples go; default /tmp).
set -uo pipefail
here=experiments/step_ceilings
vars=${VARIANTS:-"base no_transposed_requant no_wgrad_epilogue no_operand_passes all_three"}
out=${OUT:-/tmp}
source experiments/build_variants.sh
build_variants $here /tmp/sc $vars || exit 1
echo "built at ${SECONDS}s"
nvidia-smi -i 0 --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv,noheader -lms 100 > $out/step_ceilings_smi.csv 2>/dev/null &
smi=$!
: > $out/step_ceilings_marks.txt
pattern="tokens/rank|backward  |its stages|training step|FP8 over"
for tokens in ${TOKENS:-512 2048 8192}; do
  for round in 1 2; do
    order="$vars"; [ $round = 2 ] && order=$(echo $vars | tr ' ' '\n' | tac | tr '\n' ' ')
    for v in $order; do
      [ -x /tmp/sc_$v/build/epflow-bench ] || { echo "== $v: no build"; continue; }
      echo "== $v, round $round"
      echo "$v $tokens $round begin $(date +%s.%N)" >> $out/step_ceilings_marks.txt
      /tmp/sc_$v/build/epflow-bench --dtype fp8 --backward --tokens $tokens --warmup 5 --iters 10 \
        --settle-ms 500 --baselines none | grep -E "$pattern"
      echo "$v $tokens $round end $(date +%s.%N)" >> $out/step_ceilings_marks.txt
    done
  done
done
kill $smi 2>/dev/null
echo "== clocks"
python3 bench/clock_windows.py $out/step_ceilings_smi.csv $out/step_ceilings_marks.txt
