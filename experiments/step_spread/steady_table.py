#!/usr/bin/env python3
"""The table of docs/benchmarks.md's "The training steps in long loops" from steady.sh's
steady_output.txt: per token count, the FP8 and bf16 backward and training step (medians over
the repeats, as epflow-bench prints them) and their ratios. No GPU needed.

Usage: experiments/step_spread/steady_table.py steady_output.txt"""
import re
import sys

BACKWARD = re.compile(r"^  (epflow-fp8|epflow) backward +([\d.]+)")
STEP = re.compile(r"^  (epflow-fp8|epflow) training step +([\d.]+) .*\((.*)\)")
PART = re.compile(r"([\d.]+)")


def main(path: str) -> None:
    points: dict[int, dict] = {}
    tokens = None
    for line in open(path):
        if m := re.match(r"^== (\d+) tokens/rank, begin", line):
            tokens = int(m.group(1))
            points[tokens] = {}
        elif tokens is not None and (m := BACKWARD.match(line)):
            points[tokens][m.group(1) + " backward"] = float(m.group(2))
        elif tokens is not None and (m := STEP.match(line)):
            parts = [float(x) for x in PART.findall(m.group(3).split("(")[0])]
            points[tokens][m.group(1) + " step"] = (float(m.group(2)), parts)
    print("| tokens | FP8 backward | bf16 backward | FP8 speedup | FP8 step (re-quantization + "
          "forward + backward) | bf16 step (forward + backward) | FP8 step speedup |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for t in sorted(points):
        p = points[t]
        fb, bb = p["epflow-fp8 backward"], p["epflow backward"]
        (fs, fparts), (bs, bparts) = p["epflow-fp8 step"], p["epflow step"]
        parts = lambda xs: " + ".join(f"{x:.0f}" for x in xs)  # noqa: E731
        print(f"| {t} | {fb:.0f} | {bb:.0f} | {bb / fb:.2f}x | {fs:.0f} ({parts(fparts)}) | "
              f"{bs:.0f} ({parts(bparts)}) | {bs / fs:.2f}x |")


if __name__ == "__main__":
    main(sys.argv[1])
