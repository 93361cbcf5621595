#!/usr/bin/env python3
"""A markdown table of ablate.py runs: each configuration's roundings, its final loss and its
distance from `none`'s, from one or more of ablate.py's outputs (every configuration once);
with --horizons, the final loss at each horizon too.
Usage: summarize.py OUTPUT.txt [...]"""
import re
import sys

LINE = re.compile(r"^== (?P<name>\S+) \(roundings: (?P<on>[^)]*)\): final loss (?P<loss>[\d.]+)")
AT = re.compile(r"^== (?P<name>\S+) at step (?P<step>\d+): final loss (?P<loss>[\d.]+)")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    runs, at = {}, {}
    for path in sys.argv[1:]:
        for line in open(path):
            if m := LINE.match(line):
                runs[m["name"]] = (m["on"], float(m["loss"]))
            elif m := AT.match(line):
                at.setdefault(m["name"], {})[int(m["step"])] = float(m["loss"])
    if "none" not in runs:
        sys.exit("summarize.py: no `none` run among the outputs")
    steps = sorted({s for v in at.values() for s in v}) if at.get("none") else []
    if steps:  # the final loss and its distance from `none`'s at each horizon
        print("| configuration | roundings on | " +
              " | ".join(f"step {s}: final loss (against `none`)" for s in steps) + " |")
        print("|---|---|" + "---:|" * len(steps))
        for name, (on, _) in runs.items():
            cells = [f"{at[name][s]:.5f} ({100 * (at[name][s] / at['none'][s] - 1):+.1f}%)"
                     for s in steps]
            print(f"| {name} | {on} | " + " | ".join(cells) + " |")
        return
    base = runs["none"][1]
    print("| configuration | roundings on | final loss | against `none` |")
    print("|---|---|---:|---:|")
    for name, (on, loss) in runs.items():
        print(f"| {name} | {on} | {loss:.5f} | {100 * (loss / base - 1):+.1f}% |")


if __name__ == "__main__":
    main()
