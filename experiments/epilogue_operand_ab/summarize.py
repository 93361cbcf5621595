#!/usr/bin/env python3
"""Tables of an A/B output of run.sh (or build_variants.sh's time_variants): per variant and
token count, the means over the rounds of the FP8 and bf16 backward, their megakernel and their
weight-gradient stage (µs), as markdown. Usage: summarize.py OUTPUT.txt [...]"""
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ab_output import tagged_lines  # noqa: E402


def parse(path):
    runs = defaultdict(list)  # (variant, tokens, dtype, quantity) -> values
    dtype = None
    for variant, tokens, line in tagged_lines(path, "== ncu"):
        if m := re.match(r"\s+(epflow-fp8|epflow) backward\s+([\d.]+)", line):
            dtype = "FP8" if m.group(1) == "epflow-fp8" else "bf16"
            runs[(variant, tokens, dtype, "backward")].append(float(m.group(2)))
        elif m := re.search(r"megakernel \(dy[^)]*\) ([\d.]+);.*weight gradients ([\d.]+)", line):
            runs[(variant, tokens, dtype, "megakernel")].append(float(m.group(1)))
            runs[(variant, tokens, dtype, "wgrad")].append(float(m.group(2)))
    return runs


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    cols = [(d, q) for d in ("FP8", "bf16") for q in ("megakernel", "wgrad", "backward")]
    for path in sys.argv[1:]:
        runs = parse(path)
        variants = list(dict.fromkeys(k[0] for k in runs))
        print(f"`{path.split('/')[-1]}` (µs, mean of {len(next(iter(runs.values())))} rounds):\n")
        print("| tokens | variant | " + " | ".join(f"{d} {q}" for d, q in cols) + " |")
        print("|---:|---|" + "---:|" * len(cols))
        for t in sorted({k[1] for k in runs}):
            for v in variants:
                vals = [runs.get((v, t, d, q)) for d, q in cols]
                cells = [f"{sum(x) / len(x):.0f}" if x else "" for x in vals]
                print(f"| {t} | {v} | " + " | ".join(cells) + " |")
        print()


if __name__ == "__main__":
    main()
