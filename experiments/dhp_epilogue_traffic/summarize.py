#!/usr/bin/env python3
"""Per variant and token count, the mean over rounds of the backward megakernel (FP8 and bf16),
the FP8 backward, its weight-gradient stage and the FP8 training step, from the console of
run.sh (time_variants' output):  summarize.py OUTPUT.txt"""
import collections
import re
import statistics
import sys

HEAD = re.compile(r"^== (\S+), round (\d+)")
TOKENS = re.compile(r"\), (\d+) tokens/rank, ")
BWD = re.compile(r"^\s+(epflow-fp8|epflow) backward\s+([\d.]+)")
STAGES = re.compile(r"megakernel \(dy, x pull; dhp \+ SwiGLU bwd; dx push\) ([\d.]+);.*weight gradients ([\d.]+)")
STEP = re.compile(r"^\s+epflow-fp8 training step\s+([\d.]+)")


def main():
    rows = collections.defaultdict(lambda: collections.defaultdict(list))
    variant = tokens = layer = None
    for line in open(sys.argv[1]):
        if m := HEAD.match(line):
            variant = m.group(1)
        elif m := TOKENS.search(line):
            tokens = int(m.group(1))
        elif m := BWD.match(line):
            layer = m.group(1)
            rows[(tokens, variant)][layer + " backward"].append(float(m.group(2)))
        elif (m := STAGES.search(line)) and layer:
            rows[(tokens, variant)][layer + " megakernel"].append(float(m.group(1)))
            rows[(tokens, variant)][layer + " wgrad stage"].append(float(m.group(2)))
        elif m := STEP.match(line):
            rows[(tokens, variant)]["epflow-fp8 step"].append(float(m.group(1)))
    cols = ["epflow-fp8 megakernel", "epflow megakernel", "epflow-fp8 backward",
            "epflow-fp8 wgrad stage", "epflow-fp8 step", "epflow backward"]
    print("| tokens | variant | rounds | " + " | ".join(c.replace("epflow-fp8", "FP8").replace("epflow", "bf16") for c in cols) + " |")
    print("|---:|---|---:|" + "---:|" * len(cols))
    for (t, v), d in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1] != "base", kv[0][1])):
        n = len(d["epflow-fp8 megakernel"])
        vals = [f"{statistics.mean(d[c]):.0f}" if d[c] else "" for c in cols]
        print(f"| {t} | {v} | {n} | " + " | ".join(vals) + " |")


if __name__ == "__main__":
    main()
