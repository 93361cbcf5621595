#!/usr/bin/env python3
"""SM clock and board power while each benchmark ran, from nvidia-smi samples taken beside it: are
the kernels power-bound, and at what clock?

    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,\\
        clocks_event_reasons.active --format=csv,noheader -lms 50 > smi.csv &
    echo "LABEL begin $(date +%s.%N)" >> marks.txt; <benchmark>; echo "LABEL end $(date +%s.%N)" >> marks.txt
    bench/clock_windows.py smi.csv marks.txt

Per window (its first second left out: start-up), over the samples drawing more than 300 W (the
kernels running): the median and lowest SM clock, median and highest power, and how many samples
carried each clock-event reason mask (0x4: the software power cap)."""
import datetime
import statistics
import sys


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    samples = []
    with open(sys.argv[1]) as f:
        for line in f:
            p = [x.strip() for x in line.split(",")]
            try:
                t = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                samples.append((t, float(p[1].split()[0]), float(p[3].split()[0]), p[5]))
            except (IndexError, ValueError):
                continue  # a header or a cut line
    windows = {}
    with open(sys.argv[2]) as f:
        for line in f:
            w = line.split()
            windows.setdefault(" ".join(w[:-2]), {})[w[-2]] = float(w[-1])
    for label, w in windows.items():
        inside = [s for s in samples if w["begin"] + 1.0 <= s[0] <= w["end"]]
        busy = [s for s in inside if s[2] > 300]
        if not busy:
            print(f"{label}: no busy samples ({len(inside)} in the window)")
            continue
        clocks, power = [s[1] for s in busy], [s[2] for s in busy]
        reasons = {}
        for s in busy:
            reasons[s[3]] = reasons.get(s[3], 0) + 1
        print(f"{label:16s} samples {len(busy):4d}  SM MHz median {statistics.median(clocks):.0f} "
              f"min {min(clocks):.0f}  power W median {statistics.median(power):.0f} "
              f"max {max(power):.0f}  reasons {reasons}")


if __name__ == "__main__":
    main()
