#!/usr/bin/env python3
"""Renders epflow-bench JSON results as a markdown table (docs/benchmarks.md is made from this
output, never typed by hand). epflow-gemm-bench results ("kind": "gemm") get a table of their
own. Layer results with any system besides EPFlow (epflow-bench's baselines, bench/baselines/
torch_moe.py, bench/run_all.py's merged file) get a side-by-side comparison, then EPFlow's
per-stage table. Every table names each row's routing distribution (epflow-bench --routing);
files from before it have none and are uniform. --summary prints only the short table of the
README (EPFlow against the baselines, each pass in the mode the other system runs it). Runs of
EPFlow's FP8 layer (epflow-bench --dtype fp8: system epflow-fp8) get a table of their own against
the bf16 systems and the FP8 baselines (nccl-pytorch-fp8); bench/fp8_yardsticks.py files ("kind":
"fp8-yardsticks") theirs; --summary adds their FP8 column (EPFlow FP8 against NCCL+PyTorch FP8;
the bf16 runs of a file with FP8 runs stay out of the summary, the other files give those) and,
for a file with FP8 backward runs, an FP8 training-step column against that file's own
NCCL+PyTorch bf16 step. Where files measure the same point, the later file's runs win.
bench/moelayer_step.py, bench/layer_memory.py, bench/megatron_layer.py and
experiments/deepgemm_same_run files ("kind": "fp8-gemm-vs-deepgemm") get their own.
Usage: bench/report.py [--summary] RESULT.json [RESULT.json ...]"""
import json
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


SWEEP = "epflow-sweep"
SIDE_AB = "epflow-bwd-side"  # epflow-bench --backward-side-sms: the backward's side-stream A/B


def routing_of(r):
    """A run's routing distribution: runs from before --routing name none and were uniform."""
    return r.get("routing", "uniform")


def is_baseline(system):
    """Systems EPFlow is compared with: not EPFlow's own variants (unfused chain, knob sweep)."""
    return not system.startswith("epflow")


# Baselines whose "fwd" run is a training forward, timed recording autograd
# (bench/baselines/torch_moe.py): compared with EPFlow's training forward (the one that keeps
# g | u), never with its inference forward.
TRAINING_FORWARD = {"nccl-pytorch"}


FP8 = "epflow-fp8"  # epflow-bench --dtype fp8: EPFlow's FP8 forward


def is_fp8(system):
    """Systems that run the layer in FP8 (compared with each other, not with bf16 ones)."""
    return system.endswith("-fp8")


def inference_baseline(system, direction):
    return (is_baseline(system) and direction == "fwd" and system not in TRAINING_FORWARD
            and not is_fp8(system))


def render_fp8(runs):
    """EPFlow's FP8 forward per point against EPFlow's bf16 forward, the bf16 baselines and the
    FP8 baselines, with the FP8 weights' stream time (the HBM copy rate of the same run) and the
    time quantize_expert_weights takes."""
    rows = {}
    for r in runs:
        if r["direction"] == "fwd":
            rows.setdefault(point(r), {})[r["system"]] = r
    others = sorted({s for row in rows.values() for s in row if s != FP8},
                    key=lambda s: (is_fp8(s), s != "epflow", s))
    print("| preset | tokens/rank | EP | routing | epflow-fp8 µs (TFLOP/s/GPU) | "
          + " | ".join(f"{s} µs (epflow-fp8 speedup)" for s in others)
          + " | layer / FP8 weight stream | quantize_expert_weights µs | device | commit |")
    print("|---|---|---|---|---|" + "---|" * len(others) + "---|---|---|---|")
    for key in sorted(rows, key=lambda k: (k[0], k[3], -k[2], k[1])):
        row = rows[key]
        mine = row.get(FP8)
        if mine is None:
            continue
        cells = []
        for s in others:
            r = row.get(s)
            cells.append("n/a" if r is None else
                         f"{r['layer_us']:.0f} ({r['layer_us'] / mine['layer_us']:.2f}x)")
        stream = mine.get("layer_vs_fp8_weight_stream")
        device = " / ".join(dict.fromkeys(r["device"] for r in row.values()))
        commit = " / ".join(dict.fromkeys(r["commit"] for r in row.values()))
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} "
              f"| {mine['layer_us']:.0f} ({mine['layer_tflops_per_gpu']:.1f}) | "
              + " | ".join(cells)
              + f" | {'n/a' if stream is None else f'{stream:.2f}x'}"
              f" | {mine.get('quantize_weights_us', 0):.0f} | {device} | {commit} |")


