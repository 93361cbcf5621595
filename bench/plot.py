#!/usr/bin/env python3
"""Plots layer benchmark JSON (epflow-bench, bench/baselines/torch_moe.py, or bench/run_all.py's
merged file) as one PNG: a subplot per (preset, EP), TFLOP/s per GPU against tokens per rank
(log2 axis), a line per (system, direction).

Results with a knob sweep (epflow-bench --comm-sms / --minibatch-rows) also get PLOT_sweep.png.

Usage: bench/plot.py RESULT.json [RESULT.json ...] --out PLOT.png"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import layer_runs, series_key  # noqa: E402


def plot(runs: list[dict], title: str, out: Path) -> None:
    # Imported here: report-only users of this folder need no matplotlib.
    import matplotlib
    matplotlib.use("Agg")  # no display on the GPU machine
    import matplotlib.pyplot as plt

    # The knob sweep and the backward's side-stream A/B have their tables (report.py).
    runs = [r for r in runs if r["system"] not in ("epflow-sweep", "epflow-bwd-side")]
    presets = list(dict.fromkeys(r["preset"] for r in runs))
    eps = sorted({r["ep"] for r in runs})
    series = sorted({(r["system"], r["direction"]) for r in runs}, key=lambda s: series_key(*s))
    systems = list(dict.fromkeys(s for s, _ in series))
    colors = {s: f"C{i}" for i, s in enumerate(systems)}
    fig, axes = plt.subplots(len(presets), len(eps), squeeze=False, sharex=True,
                             figsize=(5.5 * len(eps), 3.6 * len(presets)))
    for row, preset in enumerate(presets):
        for col, ep in enumerate(eps):
            ax = axes[row][col]
            for system, direction in series:
                pts = sorted((r["tokens"], r["layer_tflops_per_gpu"]) for r in runs
                             if (r["preset"], r["ep"], r["system"], r["direction"])
                             == (preset, ep, system, direction))
                if pts:
                    ax.plot([t for t, _ in pts], [v for _, v in pts], marker="o",
                            color=colors[system], linestyle="-" if direction == "fwd" else "--",
                            label=f"{system} {direction}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{preset}, EP={ep}", fontsize=10)
            ax.set_xlabel("tokens per rank")
            ax.set_ylabel("TFLOP/s per GPU")
            ax.set_ylim(bottom=0)
            ax.grid(True, which="both", alpha=0.3)
    tokens = sorted({r["tokens"] for r in runs})
    for ax in axes.flat:
        ax.set_xticks(tokens, [str(t) for t in tokens])
        ax.tick_params(axis="x", labelbottom=True)
    # One legend for the figure: every subplot has (at most) the same series.
    handles = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles),
               frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_sweep(runs: list[dict], title: str, out: Path) -> None:
    """The megakernel's knob sweep: a subplot per (preset, tokens, EP), TFLOP/s per GPU against
    communication SMs, a line per (minibatch, ring) size; the automatic default as a star."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = [r for r in runs if r["system"] == "epflow-sweep"]
    panels = sorted({(r["preset"], r["tokens"], r["ep"]) for r in sweep})
    fig, axes = plt.subplots(1, len(panels), squeeze=False, figsize=(4.5 * len(panels), 3.8))
    for ax, (preset, tokens, ep) in zip(axes[0], panels, strict=True):
        mine = [r for r in sweep if (r["preset"], r["tokens"], r["ep"]) == (preset, tokens, ep)]
        for mb, ring in sorted({(r["minibatch_rows"], r.get("ring_rows", 0)) for r in mine}):
            pts = sorted((r["comm_sms"], r["layer_tflops_per_gpu"]) for r in mine
                         if (r["minibatch_rows"], r.get("ring_rows", 0)) == (mb, ring))
            ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o",
                    label=f"minibatch {mb}, ring {ring} rows")
        for d in runs:
            if (d["system"], d["direction"], d["preset"], d["tokens"], d["ep"]) == \
                    ("epflow", "fwd", preset, tokens, ep) and "comm_sms" in d:
                ax.plot([d["comm_sms"]], [d["layer_tflops_per_gpu"]], marker="*", markersize=14,
                        color="black", linestyle="none",
                        label=f"default ({d['comm_sms']} SMs, {d['minibatch_rows']}, "
                              f"{d.get('ring_rows', 0)} rows)")
        ax.set_title(f"{preset}, {tokens} tokens/rank, EP={ep}", fontsize=10)
        ax.set_xlabel("communication SMs")
        ax.set_ylabel("TFLOP/s per GPU")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(out, dpi=120)
    plt.close(fig)


def title_of(docs: list[dict]) -> str:
    """Device, date and commit of the results (a merged file records its date; others: today)."""
    device = " / ".join(dict.fromkeys(d["device"] for d in docs))
    commit = " / ".join(dict.fromkeys(d["commit"] for d in docs))
    date = docs[0].get("date", datetime.date.today().isoformat())
    return f"MoE layer, bf16: {device}, {date}, commit {commit}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="PNG to write")
    args = ap.parse_args()
    docs = [json.loads(p.read_text()) for p in args.results]
    docs = [d for d in docs if d.get("kind") != "gemm"]
    if not docs:
        sys.exit("plot.py: no layer results")
    runs = layer_runs(docs)
    plot(runs, title_of(docs), args.out)
    if any(r["system"] == "epflow-sweep" for r in runs):
        sweep_png = args.out.with_name(args.out.stem + "_sweep.png")
        plot_sweep(runs, title_of(docs) + ": megakernel knobs", sweep_png)
        print(f"sweep plot: {sweep_png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
