#!/usr/bin/env python3
"""Renders epflow-bench JSON results as a markdown table (docs/benchmarks.md is made from this
output, never typed by hand). Usage: bench/report.py RESULT.json [RESULT.json ...]"""
import json
import sys


def rows(path):
    with open(path) as f:
        doc = json.load(f)
    for r in doc["runs"]:
        yield doc, r


def main(paths):
    print("| preset | tokens/rank | EP | layer µs | layer TFLOP/s/GPU | metadata+schedule µs "
          "| dispatch µs (GB/s) | expert FFN µs | combine+sum µs (GB/s) | device | commit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        for doc, r in rows(path):
            def gbs(bytes_key, stage):
                us = r[stage]
                return r[bytes_key] / us * 1e-3 if us > 0 and r[bytes_key] > 0 else 0.0
            print(f"| {r['preset']} | {r['tokens']} | {doc['ep']} | {r['layer_us']:.0f} "
                  f"| {r['layer_tflops_per_gpu']:.1f} | {r['stage_us_0']:.0f} "
                  f"| {r['stage_us_1']:.0f} ({gbs('dispatch_nvlink_bytes', 'stage_us_1'):.0f}) "
                  f"| {r['stage_us_2']:.0f} "
                  f"| {r['stage_us_3']:.0f} ({gbs('combine_nvlink_bytes', 'stage_us_3'):.0f}) "
                  f"| {doc['device']} | {doc['commit']} |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
