#!/usr/bin/env python3
"""Renders epflow-bench JSON results as a markdown table (docs/benchmarks.md is made from this
output, never typed by hand). epflow-gemm-bench results ("kind": "gemm") get a table of their
own. Layer results with any system besides EPFlow (epflow-bench's baselines, bench/baselines/
torch_moe.py, bench/run_all.py's merged file) get a side-by-side comparison, then EPFlow's
per-stage table. Usage: bench/report.py RESULT.json [RESULT.json ...]"""
import json
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


def render_layer(docs):
    print("| preset | tokens/rank | EP | layer µs | layer TFLOP/s/GPU | metadata+schedule µs "
          "| dispatch µs (GB/s) | expert FFN µs | combine+sum µs (GB/s) | device | commit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for doc in docs:
        for r in doc["runs"]:
            def gbs(bytes_key, stage):
                us = r[stage]
                return r[bytes_key] / us * 1e-3 if us > 0 and r[bytes_key] > 0 else 0.0
            print(f"| {r['preset']} | {r['tokens']} | {r.get('ep', doc.get('ep'))} "
                  f"| {r['layer_us']:.0f} "
                  f"| {r['layer_tflops_per_gpu']:.1f} | {r['stage_us_0']:.0f} "
                  f"| {r['stage_us_1']:.0f} ({gbs('dispatch_nvlink_bytes', 'stage_us_1'):.0f}) "
                  f"| {r['stage_us_2']:.0f} "
                  f"| {r['stage_us_3']:.0f} ({gbs('combine_nvlink_bytes', 'stage_us_3'):.0f}) "
                  f"| {doc['device']} | {doc['commit']} |")


def layer_runs(docs):
    """Every run of the layer docs, each with its system, direction, EP, device and commit:
    epflow-bench's older files name no system (it is EPFlow) nor direction (forward); a merged
    file (bench/run_all.py) carries the EP in each run."""
    runs = []
    for doc in docs:
        for r in doc["runs"]:
            runs.append({"system": "epflow", "direction": "fwd", "ep": doc.get("ep"),
                         "device": doc["device"], "commit": doc["commit"], **r})
    return runs


def series_key(system, direction):
    """Column order of the comparison: EPFlow first, then the baselines; forward before
    backward."""
    return (system != "epflow", system, direction != "fwd", direction)


def render_comparison(runs):
    """Side-by-side µs and TFLOP/s per GPU of every (system, direction) per (preset, tokens, EP),
    and EPFlow's forward speedup over the fastest baseline forward of the same row."""
    series = sorted({(r["system"], r["direction"]) for r in runs}, key=lambda s: series_key(*s))
    presets = list(dict.fromkeys(r["preset"] for r in runs))
    rows = {}
    for r in runs:
        rows.setdefault((r["preset"], r["tokens"], r["ep"]), {})[(r["system"], r["direction"])] = r
    print("| preset | tokens/rank | EP | "
          + " | ".join(f"{s} {d} µs (TFLOP/s/GPU)" for s, d in series)
          + " | EPFlow fwd speedup vs best baseline fwd | device | commit |")
    print("|---|---|---|" + "---|" * len(series) + "---|---|---|")
    for preset, tokens, ep in sorted(rows, key=lambda k: (presets.index(k[0]), -k[2], k[1])):
        row = rows[(preset, tokens, ep)]
        cells = []
        for key in series:
            r = row.get(key)
            cells.append("n/a" if r is None else
                         f"{r['layer_us']:.0f} ({r['layer_tflops_per_gpu']:.1f})")
        baselines = [r for (s, d), r in row.items() if s != "epflow" and d == "fwd"]
        speedup = "n/a"
        if ("epflow", "fwd") in row and baselines:
            best = min(baselines, key=lambda r: r["layer_us"])
            speedup = (f"{best['layer_us'] / row[('epflow', 'fwd')]['layer_us']:.2f}x "
                       f"(vs {best['system']})")
        device = " / ".join(dict.fromkeys(r["device"] for r in row.values()))
        commit = " / ".join(dict.fromkeys(r["commit"] for r in row.values()))
        print(f"| {preset} | {tokens} | {ep} | " + " | ".join(cells)
              + f" | {speedup} | {device} | {commit} |")


def fmt(v, spec):
    """A number in the given format, or "n/a" for null (a baseline that did not run)."""
    return "n/a" if v is None else format(v, spec)


def render_gemm(docs):
    """epflow-gemm-bench: EPFlow's expert FFN against cuBLAS dense and grouped, per row count."""
    print("| preset | rows/expert | rows | EPFlow µs | EPFlow TFLOP/s | cuBLAS dense TFLOP/s "
          "| cuBLAS grouped TFLOP/s | EPFlow/dense | EPFlow/grouped "
          "| weight stream GB/s (% HBM copy) | check | device | commit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for doc in docs:
        balance = "imbalanced" if doc["imbalanced"] else "equal"
        for r in doc["runs"]:
            stream = ""
            if r["weight_stream_gbs"] is not None:
                stream = (f"{r['weight_stream_gbs']:.0f} "
                          f"({100 * r['weight_stream_vs_hbm']:.0f}% of "
                          f"{doc['hbm_copy_gbs']:.0f})")
            print(f"| {doc['preset']} (H {doc['hidden']}, I {doc['intermediate']}, "
                  f"{doc['experts']} experts) | {r['rows_per_expert']} ({balance}) "
                  f"| {r['real_rows']} | {fmt(r['epflow_us'], '.1f')} "
                  f"| {fmt(r['epflow_tflops'], '.1f')} | {fmt(r['dense_tflops'], '.1f')} "
                  f"| {fmt(r['grouped_tflops'], '.1f')} | {fmt(r['epflow_vs_dense'], '.2f')} "
                  f"| {fmt(r['epflow_vs_grouped'], '.2f')} | {stream} | {r['check']} "
                  f"| {doc['device']} | {doc['commit']} |")


def main(paths):
    docs = [load(p) for p in paths]
    layer = [d for d in docs if d.get("kind") != "gemm"]
    gemm = [d for d in docs if d.get("kind") == "gemm"]
    runs = layer_runs(layer)
    if {r["system"] for r in runs} - {"epflow"}:
        render_comparison(runs)
        # EPFlow's own per-stage table (forward stages), under the comparison.
        def epflow_stages(r):
            return (r.get("system", "epflow") == "epflow" and r.get("direction", "fwd") == "fwd"
                    and "stage_us_0" in r)
        epflow = [{**d, "runs": [r for r in d["runs"] if epflow_stages(r)]} for d in layer]
        epflow = [d for d in epflow if d["runs"]]
        if epflow:
            print()
            render_layer(epflow)
    elif layer:
        render_layer(layer)
    if layer and gemm:
        print()
    if gemm:
        render_gemm(gemm)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
