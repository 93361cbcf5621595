#!/usr/bin/env python3
"""Same-run A/B of two epflow-bench builds: reads the --json files of interleaved runs of build A
and build B and prints, per point (system, pass, preset, tokens/rank), each build's median time
over its runs, every run's value, and B / A. Optionally writes the table's data as JSON.

    bench/ab_compare.py --a before 'out/ab_before_*.json' --b after 'out/ab_after_*.json' \
        [--json summary.json]

With --gemm LABEL GLOB (repeated; epflow-fp8-gemm-bench files), compares any number of builds of
the standalone FP8 GEMM instead: per shape and rows per expert, each build's median TFLOP/s over
its files and each build over the last one.
"""
import argparse
import glob
import json
import statistics


def times(paths):
    """{(system, pass, preset, tokens): [us per file]} for the layer's own passes."""
    out = {}
    for path in sorted(paths):
        with open(path) as f:
            runs = json.load(f)["runs"]
        for r in runs:
            key = (r["system"], r["direction"], r["preset"], r["tokens"])
            out.setdefault(key, []).append(r["layer_us"])
            if r["direction"] == "bwd" and "forward_saving_us" in r:  # the training forward
                key = (r["system"], "fwd (training: keeps g, u)", r["preset"], r["tokens"])
                out.setdefault(key, []).append(r["forward_saving_us"])
    return out


def gemm_table(builds):
    """The markdown table of the --gemm builds (label, glob): median TFLOP/s per point."""
    per = {}  # (shape, rows) -> {label: [TFLOP/s per file]}
    for label, pattern in builds:
        paths = sorted(glob.glob(pattern))
        if not paths:
            raise SystemExit(f"ab_compare.py: no files for {pattern}")
        for path in paths:
            with open(path) as f:
                for r in json.load(f)["runs"]:
                    key = (r["shape"], r["rows_per_expert"])
                    per.setdefault(key, {}).setdefault(label, []).append(r["tflops"])
    labels = [label for label, _ in builds]
    last = labels[-1]
    lines = ["| shape | rows/expert | " + " | ".join(labels) + " | " +
             " | ".join(f"{x} / {last}" for x in labels[:-1]) + " |",
             "|---|---:|" + "---:|" * (2 * len(labels) - 1)]
    for (shape, rows), v in per.items():
        med = {x: statistics.median(v[x]) for x in labels if x in v}
        if len(med) != len(labels):
            continue  # a point not every build ran
        lines.append(f"| {shape} | {rows} | " + " | ".join(f"{med[x]:.0f}" for x in labels) +
                     " | " + " | ".join(f"{med[x] / med[last]:.3f}" for x in labels[:-1]) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", nargs=2, metavar=("LABEL", "GLOB"))
    ap.add_argument("--b", nargs=2, metavar=("LABEL", "GLOB"))
    ap.add_argument("--gemm", nargs=2, action="append", metavar=("LABEL", "GLOB"),
                    help="a standalone FP8 GEMM build (repeat; compared against the last)")
    ap.add_argument("--json", help="write the rows as JSON here")
    args = ap.parse_args()
    if args.gemm:
        print(gemm_table(args.gemm))
        return
    if not args.a or not args.b:
        ap.error("--a and --b, or --gemm")
    (la, ga), (lb, gb) = args.a, args.b
    fa, fb = glob.glob(ga), glob.glob(gb)
    if not fa or not fb:
        raise SystemExit(f"ab_compare.py: no files for {ga if not fa else gb}")
    ta, tb = times(fa), times(fb)
    rows = []
    print(f"| system | pass | preset | tokens/rank | {la} µs (median of {len(fa)}) | "
          f"{lb} µs (median of {len(fb)}) | {lb} / {la} |")
    print("|---|---|---|---:|---:|---:|---:|")
    for key in sorted(set(ta) & set(tb), key=lambda k: (k[2], k[3], k[1], k[0])):
        ma, mb = statistics.median(ta[key]), statistics.median(tb[key])
        system, direction, preset, tokens = key
        runs = lambda v: ", ".join(f"{x:.0f}" for x in v)
        print(f"| {system} | {direction} | {preset} | {tokens} | {ma:.1f} ({runs(ta[key])}) | "
              f"{mb:.1f} ({runs(tb[key])}) | {mb / ma:.3f} |")
        rows.append({"system": system, "pass": direction, "preset": preset, "tokens": tokens,
                     la + "_us": ta[key], lb + "_us": tb[key], la + "_median_us": ma,
                     lb + "_median_us": mb, "ratio": mb / ma})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"a": la, "b": lb, "a_files": sorted(fa), "b_files": sorted(fb),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
