#!/usr/bin/env python3
"""Summarises megakernel traces (epflow-bench --trace PREFIX writes PREFIX-<preset>-<tokens>-
rank<r>.csv): per rank, partition and task kind, how many tasks ran, how long they waited for
their counters (taken -> ready) and how long they ran (ready -> done; for compute tasks the
producer's view: all loads issued), and how much of the kernel's span each partition spent
waiting; then the consumers' view of the GEMM tiles (first stage to epilogue handed off, and
the wait for a tile's first stage). With --png, draws a timeline: a row per CTA, grey while a
task waits, coloured while it runs.

Usage: bench/trace_summary.py TRACE.csv [TRACE.csv ...] [--png timeline.png]"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections import defaultdict
from pathlib import Path

# Forward: gate_up and down GEMM tiles; backward pass (-bwd.csv): dhp and dx.
COLORS = {"dispatch": "C0", "gate_up": "C1", "down": "C2", "dhp": "C1", "dx": "C2"}


def load(paths: list[Path]) -> list[dict]:
    rows = []
    for p in paths:
        with p.open() as f:
            for r in csv.DictReader(f):
                for k in ("rank", "cta", "task"):
                    r[k] = int(r[k])
                for k in ("taken_us", "ready_us", "done_us"):
                    r[k] = float(r[k])
                # GEMM tasks: the first consumer warpgroup's times (empty for dispatch tasks).
                for k in ("consumer_wait_us", "consumer_begin_us", "consumer_end_us"):
                    r[k] = float(r[k]) if r.get(k) else None
                r["file"] = p.name
                rows.append(r)
    return rows


def summarise(rows: list[dict]) -> None:
    groups = defaultdict(list)
    for r in rows:
        groups[(r["file"], r["partition"], r["kind"])].append(r)
    print("| trace | partition | kind | tasks | wait µs (median / p90) | run µs (median) "
          "| waiting share of the partition's task time |")
    print("|---|---|---|---|---|---|---|")
    for (file, part, kind), rs in sorted(groups.items()):
        waits = sorted(r["ready_us"] - r["taken_us"] for r in rs)
        runs = [r["done_us"] - r["ready_us"] for r in rs]
        share = sum(waits) / max(sum(waits) + sum(runs), 1e-9)
        print(f"| {file} | {part} | {kind} | {len(rs)} | {statistics.median(waits):.1f} / "
              f"{waits[int(0.9 * (len(waits) - 1))]:.1f} | {statistics.median(runs):.1f} "
              f"| {100 * share:.0f}% |")
    # Span of each file's kernel, and where the compute producers had nothing to load.
    for file in sorted({r["file"] for r in rows}):
        rs = [r for r in rows if r["file"] == file]
        start = min(r["taken_us"] for r in rs)
        end = max(r["done_us"] for r in rs)
        print(f"\n{file}: megakernel span {end - start:.0f} µs (first task taken to last task "
              f"done)")
        dispatch = [r for r in rs if r["kind"] == "dispatch"]
        if dispatch:
            # The dispatch as a whole (e.g. FP8 rows against bf16 rows for the same routing):
            # from its first part taken to its last part done, and its parts' summed run times.
            d_start = min(r["taken_us"] for r in dispatch)
            d_end = max(r["done_us"] for r in dispatch)
            d_busy = sum(r["done_us"] - r["ready_us"] for r in dispatch)
            print(f"  dispatch: {len(dispatch)} parts, first taken to last done "
                  f"{d_end - d_start:.0f} µs, parts' run times summed {d_busy:.0f} µs")
        compute = defaultdict(list)
        for r in rs:
            # GEMM tasks only: a compute CTA's first records are the head dispatch parts it
            # pulled, which count as its head.
            if r["partition"] == "compute" and r["kind"] != "dispatch":
                compute[r["cta"]].append(r)
        if not compute:
            continue
        # NOTES: a producer can load task i once its waits passed (ready) and it issued task
        # i - 1's loads (done): max(0, ready_i - done_{i-1}) is time its tensor cores may have
        # run dry for want of a ready task (an upper bound: the stage ring still held work).
        # The head is the time to the first GEMM task's waits passing (the first minibatch's
        # dispatch); the tail is the end of the span after the CTA's last loads.
        head, stall, tail = [], [], []
        for tasks in compute.values():
            tasks.sort(key=lambda r: r["ready_us"])
            head.append(tasks[0]["ready_us"] - start)
            stall.append(sum(max(0.0, b["ready_us"] - a["done_us"])
                             for a, b in zip(tasks, tasks[1:])))
            tail.append(end - tasks[-1]["done_us"])
        n = len(compute)
        print(f"  compute CTAs: {n}; mean per CTA: head {sum(head) / n:.0f} µs, waits between "
              f"tasks {sum(stall) / n:.0f} µs, tail {sum(tail) / n:.0f} µs "
              f"(of a {end - start:.0f} µs span)")
        consumers(rs, end - start)


def consumers(rs: list[dict], span: float) -> None:
    """The consumers' view of one trace's GEMM tiles: per kind, the time from a tile's first stage
    to its epilogue handed off (its mainloop and epilogue), and the time the consumers waited for
    that first stage (starved: no loaded stage); per CTA, both summed against the span."""
    tiles = [r for r in rs if r["consumer_begin_us"] is not None]
    if not tiles:
        return
    by_kind = defaultdict(list)
    for r in tiles:
        by_kind[r["kind"]].append(r)
    for kind, ts in sorted(by_kind.items()):
        busy = sorted(r["consumer_end_us"] - r["consumer_begin_us"] for r in ts)
        starved = sorted(r["consumer_begin_us"] - r["consumer_wait_us"] for r in ts)
        p90 = int(0.9 * (len(ts) - 1))
        print(f"  consumers, {kind}: {len(ts)} tiles, first stage to epilogue handed off "
              f"{statistics.median(busy):.1f} µs (median; p90 {busy[p90]:.1f}), waiting for "
              f"the first stage {statistics.median(starved):.1f} µs (median; p90 "
              f"{starved[p90]:.1f})")
    per_cta = defaultdict(lambda: [0.0, 0.0])
    for r in tiles:
        per_cta[r["cta"]][0] += r["consumer_end_us"] - r["consumer_begin_us"]
        per_cta[r["cta"]][1] += r["consumer_begin_us"] - r["consumer_wait_us"]
    n = len(per_cta)
    busy = sum(v[0] for v in per_cta.values()) / n
    starved = sum(v[1] for v in per_cta.values()) / n
    print(f"  consumers, mean per CTA over {n} CTAs: in tiles {busy:.0f} µs, waiting for a tile's "
          f"first stage {starved:.0f} µs (of a {span:.0f} µs span)")


def timeline(rows: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = sorted({r["file"] for r in rows})
    fig, axes = plt.subplots(len(files), 1, squeeze=False, figsize=(14, 4 * len(files)))
    for ax, file in zip(axes[:, 0], files, strict=True):
        for r in (r for r in rows if r["file"] == file):
            y = r["cta"]
            ax.broken_barh([(r["taken_us"], r["ready_us"] - r["taken_us"])], (y, 0.9),
                           color="0.8")
            ax.broken_barh([(r["ready_us"], r["done_us"] - r["ready_us"])], (y, 0.9),
                           color=COLORS.get(r["kind"], "k"))
        ax.set_title(file, fontsize=10)
        ax.set_xlabel("µs since the first task was taken")
        ax.set_ylabel("CTA (communication partition first)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="0.8"))
    fig.legend(handles, [*COLORS, "waiting for counters"], loc="lower center", ncol=4,
               frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--png", type=Path, help="timeline plot to write")
    args = ap.parse_args()
    rows = load(args.traces)
    if not rows:
        sys.exit("trace_summary.py: no records")
    summarise(rows)
    if args.png:
        timeline(rows, args.png)
        print(f"timeline: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