def render_fp8_backward(runs):
    """EPFlow's FP8 backward and training step (weights re-quantized + forward keeping g|u +
    backward) per point against its bf16 ones from the same run (epflow-bench --dtype fp8
    --backward), with the backward's two largest stages."""
    rows = {}
    for r in runs:
        if r["direction"] == "bwd" and r["system"] in (FP8, "epflow", "nccl-pytorch"):
            rows.setdefault(point(r), {})[r["system"]] = r
    print("| preset | tokens/rank | EP | routing | FP8 backward µs (TFLOP/s/GPU) | bf16 backward "
          "µs | FP8 speedup | megakernel µs FP8 / bf16 | weight-gradient stage µs FP8 / bf16 "
          "| FP8 layer's weight gradients | in the other precision: FP8 backward µs (stage µs) "
          "| FP8 step µs (re-quantization µs) | bf16 step µs | FP8 step speedup "
          "| NCCL+PyTorch bf16 step µs (FP8 step speedup) | device | commit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def stage(r, prefix):
        return next((v for k, v in r.get("stage_us", {}).items() if k.startswith(prefix)),
                    float("nan"))
    def torch_step(torch, fp8):
        """NCCL+PyTorch's bf16 training step of the same run (run_all.py --dtype fp8
        --backward), and the FP8 step's speedup over it."""
        if torch is None or "train_step_us" not in torch:
            return "n/a"
        return f"{torch['train_step_us']:.0f} ({torch['train_step_us'] / fp8['train_step_us']:.2f}x)"

    def other_wgrad(r):
        """The precision the FP8 layer chose and its backward with the other one (runs before the
        choice existed: bf16, not compared)."""
        if "other_wgrad_backward_us" not in r:
            return "bf16 | n/a"
        chosen, other = ("FP8", "bf16") if r["weight_gradients"] == "fp8" else ("bf16", "FP8")
        return (f"{chosen} | {other}: {r['other_wgrad_backward_us']:.0f} "
                f"({r['other_wgrad_stage_us']:.0f})")
    for key in sorted(rows, key=lambda k: (k[0], k[3], -k[2], k[1])):
        fp8, bf16 = rows[key].get(FP8), rows[key].get("epflow")
        if fp8 is None or bf16 is None:
            continue
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} "
              f"| {fp8['layer_us']:.0f} ({fp8['layer_tflops_per_gpu']:.0f}) "
              f"| {bf16['layer_us']:.0f} | {bf16['layer_us'] / fp8['layer_us']:.2f}x "
              f"| {stage(fp8, 'megakernel'):.0f} / {stage(bf16, 'megakernel'):.0f} "
              f"| {stage(fp8, 'weight gradients'):.0f} / {stage(bf16, 'weight gradients'):.0f} "
              f"| {other_wgrad(fp8)} "
              f"| {fp8['train_step_us']:.0f} ({fp8.get('train_step_quantize_us', float('nan')):.0f}) "
              f"| {bf16['train_step_us']:.0f} | {bf16['train_step_us'] / fp8['train_step_us']:.2f}x "
              f"| {torch_step(rows[key].get('nccl-pytorch'), fp8)} "
              f"| {fp8['device']} | {fp8['commit']} |")


