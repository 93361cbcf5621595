#!/usr/bin/env python3
"""Where a kernel's warps stall, by source line: reads the CSV of
`ncu --import REPORT --page source --csv --print-source cuda,sass` (a report taken with
--section SourceCounters and a -lineinfo build) and prints the lines with the most warp-stall
samples, their top stall reasons, and per source file the samples, the no-instruction stalls
(instruction fetch) and the static SASS instruction count (the code's size).

    source_stalls.py SOURCE.csv [--top N]
    source_stalls.py SOURCE.csv --metric COLUMN [--top N]

--metric: instead, the lines with the largest sums of that column (its header, or a substring
of it, e.g. "Sectors Global Excessive"); without a match it lists the headers.
"""
import argparse
import collections
import csv


def source_rows(path):
    """The source page's rows: ("header", row) for each function's column names, ("line", (file,
    line), row) for a source line, ("sass", None, row) for a SASS instruction of the line above."""
    src = None
    for row in csv.reader(open(path)):
        if not row or row[0] == "Function Name":
            continue
        if row[0] == "File Path":
            src = row[1].split("/")[-1]
        elif row[0] == "Line No":
            yield "header", None, row
        elif row[0] == "":
            yield "sass", None, row
        else:
            yield "line", (src, int(row[0])), row


def read_source_csv(path):
    """Per (file, line): warp-stall samples, stall reasons, SASS instructions, its text."""
    samples, sass = collections.Counter(), collections.Counter()
    reasons = collections.defaultdict(collections.Counter)
    text = {}
    line = None
    for kind, key, row in source_rows(path):
        if kind == "header":
            header = row
            col = header.index("Warp Stall Sampling (All Samples)")
            stalls = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
            continue
        if kind == "sass":  # a SASS instruction of the line above
            sass[line] += 1
            continue
        line = key
        text[line] = row[1].strip()[:80]
        n = int(row[col]) if row[col].isdigit() else 0
        samples[line] += n
        for i in stalls:
            if row[i].isdigit():
                reasons[line][header[i][len("stall_"):]] += int(row[i])
    return samples, reasons, sass, text


def metric_by_line(path, name, top):
    """The lines with the largest sums of the column whose header is (or contains) `name`."""
    sums, text, col = collections.Counter(), {}, None
    for kind, line, row in source_rows(path):
        if kind == "header":
            cols = [i for i, h in enumerate(row) if h == name] or [
                i for i, h in enumerate(row) if name in h]
            if not cols:
                raise SystemExit("no column matches %r; the headers: %s" % (name, "; ".join(row)))
            col = cols[0]
            header = row[col]
        elif kind == "line":
            text[line] = row[1].strip()[:80]
            try:
                sums[line] += float(row[col].replace(",", "") or 0)
            except ValueError:
                pass
    total = sum(sums.values())
    print(f"{header}: {total:.0f} over {len(sums)} lines")
    for k, v in sums.most_common(top):
        print(f"{v:14.0f} {100 * v / max(total, 1):5.1f}  {k[0]}:{k[1]} {text[k]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--metric")
    args = ap.parse_args()
    if args.metric:
        return metric_by_line(args.csv, args.metric, args.top)
    samples, reasons, sass, text = read_source_csv(args.csv)
    total = sum(samples.values())
    print(f"warp-stall samples: {total}")
    print(f"{'samples':>8} {'%':>5} {'SASS':>5}  line | top stall reasons")
    for k, n in samples.most_common(args.top):
        top = ", ".join(f"{r} {c}" for r, c in reasons[k].most_common(3))
        print(f"{n:8d} {100 * n / total:5.1f} {sass[k]:5d}  {k[0]}:{k[1]} {text[k]} | {top}")
    files = collections.defaultdict(lambda: [0, 0, 0])
    for k in set(samples) | set(sass):
        files[k[0]][0] += samples[k]
        files[k[0]][1] += reasons[k]["no_inst"]
        files[k[0]][2] += sass[k]
    print(f"\n{'samples':>8} {'no_inst':>8} {'SASS':>6}  file")
    for f, (n, ni, s) in sorted(files.items(), key=lambda x: -x[1][0])[: args.top]:
        print(f"{n:8d} {ni:8d} {s:6d}  {f}")


if __name__ == "__main__":
    main()
