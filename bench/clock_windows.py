#!/usr/bin/env python3
"""SM clock and board power while each benchmark ran, from nvidia-smi samples taken beside it: are
the kernels power-bound, and at what clock? (The FP8 GEMMs on an H200 run at its software power
cap: the clock, and with it the figures, moves from one window to the next.)

    nvidia-smi -i 0 --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,\\
        clocks_event_reasons.active --format=csv,noheader -lms 50 > smi.csv &
    echo "LABEL begin $(date +%s.%N)" >> marks.txt; BENCHMARK
    echo "LABEL end $(date +%s.%N)" >> marks.txt
    bench/clock_windows.py smi.csv marks.txt

Per window (its first second left out: start-up), over the samples drawing more than 300 W (the
kernels running): the median and lowest SM clock, median and highest power, and how many samples
carried each clock-event reason mask (0x4: the software power cap). bench/run_all.py samples the
same way (Sampler) around each of its steps."""
from __future__ import annotations

import datetime
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUERY = ("timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,"
         "clocks_event_reasons.active")
BUSY_WATTS = 300


def read_samples(smi_csv: Path) -> list[tuple[float, float, float, str]]:
    """(time, SM MHz, watts, reason mask) per sample line; header or cut lines are skipped."""
    samples = []
    for line in smi_csv.read_text().splitlines():
        p = [x.strip() for x in line.split(",")]
        try:
            t = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((t, float(p[1].split()[0]), float(p[3].split()[0]), p[5]))
        except (IndexError, ValueError):
            continue
    return samples


def read_marks(marks: Path) -> dict[str, dict[str, float]]:
    """{label: {"begin": t, "end": t}} from "LABEL begin|end SECONDS" lines, in file order."""
    windows: dict[str, dict[str, float]] = {}
    for line in marks.read_text().splitlines():
        w = line.split()
        if len(w) >= 3:
            windows.setdefault(" ".join(w[:-2]), {})[w[-2]] = float(w[-1])
    return windows


def summarize(smi_csv: Path, marks: Path) -> list[str]:
    """One line per window: its busy samples' clock and power (module docstring)."""
    samples = read_samples(smi_csv)
    lines = []
    for label, w in read_marks(marks).items():
        if "begin" not in w or "end" not in w:
            continue
        inside = [s for s in samples if w["begin"] + 1.0 <= s[0] <= w["end"]]
        busy = [s for s in inside if s[2] > BUSY_WATTS]
        if not busy:
            lines.append(f"{label}: no busy samples ({len(inside)} in the window)")
            continue
        clocks, power = [s[1] for s in busy], [s[2] for s in busy]
        reasons: dict[str, int] = {}
        for s in busy:
            reasons[s[3]] = reasons.get(s[3], 0) + 1
        lines.append(f"{label:16s} samples {len(busy):4d}  SM MHz median "
                     f"{statistics.median(clocks):.0f} min {min(clocks):.0f}  power W median "
                     f"{statistics.median(power):.0f} max {max(power):.0f}  reasons {reasons}")
    return lines


class Sampler:
    """nvidia-smi sampling GPU 0 into a temporary folder of its own while it is open, with
    mark(label, "begin" | "end") around each step; close() stops it, removes the folder and
    returns the summary lines. A machine without nvidia-smi (or one that fails) gets no samples
    and no error: the clocks are context for the figures, never a reason to lose them."""

    def __init__(self, period_ms: int = 100):
        self.proc = None
        self.folder = Path(tempfile.mkdtemp(prefix="epflow-clocks-"))
        self.smi_csv, self.marks = self.folder / "smi.csv", self.folder / "marks.txt"
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return
        try:
            self.marks.write_text("")
            self.proc = subprocess.Popen(
                [exe, "-i", "0", f"--query-gpu={QUERY}", "--format=csv,noheader",
                 "-lms", str(period_ms)], stdout=self.smi_csv.open("w"),
                stderr=subprocess.DEVNULL)
        except OSError:
            self.proc = None

    def mark(self, label: str, edge: str) -> None:
        if self.proc is not None:
            with self.marks.open("a") as f:
                f.write(f"{label} {edge} {time.time():.3f}\n")

    def close(self) -> list[str]:
        lines = []
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            try:
                lines = summarize(self.smi_csv, self.marks)
            except (OSError, ValueError):
                pass
        shutil.rmtree(self.folder, ignore_errors=True)
        return lines


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    for line in summarize(Path(sys.argv[1]), Path(sys.argv[2])):
        print(line)


if __name__ == "__main__":
    main()
