#!/usr/bin/env python3
"""The FP8 backward megakernel's stage time per variant and token count from run.sh's console
(experiments/build_variants.sh's time_variants output): the mean over rounds of the
"megakernel" stage of each round's FP8 backward, and the difference against base.

Usage: experiments/dgrad_transpose/summarize.py OUTPUT"""
import re
import statistics
import sys


def main(path: str) -> None:
    runs: dict[tuple[int, str], list[float]] = {}
    variant, tokens, fp8 = None, None, False
    for line in open(path):
        if m := re.match(r"^== (\S+), round \d+", line):
            variant = m.group(1)
        elif m := re.search(r"(\d+) tokens/rank", line):
            tokens = int(m.group(1))
        elif line.startswith("  epflow-fp8 backward"):
            fp8 = True
        elif fp8 and "its stages" in line:
            us = float(re.search(r"megakernel \([^)]*\) ([\d.]+)", line).group(1))
            runs.setdefault((tokens, variant), []).append(us)
            fp8 = False
    print("| tokens | variant | rounds | FP8 backward megakernel µs (mean) | against base |")
    print("|---:|---|---:|---:|---:|")
    for (t, v) in sorted(runs, key=lambda k: (k[0], k[1] != "base", k[1])):
        mean = statistics.mean(runs[(t, v)])
        base = statistics.mean(runs.get((t, "base"), [mean]))
        print(f"| {t} | {v} | {len(runs[(t, v)])} | {mean:.0f} | {mean - base:+.0f} |")


if __name__ == "__main__":
    main(sys.argv[1])
