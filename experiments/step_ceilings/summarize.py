#!/usr/bin/env python3
"""Table of a run.sh output: per token count and variant, the means over the rounds of the FP8
training step and its parts (µs), the FP8 backward alone and its weight-gradient stage, the
step's change against the unpatched tree, and the step against the unpatched tree's bf16 step
(each patch also changes the bf16 layer's step where it shares the code: the weight-gradient
epilogue). Usage: summarize.py OUTPUT.txt"""
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ab_output import tagged_lines  # noqa: E402

STEP = re.compile(r"\s+(epflow-fp8|epflow) training step\s+([\d.]+)\s+[\d.]+\s+\((.*)\)")
PART = re.compile(r"(weight re-quantization|forward keeping g\|u|backward) ([\d.]+)")


def parse(path):
    runs = defaultdict(list)  # (variant, tokens, quantity) -> values
    system = None
    for variant, tokens, line in tagged_lines(path, "== clocks"):
        if m := re.match(r"\s+(epflow-fp8|epflow) backward\s+([\d.]+)", line):
            system = m.group(1)
            if system == "epflow-fp8":
                runs[(variant, tokens, "backward alone")].append(float(m.group(2)))
        elif (m := re.search(r"weight gradients ([\d.]+);", line)) and system == "epflow-fp8":
            runs[(variant, tokens, "wgrad")].append(float(m.group(1)))
        elif m := STEP.match(line):
            if m.group(1) == "epflow":
                runs[(variant, tokens, "bf16 step")].append(float(m.group(2)))
                continue
            runs[(variant, tokens, "step")].append(float(m.group(2)))
            for name, value in PART.findall(m.group(3)):
                runs[(variant, tokens, name)].append(float(value))
    return runs


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    runs = parse(sys.argv[1])
    mean = lambda k: sum(runs[k]) / len(runs[k]) if runs.get(k) else float("nan")
    variants = list(dict.fromkeys(k[0] for k in runs))
    rounds = len(runs[(variants[0], min(k[1] for k in runs), "step")])
    print(f"`{sys.argv[1].split('/')[-1]}` (µs, mean of {rounds} rounds):\n")
    print("| tokens | variant | FP8 step | re-quantization | forward | backward in the step "
          "| FP8 backward alone | its weight-gradient stage | step against base | "
          "step speedup over base's bf16 step |")
    print("|---:|---|" + "---:|" * 8)
    for t in sorted({k[1] for k in runs}):
        base, bf16 = mean(("base", t, "step")), mean(("base", t, "bf16 step"))
        for v in variants:
            step = mean((v, t, "step"))
            cells = [step] + [mean((v, t, q)) for q in
                              ("weight re-quantization", "forward keeping g|u", "backward",
                               "backward alone", "wgrad")]
            print(f"| {t} | {v} | " + " | ".join(f"{c:.0f}" for c in cells) +
                  f" | {step - base:+.0f} | {bf16 / step:.2f}x |")
    print("\nbase's bf16 step: " + ", ".join(
        f"{t}: {mean(('base', t, 'bf16 step')):.0f}" for t in sorted({k[1] for k in runs})))


if __name__ == "__main__":
    main()
