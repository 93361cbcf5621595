#!/usr/bin/env python3
"""Where an FP8 weight-gradient tile's time goes, from timeline.cu's stamps (README.md).

    experiments/wgrad_tiles/summarize.py STAMPS.csv...

Per shape: the median (10th, 90th percentile) of each phase of a tile, in SM cycles, over every
CTA's tiles but its first and last, for each consumer warpgroup: from taking the tile (its
coordinates, its K) to its first stage full; from there to its first turn on the tensor cores
(the mainloop's setup, the turn); to its first group issued; its groups, from the first issued
to the last complete; the last promotion; the epilogue's wait for its staging (the previous
tile's stores reading it); the rest of the epilogue (until its stores are issued); from there
back to the loop's top. Then the tile's
whole period (one tile start to the next), the producer's lead (its first load of the tile
issued before the warpgroup took it: positive = ahead), how far apart the two warpgroups' last
groups complete, and the producer's own: from taking the tile to its first stage free (its wait
for it), to that stage's loads issued, and from there to warpgroup 0 seeing that stage full.
With two K blocks or more: when each warpgroup releases the second K block's stage (from its
first group issued), and how long after warpgroup 1's release the producer finds the next
tile's first stage free (with 3 stages and 4 K blocks, that release frees it). With the stage
observer's stamps (timeline_stage_landing.patch, 29 slots): for each of the tile's first four K
blocks, its loads' issue to its stage full, and from block 0's stage full to warpgroup 0's wait
for it ending. The tensor cores' floor is 1024 cycles per K block (a 128 x 256 x 128 e4m3
block at 8192 FLOP per cycle and SM), both warpgroups' groups together.
"""
import csv
import statistics
import sys
from collections import defaultdict

FLOOR_PER_K_BLOCK = 1024
# kWgradStampSlots, at least 22: 0-2 and 19 the producer, 3 + 8 w .. 10 + 8 w and 20 + w
# warpgroup w; with 29, 22-25 the first four K blocks' stages full, 26-28 blocks 1-3 issued.
LANDING_SLOTS = 29


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def fmt(values):
    return f"{statistics.median(values):8.0f} ({pct(values, 0.1):.0f}..{pct(values, 0.9):.0f})"


def summarize(path):
    by_shape = defaultdict(lambda: defaultdict(dict))
    k_blocks = {}
    with open(path) as f:
        reader = csv.DictReader(f)
        slots = sum(1 for name in reader.fieldnames if name[0] == "s" and name[1:].isdigit())
        for row in reader:
            shape = f"{row['shape']} [{row['m']}, {row['n']}]"
            k_blocks[shape] = int(row["k_blocks"])
            by_shape[shape][int(row["cta"])][int(row["tile"])] = [
                int(row[f"s{i}"]) for i in range(slots)]
    for shape, ctas in by_shape.items():
        phases = defaultdict(list)
        for tiles in ctas.values():
            order = sorted(tiles)
            for i in order[1:-1]:
                s, nxt = tiles[i], tiles[i + 1]
                if 0 in s[:20] or 0 in nxt[:20]:
                    continue
                for w in (0, 1):
                    top, full, turn, issued, waited, kdone, free, epi = s[3 + 8 * w: 11 + 8 * w]
                    phases[f"wg{w}: tile taken, first stage full"].append(full - top)
                    phases[f"wg{w}: to its first turn"].append(turn - full)
                    phases[f"wg{w}: to its first group issued"].append(issued - turn)
                    phases[f"wg{w}: its groups"].append(waited - issued)
                    phases[f"wg{w}: last promotion"].append(kdone - waited)
                    phases[f"wg{w}: epilogue, staging free"].append(free - kdone)
                    phases[f"wg{w}: epilogue, stores issued"].append(epi - free)
                    phases[f"wg{w}: back to the loop top"].append(nxt[3 + 8 * w] - epi)
                    phases[f"wg{w}: tile period"].append(nxt[3 + 8 * w] - top)
                    phases[f"wg{w}: producer's first load ahead"].append(top - s[1])
                phases["wg1's last group after wg0's"].append(s[15] - s[7])
                phases["producer: tile start to its first stage free"].append(s[19] - s[0])
                phases["producer: first stage free to its loads issued"].append(s[1] - s[19])
                phases["producer: first loads issued to wg0 seeing them"].append(s[4] - s[1])
                if s[20] and s[21]:  # two K blocks or more: the releases of the second's stage
                    for w in (0, 1):
                        phases[f"wg{w}: 2nd K block released, from its first group issued"].append(
                            s[20 + w] - s[6 + 8 * w])
                    phases["producer: next tile's first stage free, from wg1's release"].append(
                        nxt[19] - s[21])
                if len(s) >= LANDING_SLOTS:
                    issued = [s[1], s[26], s[27], s[28]]
                    for b in range(min(4, k_blocks[shape])):
                        if s[22 + b] and issued[b]:
                            phases[f"K block {b}: loads issued to its stage full"].append(
                                s[22 + b] - issued[b])
                    if s[22]:
                        phases["K block 0: stage full to wg0's wait ending"].append(s[4] - s[22])
        kb = k_blocks[shape]
        print(f"{path}: {shape}, {kb} K blocks per tile (tensor floor {kb * FLOOR_PER_K_BLOCK}"
              f" cycles), {len(phases['wg0: tile period'])} tiles")
        for name, values in phases.items():
            print(f"  {name:58s} {fmt(values)}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for p in sys.argv[1:]:
        summarize(p)
