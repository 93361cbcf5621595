#!/usr/bin/env python3
"""A markdown table of ablate.py runs: each configuration's roundings, its final loss and its
distance from `none`'s, from one or more of ablate.py's outputs (every configuration once).
Usage: summarize.py OUTPUT.txt [...]"""
import re
import sys

LINE = re.compile(r"^== (?P<name>\S+) \(roundings: (?P<on>[^)]*)\): final loss (?P<loss>[\d.]+)")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    runs = {}
    for path in sys.argv[1:]:
        for line in open(path):
            if m := LINE.match(line):
                runs[m["name"]] = (m["on"], float(m["loss"]))
    if "none" not in runs:
        sys.exit("summarize.py: no `none` run among the outputs")
    base = runs["none"][1]
    print("| configuration | roundings on | final loss | against `none` |")
    print("|---|---|---:|---:|")
    for name, (on, loss) in runs.items():
        print(f"| {name} | {on} | {loss:.5f} | {100 * (loss / base - 1):+.1f}% |")


if __name__ == "__main__":
    main()
