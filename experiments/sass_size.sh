#!/usr/bin/env bash
# SASS size per kernel, and per source file of one kernel, without a GPU: the instruction-cache
# question (a kernel's hot loop larger than the cache is fetched again on every pass) can be
# asked on the CPU machine. Uses cuobjdump and nvdisasm from NVIDIA's PyPI wheels
# (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm), fetched into .deps/sass-tools on first use.
#
#   experiments/sass_size.sh OBJECT.o...             instructions per kernel of each object
#   experiments/sass_size.sh --lines OBJECT.o REGEX  per source file (and top lines) of the
#                                                    kernels matching REGEX; the object must be
#                                                    compiled with -lineinfo
# Objects: build/src/CMakeFiles/epflow.dir/kernels/... (ninja -t commands OBJ prints the line to
# recompile one with -lineinfo added).
set -euo pipefail
cd "$(dirname "$0")/.."
tools=.deps/sass-tools
if [ ! -x $tools/nvidia/cu13/bin/nvdisasm ] || [ ! -x $tools/nvidia/cu13/bin/cuobjdump ]; then
  mkdir -p $tools
  python3 -m pip download -q --no-deps -d $tools/wheels nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
  for w in $tools/wheels/*.whl; do python3 -m zipfile -e "$w" $tools; done
  chmod +x $tools/nvidia/cu13/bin/*
fi
export PATH=$PWD/$tools/nvidia/cu13/bin:$PATH
if [ "${1:-}" = --lines ]; then
  obj=$(realpath "$2") regex=$3 dir=$(mktemp -d)
  (cd $dir && cuobjdump -xelf all "$obj" > /dev/null)
  for cubin in $dir/*.cubin; do nvdisasm --print-line-info "$cubin"; done | python3 -c '
import collections, re, sys
regex = re.compile(sys.argv[1])
kernel, line, counts = None, None, collections.defaultdict(collections.Counter)
for text in sys.stdin:
    if text.startswith(".text."):
        name = text[len(".text."):].strip().rstrip(":")
        kernel = name if regex.search(name) else None
        continue
    m = re.match(r"\s*//## File \"([^\"]+)\", line (\d+)", text)
    if m:
        line = (m.group(1).split("/")[-1], int(m.group(2)))
    elif kernel and re.match(r"\s+/\*[0-9a-f]+\*/\s", text):
        counts[kernel][line] += 1
for kernel, lines in counts.items():
    files = collections.Counter()
    for (f, _), n in lines.items():
        files[f] += n
    print(f"{sum(lines.values())} instructions: {kernel[:120]}")
    for f, n in files.most_common(12):
        print(f"  {n:6d}  {f}")
    print("  top lines:", ", ".join(f"{f}:{l} {n}" for (f, l), n in lines.most_common(8)))
' "$regex"
  rm -rf $dir
  exit 0
fi
for obj in "$@"; do
  cuobjdump -sass "$obj" | awk -v o="$(basename "$obj")" '
    /Function :/ { if (f) print n, o, f; f = $3; n = 0; next }
    /^ +\/\*[0-9a-f]+\*\/ / { n++ }
    END { if (f) print n, o, f }'
done | sort -rn
