#!/usr/bin/env python3
"""Renders epflow-bench JSON results as a markdown table (docs/benchmarks.md is made from this
output, never typed by hand). epflow-gemm-bench results ("kind": "gemm") get a table of their
own. Usage: bench/report.py RESULT.json [RESULT.json ...]"""
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
            print(f"| {r['preset']} | {r['tokens']} | {doc['ep']} | {r['layer_us']:.0f} "
                  f"| {r['layer_tflops_per_gpu']:.1f} | {r['stage_us_0']:.0f} "
                  f"| {r['stage_us_1']:.0f} ({gbs('dispatch_nvlink_bytes', 'stage_us_1'):.0f}) "
                  f"| {r['stage_us_2']:.0f} "
                  f"| {r['stage_us_3']:.0f} ({gbs('combine_nvlink_bytes', 'stage_us_3'):.0f}) "
                  f"| {doc['device']} | {doc['commit']} |")


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
    if layer:
        render_layer(layer)
    if layer and gemm:
        print()
    if gemm:
        render_gemm(gemm)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
