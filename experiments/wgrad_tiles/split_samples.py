#!/usr/bin/env python3
"""Which source lines' warp-stall samples grow with a GEMM's tiles and which with its K blocks.

    experiments/wgrad_tiles/split_samples.py SOURCE_K1.csv K1 SOURCE_K2.csv K2 [--top N]

Two ncu source pages (experiments/dhp_stall_ab/ncu_source.sh's *_source.csv) of the same
kernel with the same tiles and K1, K2 K blocks per tile (the FP8 weight gradients at 2048 and
8192 tokens per rank: 4 and 16). Samples are taken at a fixed rate per SM, so a line's count is
tiles x (x + K y): per line, x (its samples per tile, counted over all tiles) and y (per K block)
from the two counts. Prints the per-tile part's share of the first run's samples and the lines
with the largest per-tile part, with their top stall reasons.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dhp_stall_ab"))
from source_stalls import read_source_csv  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv1")
    ap.add_argument("k1", type=int)
    ap.add_argument("csv2")
    ap.add_argument("k2", type=int)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    s1, r1, _, t1 = read_source_csv(args.csv1)
    s2, r2, _, t2 = read_source_csv(args.csv2)
    per_tile, per_block = {}, {}
    for line in set(s1) | set(s2):
        per_block[line] = (s2[line] - s1[line]) / (args.k2 - args.k1)
        per_tile[line] = s1[line] - args.k1 * per_block[line]
    total1, tiles = sum(s1.values()), sum(per_tile.values())
    print(f"samples: {total1} (K {args.k1}), {sum(s2.values())} (K {args.k2}); the part per tile: "
          f"{tiles:.0f}, {100 * tiles / total1:.0f}% of the first; per K block x {args.k1}: "
          f"{args.k1 * sum(per_block.values()):.0f}")
    print(f"{'per tile':>9} {'share':>6} {'K1':>7} {'K2':>7}  line | top stall reasons (K1)")
    for line, x in sorted(per_tile.items(), key=lambda kv: -kv[1])[: args.top]:
        top = ", ".join(f"{r} {c}" for r, c in (r1[line] + r2[line]).most_common(2))
        text = t1.get(line) or t2.get(line)
        print(f"{x:9.0f} {100 * x / tiles:5.1f}% {s1[line]:7d} {s2[line]:7d}  {line[0]}:{line[1]} "
              f"{text[:60]} | {top}")


if __name__ == "__main__":
    main()