def render_fp8_yardsticks(doc):
    """bench/fp8_yardsticks.py: cuBLAS dense and torch grouped GEMMs in bf16 and FP8, and the FP8
    weights' stream, median over the repeats."""
    print("| measurement | shape | dtype, scaling | µs | rate | repeats µs | device | torch "
          "| commit |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in doc["runs"]:
        shape = "x".join(str(v) for v in r["shape"].values())
        if "error" in r:
            rate, us = f"error: {r['error'][:80]}", "n/a"
        else:
            us = f"{r['median_us']:.0f}"
            rate = (f"{r['tflops']:.0f} TFLOP/s" if "tflops" in r
                    else f"{r['gbps']:.0f} GB/s read+write")
        reps = " / ".join(f"{v:.0f}" for v in r.get("repeat_us", []))
        name = r["name"].replace("|", "\\|")
        print(f"| {name} | {shape} | {r['dtype']}, {r['scaling']} | {us} | {rate} | {reps} "
              f"| {doc['device']} | {doc['torch']} | {doc['commit']} |")


# DeepGEMM 2.6.1's m-grouped FP8 GEMM (1 x 128 / 128 x 128 block scales, 32 experts) on an H200
# under sustained load, TFLOP/s per rows per expert, and the block-wise dense FP8 yardstick
# (torch._scaled_mm, 8192^3) of that run, 1085-1103: the project brief's anchors.
DEEPGEMM_FP8_GROUPED = {"gate|up 7168 -> 4096": {128: 801, 512: 1075, 1024: 1169, 2048: 1176},
                        "down 2048 -> 7168": {128: 761, 512: 1088, 1024: 1093, 2048: 1139}}
DEEPGEMM_BLOCKWISE_YARDSTICK = 1094.0


def blockwise_yardstick(doc):
    """The block-wise dense FP8 figure of a bench/fp8_yardsticks.py run (None if absent)."""
    for r in doc["runs"] if doc else []:
        if r["name"] == "dense" and r["scaling"].startswith("blockwise") and "tflops" in r:
            return r["tflops"]
    return None


def render_fp8_gemm(doc, yardsticks=None):
    """epflow-fp8-gemm-bench against DeepGEMM's grouped FP8 GEMM: as measured, and normalised by
    each run's block-wise dense FP8 yardstick (yardsticks: a bench/fp8_yardsticks.py document of
    the same machine session; without one the normalised column says n/a)."""
    mine_dense = blockwise_yardstick(yardsticks)
    print("| shape | rows/expert | EPFlow µs | EPFlow TFLOP/s | repeats µs | DeepGEMM TFLOP/s "
          "| EPFlow / DeepGEMM | normalised by block-wise dense | check (rel. err) | device "
          "| commit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in doc["runs"]:
        theirs = DEEPGEMM_FP8_GROUPED.get(r["shape"], {}).get(r["rows_per_expert"])
        ratio = None if theirs is None else r["tflops"] / theirs
        normalised = (None if ratio is None or mine_dense is None
                      else ratio * DEEPGEMM_BLOCKWISE_YARDSTICK / mine_dense)
        reps = " / ".join(f"{v:.0f}" for v in r["repeat_us"])
        shape = r["shape"].replace("|", "\\|")
        print(f"| {shape} | {r['rows_per_expert']} | {r['median_us']:.0f} "
              f"| {r['tflops']:.0f} | {reps} | {fmt(theirs, 'd')} | {fmt(ratio, '.2f')} "
              f"| {fmt(normalised, '.2f')} | {r['check']} ({fmt(r['check_rel_err'], '.1e')}) "
              f"| {doc['device']} | {doc['commit']} |")
    if mine_dense is not None:
        print(f"\nBlock-wise dense FP8 yardstick of this session: {mine_dense:.0f} TFLOP/s "
              f"(DeepGEMM's run: {DEEPGEMM_BLOCKWISE_YARDSTICK:.0f}).")


def render_fp8_gemm_vs_deepgemm(doc):
    """experiments/deepgemm_same_run: EPFlow's FP8 grouped GEMM and DeepGEMM's own SM90 kernel on
    the same inputs in one process, alternating; each figure the median of both passes' rounds."""
    import statistics
    experts = doc.get("experts", 32)
    print("| shape | rows/expert | EPFlow µs | DeepGEMM µs | EPFlow TFLOP/s | DeepGEMM TFLOP/s "
          "| EPFlow / DeepGEMM | rel. err EPFlow / DeepGEMM / between | settle ms | device "
          "| commit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in doc["runs"]:
        k, n = (int(v) for v in r["shape"].split()[-3::2])  # "NAME K -> N"
        flops = 2.0 * experts * r["rows_per_expert"] * n * k
        mine = statistics.median(r["epflow_rounds_us"])
        theirs = statistics.median(r["deepgemm_rounds_us"])
        shape = r["shape"].replace("|", "\\|")
        print(f"| {shape} | {r['rows_per_expert']} | {mine:.0f} | {theirs:.0f} "
              f"| {flops / mine * 1e-6:.0f} | {flops / theirs * 1e-6:.0f} | {theirs / mine:.2f} "
              f"| {r['epflow_rel_err']:.1e} / {r['deepgemm_rel_err']:.1e} / "
              f"{r['epflow_vs_deepgemm']:.1e} | {doc['settle_ms']} | {doc['device']} "
              f"| {doc['commit']} |")


def render_fused(docs):
    """EPFlow's fused forward per stage: the megakernel is one stage (dispatch, expert FFN and
    combine overlapped inside it); its TFLOP/s count the rows this GPU's experts computed."""
    print("| preset | tokens/rank | EP | routing | layer µs | layer TFLOP/s/GPU "
          "| metadata+schedule µs | megakernel µs (expert TFLOP/s, NVLink GB/s) "
          "| barrier+sum µs | comm SMs | minibatch rows | ring rows (MB) | layer / cuBLAS dense "
          "| layer / weight stream | per rank: megakernel / barrier+sum µs | device | commit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for doc in docs:
        for r in doc["runs"]:
            mk = r["stage_us_1"] + r["stage_us_2"]
            nvlink = r["dispatch_nvlink_bytes"] + r["combine_nvlink_bytes"]
            ffn = r["ffn_tflops_per_gpu"] * r["stage_us_2"] / mk if r["ffn_tflops_per_gpu"] else 0
            print(f"| {r['preset']} | {r['tokens']} | {r.get('ep', doc.get('ep'))} "
                  f"| {routing_of(r)} | {r['layer_us']:.0f} | {r['layer_tflops_per_gpu']:.1f} "
                  f"| {r['stage_us_0']:.0f} | {mk:.0f} ({ffn:.0f}, {nvlink / mk * 1e-3:.0f}) "
                  f"| {r['stage_us_3']:.0f} | {r['comm_sms']} | {r['minibatch_rows']} "
                  f"| {r['ring_rows']} ({r['ring_bytes'] * 1e-6:.0f}) "
                  f"| {pct(r)} "
                  f"| {times(r.get('layer_vs_weight_stream'), r.get('weight_stream_us'))} "
                  f"| {per_rank(r)} | {doc['device']} | {doc['commit']} |")


def per_rank(r):
    """Each rank's megakernel and barrier+sum (results since the per-rank fields exist): which
    rank waited for which at the barrier."""
    ranks = r.get("rank_stage_us")
    if not ranks:
        return "n/a"
    return "; ".join(f"{s[1] + s[2]:.0f} / {s[3]:.0f}" for s in ranks)


def pct(r):
    """The layer's rate as a share of cuBLAS dense bf16 on the same rows (same run); with the
    interleaved yardstick also as a share of the same GEMMs timed after the systems."""
    ratio, dense = r.get("layer_vs_cublas_dense"), r.get("cublas_dense_tflops")
    if ratio is None:
        return "n/a"
    out = f"{100 * ratio:.0f}% of {dense:.0f} TFLOP/s"
    after = r.get("cublas_dense_tflops_after")
    if after:
        out += f" ({100 * r['layer_tflops_per_gpu'] / after:.0f}% of {after:.0f} after the systems)"
    return out


def times(ratio, stream_us):
    """The layer's time as a multiple of streaming the local weights at the HBM copy rate."""
    return "n/a" if ratio is None else f"{ratio:.2f}x of {stream_us:.0f} µs"


def point(r):
    """The point a run measured: (preset, tokens, EP, routing)."""
    return r["preset"], r["tokens"], r["ep"], r["routing"]


def epflow_by_point(runs, direction):
    """EPFlow's default runs of one direction by point: what variants compare to."""
    return {point(r): r for r in runs if r["system"] == "epflow" and r["direction"] == direction}


def render_sweep(runs):
    """The knob sweep: every (comm SMs, minibatch rows, ring rows) next to the automatic
    default."""
    defaults = epflow_by_point(runs, "fwd")
    print("| preset | tokens/rank | EP | routing | comm SMs | minibatch rows | ring rows "
          "| layer µs | TFLOP/s/GPU | vs default | default: comm SMs, minibatch rows, ring rows |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted((r for r in runs if r["system"] == SWEEP),
                    key=lambda r: (r["preset"], r["routing"], r["ep"], r["tokens"], r["comm_sms"],
                                   r["minibatch_rows"], r["ring_rows"])):
        d = defaults.get(point(r))
        vs = f"{d['layer_us'] / r['layer_us']:.2f}x" if d else "n/a"
        dk = f"{d['comm_sms']}, {d['minibatch_rows']}, {d['ring_rows']}" if d else "n/a"
        print(f"| {r['preset']} | {r['tokens']} | {r['ep']} | {r['routing']} | {r['comm_sms']} "
              f"| {r['minibatch_rows']} | {r['ring_rows']} | {r['layer_us']:.0f} "
              f"| {r['layer_tflops_per_gpu']:.1f} "
              f"| {vs} | {dk} |")


def render_backward_stages(runs):
    """EPFlow's backward per stage (the slowest rank's medians; stages on the caller's stream,
    the side stream's work runs inside them)."""
    bwd = [r for r in runs if r["system"] == "epflow" and r["direction"] == "bwd"
           and "stage_us" in r]
    names = list(bwd[0]["stage_us"])
    cols = [n.replace("|", "\\|") for n in names]  # markdown cells
    print("| preset | tokens/rank | EP | routing | backward µs | "
          + " | ".join(f"{n} µs" for n in cols)
          + " | forward keeping g\\|u µs | grad dtype | commit |")
    print("|---|---|---|---|---|" + "---|" * len(names) + "---|---|---|")
    for r in bwd:
        print(f"| {r['preset']} | {r['tokens']} | {r['ep']} | {r['routing']} "
              f"| {r['layer_us']:.0f} | "
              + " | ".join(f"{r['stage_us'][n]:.0f}" for n in names)
              + f" | {fmt(r.get('forward_saving_us'), '.0f')} | {r.get('grad_dtype', 'n/a')} "
              f"| {r['commit']} |")


def render_side_ab(runs):
    """The backward with each side-stream SM count (0: no side stream) next to the default."""
    defaults = epflow_by_point(runs, "bwd")
    print("| preset | tokens/rank | EP | routing | side SMs | backward µs | TFLOP/s/GPU "
          "| default µs | this / default (time) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in sorted((r for r in runs if r["system"] == SIDE_AB),
                    key=lambda r: (r["preset"], r["routing"], r["ep"], r["tokens"],
                                   r["backward_side_sms"])):
        d = defaults.get(point(r))
        vs = f"{r['layer_us'] / d['layer_us']:.2f}x" if d else "n/a"
        print(f"| {r['preset']} | {r['tokens']} | {r['ep']} | {r['routing']} "
              f"| {r['backward_side_sms']} "
              f"| {r['layer_us']:.0f} | {r['layer_tflops_per_gpu']:.1f} "
              f"| {fmt(d and d['layer_us'], '.0f')} | {vs} |")


def render_layer(docs):
    print("| preset | tokens/rank | EP | routing | layer µs | layer TFLOP/s/GPU "
          "| metadata+schedule µs | dispatch µs (GB/s) | expert FFN µs | combine+sum µs (GB/s) "
          "| device | commit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for doc in docs:
        for r in doc["runs"]:
            def gbs(bytes_key, stage):
                us = r[stage]
                return r[bytes_key] / us * 1e-3 if us > 0 and r[bytes_key] > 0 else 0.0
            print(f"| {r['preset']} | {r['tokens']} | {r.get('ep', doc.get('ep'))} "
                  f"| {routing_of(r)} | {r['layer_us']:.0f} "
                  f"| {r['layer_tflops_per_gpu']:.1f} | {r['stage_us_0']:.0f} "
                  f"| {r['stage_us_1']:.0f} ({gbs('dispatch_nvlink_bytes', 'stage_us_1'):.0f}) "
                  f"| {r['stage_us_2']:.0f} "
                  f"| {r['stage_us_3']:.0f} ({gbs('combine_nvlink_bytes', 'stage_us_3'):.0f}) "
                  f"| {doc['device']} | {doc['commit']} |")


def layer_runs(docs):
    """Every run of the layer docs, each with its system, direction, EP, routing, device and
    commit: epflow-bench's older files name no system (it is EPFlow) nor direction (forward), and
    files from before --routing no routing (uniform); a merged file (bench/run_all.py) carries the
    EP in each run."""
    runs = []
    for doc in docs:
        for r in doc["runs"]:
            runs.append({"system": "epflow", "direction": "fwd", "ep": doc.get("ep"),
                         "routing": routing_of(r), "device": doc["device"],
                         "commit": doc["commit"], **r})
    return runs


def series_key(system, direction):
    """Column order of the comparison: EPFlow first, then the baselines; forward before
    backward."""
    return (system != "epflow", system, direction != "fwd", direction)


def render_comparison(runs):
    """Side-by-side µs and TFLOP/s per GPU of every (system, direction) per point (preset, tokens,
    EP, routing: each routing a row of its own), and EPFlow's (inference) forward speedup over
    the fastest inference baseline forward of the same row; with EPFlow
    backward runs, its speedup over the fastest baseline backward and its TFLOP/s (twice the
    forward FLOPs) against the cuBLAS dense yardstick of the same row's EPFlow forward run, its
    training forward (the one that keeps g | u) against the baselines' training forward
    (NCCL+PyTorch records autograd), and the training step (forward + backward timed as one)
    against the fastest baseline's, where the runs have them."""
    runs = [r for r in runs if r["system"] not in (SWEEP, SIDE_AB) and not is_fp8(r["system"])]
    series = sorted({(r["system"], r["direction"]) for r in runs}, key=lambda s: series_key(*s))
    presets = list(dict.fromkeys(r["preset"] for r in runs))
    unfused = ("epflow-unfused", "fwd") in series
    backward = ("epflow", "bwd") in series
    routings = list(dict.fromkeys(r["routing"] for r in runs))
    rows = {}
    for r in runs:
        rows.setdefault(point(r), {})[(r["system"], r["direction"])] = r
    print("| preset | tokens/rank | EP | routing | "
          + " | ".join(f"{s} {d} µs (TFLOP/s/GPU)" for s, d in series)
          + " | EPFlow fwd speedup vs best inference baseline fwd"
          + (" | EPFlow fused vs unfused" if unfused else "")
          + (" | EPFlow bwd speedup vs best baseline bwd | EPFlow bwd / cuBLAS dense"
             " | EPFlow training fwd µs, speedup vs NCCL+PyTorch fwd"
             " | EPFlow training step µs, speedup vs best baseline step" if backward else "")
          + " | device | commit |")
    print("|---|---|---|---|" + "---|" * len(series) + "---|" * (1 + unfused + 4 * backward)
          + "---|---|")
    for preset, tokens, ep, routing in sorted(
            rows, key=lambda k: (presets.index(k[0]), routings.index(k[3]), -k[2], k[1])):
        row = rows[(preset, tokens, ep, routing)]
        cells = []
        for key in series:
            r = row.get(key)
            cells.append("n/a" if r is None else
                         f"{r['layer_us']:.0f} ({r['layer_tflops_per_gpu']:.1f})")
        baselines = [r for (s, d), r in row.items() if inference_baseline(s, d)]
        speedup = "n/a"
        if ("epflow", "fwd") in row and baselines:
            best = min(baselines, key=lambda r: r["layer_us"])
            speedup = (f"{best['layer_us'] / row[('epflow', 'fwd')]['layer_us']:.2f}x "
                       f"(vs {best['system']})")
        device = " / ".join(dict.fromkeys(r["device"] for r in row.values()))
        commit = " / ".join(dict.fromkeys(r["commit"] for r in row.values()))
        if unfused:
            f, u = row.get(("epflow", "fwd")), row.get(("epflow-unfused", "fwd"))
            speedup += " | " + (f"{u['layer_us'] / f['layer_us']:.2f}x" if f and u else "n/a")
        if backward:
            b, f = row.get(("epflow", "bwd")), row.get(("epflow", "fwd"))
            base = [r for (s, d), r in row.items() if is_baseline(s) and d == "bwd"]
            best = min(base, key=lambda r: r["layer_us"]) if base else None
            speedup += " | " + (f"{best['layer_us'] / b['layer_us']:.2f}x (vs {best['system']})"
                                if b and best else "n/a")
            dense = f.get("cublas_dense_tflops") if f else None
            speedup += " | " + (f"{100 * b['layer_tflops_per_gpu'] / dense:.1f}% of {dense:.0f}"
                                if b and dense else "n/a")
            train_fwd = b.get("forward_saving_us") if b else None
            torch_fwd = row.get(("nccl-pytorch", "fwd"))
            speedup += " | " + ("n/a" if train_fwd is None else f"{train_fwd:.0f}" + (
                f", {torch_fwd['layer_us'] / train_fwd:.2f}x" if torch_fwd else ""))
            step = b.get("train_step_us") if b else None
            steps = [r for r in base if r.get("train_step_us")]
            best_step = min(steps, key=lambda r: r["train_step_us"]) if steps else None
            speedup += " | " + ("n/a" if step is None else f"{step:.0f}" + (
                f", {best_step['train_step_us'] / step:.2f}x (vs {best_step['system']})"
                if best_step else ""))
        print(f"| {preset} | {tokens} | {ep} | {routing} | " + " | ".join(cells)
              + f" | {speedup} | {device} | {commit} |")


def render_baseline_stages(runs):
    """Per-stage times of the baselines that mark stages (NCCL+cuBLAS: route with its host sync,
    dispatch, expert FFN, combine + weighted sum), beside EPFlow's per-stage table."""
    print("| system | preset | tokens/rank | EP | routing | layer µs | route + host sync µs "
          "| dispatch µs | expert FFN µs | combine + weighted sum µs | commit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['system']} | {r['preset']} | {r['tokens']} | {r['ep']} | {r['routing']} "
              f"| {r['layer_us']:.0f} | {r['stage_us_0']:.0f} | {r['stage_us_1']:.0f} "
              f"| {r['stage_us_2']:.0f} | {r['stage_us_3']:.0f} | {r['commit']} |")


# In --summary, an FP8 file's NCCL+PyTorch bf16 training step (its backward runs) stays, under
# this name: the FP8 training step is compared with the bf16 step of the same run.
TORCH_STEP_BESIDE_FP8 = "nccl-pytorch-beside-fp8"


def fp8_summary_runs(doc):
    """An FP8 file's runs as --summary keeps them: its FP8 runs and, if it has FP8 backward runs,
    NCCL+PyTorch's backward runs renamed (the other bf16 runs are left out: the bf16 files give
    those)."""
    runs = [r for r in doc["runs"] if is_fp8(r.get("system", "epflow"))]
    if any(r.get("system") == FP8 and r.get("direction") == "bwd" for r in runs):
        runs += [{**r, "system": TORCH_STEP_BESIDE_FP8} for r in doc["runs"]
                 if r.get("system") == "nccl-pytorch" and r.get("direction") == "bwd"]
    return runs


def render_summary(runs):
    """The README's table: per point, EPFlow against the baseline that runs each pass the same
    way: inference forward against NCCL+cuBLAS (the inference baseline), training forward,
    backward and training step (forward + backward timed as one) against NCCL+PyTorch, and, with
    FP8 runs, EPFlow's FP8 inference forward against NCCL+PyTorch's FP8 one and, with FP8
    backward runs, EPFlow's FP8 training step (with the weights' re-quantization) against
    NCCL+PyTorch's bf16 step of the same run; µs, EPFlow's speedup in brackets."""
    rows = {}
    for r in runs:
        rows.setdefault(point(r), {})[(r["system"], r["direction"])] = r
    presets = list(dict.fromkeys(r["preset"] for r in runs))
    routings = list(dict.fromkeys(r["routing"] for r in runs))

    def cell(mine, theirs, field_mine, field_theirs="layer_us"):
        a = mine.get(field_mine) if mine else None
        b = theirs.get(field_theirs) if theirs else None
        return "n/a" if a is None or b is None else f"{a:.0f} / {b:.0f} ({b / a:.2f}x)"

    fp8 = any(r["system"] == FP8 for r in runs)
    fp8_step = any(r["system"] == FP8 and r["direction"] == "bwd" for r in runs)
    print("| model | tokens per GPU | EP | routing "
          "| inference forward, µs: EPFlow / NCCL+cuBLAS "
          "| training forward, µs: EPFlow / NCCL+PyTorch "
          "| backward, µs: EPFlow / NCCL+PyTorch "
          "| training step, µs: EPFlow / NCCL+PyTorch "
          + ("| FP8 inference forward, µs: EPFlow / NCCL+PyTorch " if fp8 else "")
          + ("| FP8 training step, µs: EPFlow FP8 / NCCL+PyTorch bf16 " if fp8_step else "")
          + "|")
    print("|---|---:|---:|---|---:|---:|---:|---:|" + ("---:|" if fp8 else "")
          + ("---:|" if fp8_step else ""))
    for key in sorted(rows, key=lambda k: (presets.index(k[0]), -k[2], routings.index(k[3]),
                                           k[1])):
        row = rows[key]
        fwd, bwd = row.get(("epflow", "fwd")), row.get(("epflow", "bwd"))
        torch_fwd, torch_bwd = row.get(("nccl-pytorch", "fwd")), row.get(("nccl-pytorch", "bwd"))
        cells = [cell(fwd, row.get(("nccl-cublas", "fwd")), "layer_us"),
                 cell(bwd, torch_fwd, "forward_saving_us"),
                 cell(bwd, torch_bwd, "layer_us"),
                 cell(bwd, torch_bwd, "train_step_us", "train_step_us")]
        if fp8:
            cells.append(cell(row.get((FP8, "fwd")), row.get(("nccl-pytorch-fp8", "fwd")),
                              "layer_us"))
        if fp8_step:
            cells.append(cell(row.get((FP8, "bwd")), row.get((TORCH_STEP_BESIDE_FP8, "bwd")),
                              "train_step_us", "train_step_us"))
        print(f"| {NAMES.get(key[0], key[0])} | {key[1]} | {key[2]} | {key[3]} | "
              + " | ".join(cells) + " |")


# How the summary names the presets.
NAMES = {"deepseek-v3": "DeepSeek-V3", "qwen3-235b-a22b": "Qwen3-235B-A22B",
         "qwen3-30b-a3b": "Qwen3-30B-A3B", "deepseek-v4-flash": "DeepSeek-V4-Flash"}


def render_epflow(docs):
    """Per-stage tables: fused runs and, for older files, the unfused chain."""
    fused = [{**d, "runs": [r for r in d["runs"] if r.get("fused")]} for d in docs]
    chain = [{**d, "runs": [r for r in d["runs"] if not r.get("fused")]} for d in docs]
    fused, chain = [d for d in fused if d["runs"]], [d for d in chain if d["runs"]]
    if fused:
        render_fused(fused)
    if fused and chain:
        print()
    if chain:
        render_layer(chain)


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


def render_layer_memory(doc):
    """bench/layer_memory.py: device memory of a stack of layers and of contexts in flight."""
    print(f"| layers | device used GB | EPFlow workspace GB | parameters GB | preset | "
          f"tokens/rank | EP | device | commit |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in doc["rows"]:
        print(f"| {r['layers']} | {r['device_used_bytes'] * 1e-9:.2f} "
              f"| {r['workspace_bytes'] * 1e-9:.2f} | {r['parameter_bytes'] * 1e-9:.2f} "
              f"| {doc['preset']} | {doc['max_tokens_per_rank']} | {doc['ep']} "
              f"| {doc['device']} | {doc['commit']} |")
    print()
    print(f"{doc['contexts_in_flight']} training forwards in flight (one per layer): "
          f"{doc['in_flight_device_bytes'] * 1e-9:.2f} GB on the device, of which "
          f"{doc['in_flight_output_bytes'] * 1e-9:.2f} GB their outputs; a context is "
          f"{doc['saved_context_bytes'] * 1e-9:.2f} GB.")


def render_moelayer_step(doc):
    """bench/moelayer_step.py: MoELayer's training step, median and repeats."""
    print("| system | preset | tokens/rank | EP | routing | micro-batches | step µs | repeats µs "
          "| device | commit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in doc["runs"]:
        reps = " / ".join(f"{v:.0f}" for v in r["repeat_step_us"])
        print(f"| {r['system']} | {r['preset']} | {r['tokens']} | {r['ep']} | {r['routing']} "
              f"| {r['micro_batches']} | {r['step_us']:.0f} | {reps} | {doc['device']} "
              f"| {doc['commit']} |")


def render_megatron_step(doc):
    """bench/megatron_layer.py: Megatron-Core's MoE layer, its local path against EPFlow's."""
    print("| preset | tokens/rank | EP | Megatron local step µs | EPFlow-backed step µs | speed-up "
          "| tokens/s (local / EPFlow) | TFLOP/s (local / EPFlow) | device | commit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    by_point = {}
    for r in doc["runs"]:
        by_point.setdefault((r["preset"], r["tokens"], r["ep"]), {})[r["system"]] = r
    for (preset, tokens, ep), pair in by_point.items():
        local, ours = pair["megatron-local"], pair["megatron-epflow"]
        print(f"| {preset} | {tokens} | {ep} | {local['step_us']:.0f} | {ours['step_us']:.0f} "
              f"| {local['step_us'] / ours['step_us']:.2f}x "
              f"| {local['tokens_per_s']:.0f} / {ours['tokens_per_s']:.0f} "
              f"| {local['tflops']:.0f} / {ours['tflops']:.0f} | {doc['device']} "
              f"| {doc['commit']} |")


OWN_RENDERERS = {"layer-memory": render_layer_memory, "moelayer-step": render_moelayer_step,
                 "megatron-layer-step": render_megatron_step,
                 "fp8-yardsticks": render_fp8_yardsticks, "fp8-gemm": render_fp8_gemm,
                 "fp8-gemm-vs-deepgemm": render_fp8_gemm_vs_deepgemm}


def main(paths, summary=False):
    docs = [load(p) for p in paths]
    own = [d for d in docs if d.get("kind") in OWN_RENDERERS]
    yardsticks = next((d for d in docs if d.get("kind") == "fp8-yardsticks"), None)
    for i, d in enumerate(own):
        if i:
            print()
        if d["kind"] == "fp8-gemm":
            render_fp8_gemm(d, yardsticks)
        else:
            OWN_RENDERERS[d["kind"]](d)
    docs = [d for d in docs if d.get("kind") not in OWN_RENDERERS]
    if not docs:
        return
    if own:
        print()
    if summary:
        layer = [d for d in docs if d.get("kind") != "gemm"]
        fp8_docs = [d for d in layer if any(r.get("system") == FP8 for r in d["runs"])]
        layer = [{**d, "runs": fp8_summary_runs(d)} if d in fp8_docs else d for d in layer]
        render_summary(layer_runs(layer))
        return
    layer = [d for d in docs if d.get("kind") != "gemm"]
    gemm = [d for d in docs if d.get("kind") == "gemm"]
    runs = layer_runs(layer)

    # EPFlow's own per-stage table (forward stages; a backward run has none).
    def epflow_stages(r):
        return (r.get("system", "epflow") == "epflow" and r.get("direction", "fwd") == "fwd"
                and "stage_us_0" in r)
    epflow = [{**d, "runs": [r for r in d["runs"] if epflow_stages(r)]} for d in layer]
    epflow = [d for d in epflow if d["runs"]]
    if any(r["system"] == FP8 for r in runs):
        render_fp8(runs)
        print()
        if any(r["system"] == FP8 and r["direction"] == "bwd" for r in runs):
            print("EPFlow's FP8 backward and training step against its bf16 ones (same run):\n")
            render_fp8_backward(runs)
            print()
        staged = [{**d, "runs": [r for r in d["runs"] if r.get("system") == FP8
                                 and "stage_us_0" in r]} for d in layer]
        staged = [d for d in staged if d["runs"]]
        if staged:
            print("EPFlow's FP8 forward per stage (metadata+schedule includes quantizing x):\n")
            render_fused(staged)
            print()
    if {(r["system"], r["direction"]) for r in runs if not is_fp8(r["system"])} - {("epflow", "fwd")}:
        render_comparison(runs)
        if epflow:
            print()
            render_epflow(epflow)
        staged = [r for r in runs if is_baseline(r["system"]) and "stage_us_0" in r]
        if staged:
            print()
            render_baseline_stages(staged)
        if any(r["system"] == SWEEP for r in runs):
            print()
            render_sweep(runs)
        if any(r["system"] == "epflow" and r["direction"] == "bwd" and "stage_us" in r
               for r in runs):
            print()
            render_backward_stages(runs)
        if any(r["system"] == SIDE_AB for r in runs):
            print()
            render_side_ab(runs)
    elif epflow:
        render_epflow(epflow)
    if layer and gemm:
        print()
    if gemm:
        render_gemm(gemm)


if __name__ == "__main__":
    args = sys.argv[1:]
    summary = "--summary" in args
    paths = [a for a in args if a != "--summary"]
    if not paths:
        sys.exit(__doc__)
    main(paths, summary)
