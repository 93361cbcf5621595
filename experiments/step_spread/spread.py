#!/usr/bin/env python3
"""How far the training-step figures move between runs of the same tree: every unpatched
("base") round of the A/B outputs given (build_variants.sh's time_variants: epflow-bench
--dtype fp8 --backward, 5 + 10 calls, 0.5 s settling, a process per token count), per token
count the median and range of the FP8 step, the bf16 step, their ratio, the bf16 backward and
forward alone and the bf16 step's own backward and forward parts. Usage: spread.py OUTPUT.txt..."""
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ab_output import tagged_lines  # noqa: E402

BACKWARD = re.compile(r"\s+epflow backward\s+([\d.]+)")
FORWARD = re.compile(r"\s+epflow\s+([\d.]+)\s+[\d.]+\s+[\d.]+x")
STEP = re.compile(r"\s+(epflow-fp8|epflow) training step\s+([\d.]+)\s+[\d.]+\s+\((.*)\)")
PART = re.compile(r"(forward keeping g\|u|backward) ([\d.]+)")
COLUMNS = ["FP8 step", "bf16 step", "FP8 over bf16 step", "bf16 backward alone",
           "bf16 step: its backward", "bf16 forward alone", "bf16 step: its forward"]


def rounds(paths):
    """(tokens, quantity) -> values, one per base round."""
    out = defaultdict(list)
    for path in paths:
        current = {}
        for variant, tokens, line in tagged_lines(path, "== clocks"):
            if variant != "base":
                continue
            if m := FORWARD.match(line):
                out[(tokens, "bf16 forward alone")].append(float(m.group(1)))
            elif m := BACKWARD.match(line):
                out[(tokens, "bf16 backward alone")].append(float(m.group(1)))
            elif m := STEP.match(line):
                if m.group(1) == "epflow-fp8":
                    current[tokens] = float(m.group(2))
                    continue
                bf16 = float(m.group(2))
                parts = dict((k, float(v)) for k, v in PART.findall(m.group(3)))
                out[(tokens, "bf16 step")].append(bf16)
                out[(tokens, "bf16 step: its backward")].append(parts["backward"])
                out[(tokens, "bf16 step: its forward")].append(parts["forward keeping g|u"])
                if tokens in current:
                    out[(tokens, "FP8 step")].append(current[tokens])
                    out[(tokens, "FP8 over bf16 step")].append(bf16 / current.pop(tokens))
    return out


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    data = rounds(sys.argv[1:])
    counts = sorted({t for t, _ in data})
    print(f"{len(sys.argv) - 1} outputs; median [min .. max] over the base rounds (µs, ratios x):\n")
    print("| tokens | rounds | " + " | ".join(COLUMNS) + " |")
    print("|---:|---:|" + "---:|" * len(COLUMNS))
    for t in counts:
        cells = []
        for q in COLUMNS:
            v = data[(t, q)]
            f = "{:.2f}" if q == "FP8 over bf16 step" else "{:.0f}"
            cells.append(f"{f.format(statistics.median(v))} [{f.format(min(v))} .. {f.format(max(v))}]")
        print(f"| {t} | {len(data[(t, 'bf16 step')])} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
