#!/usr/bin/env python3
"""One command on a GPU machine: EPFlow and its baselines side by side on the same
inputs. Builds nothing: it expects epflow-bench built (scripts/build.sh) and runs, for each EP
size (1, and 2 when two GPUs are present), epflow-bench (EPFlow and its in-process NCCL+cuBLAS
baseline) and torchrun bench/baselines/torch_moe.py (NCCL+PyTorch), merges all results into one
JSON (--out), prints the comparison table (bench/report.py) and writes the plot (bench/plot.py).
First, two checks that make the comparison mean something: the torch inputs on the GPU equal the
C++ ones (bench/baselines/inputs.py --selftest against epflow-inputs-dump, built beside
epflow-bench) and the PyTorch layer matches an fp32 reference (torch_moe.py --check).

--routing uniform,zipf runs every point under each routing distribution (epflow-bench's and
torch_moe.py's --routing; default uniform alone): the runs carry their routing, so the merged
JSON and the table keep them apart, and each routing gets its own plot (RESULTS-ROUTING.png when
there are several).

--dtype fp8 adds the FP8 forward: epflow-bench --dtype fp8 (EPFlow's FP8 layer, its bf16 layer
and NCCL+cuBLAS) and torch_moe.py --dtype fp8 (NCCL+PyTorch's FP8 layer, checked first) beside
the bf16 NCCL+PyTorch run; the merged table then starts with the FP8 comparison. It also runs the
FP8 grouped GEMM alone (epflow-fp8-gemm-bench, beside epflow-bench) and bench/fp8_yardsticks.py
(cuBLAS dense and torch grouped GEMMs in bf16 and FP8, the FP8 weight stream), each into its
own JSON next to --out (OUT-fp8-gemm.json, OUT-fp8-yardsticks.json), and prints their tables.
With --backward as well, epflow-bench --dtype fp8 --backward times EPFlow's FP8 and bf16 backward
and training step, and the table of the FP8 backward sets the FP8 step against NCCL+PyTorch's
bf16 one from the same run.

Where nvidia-smi is present, GPU 0's SM clock and power are sampled throughout and summarised per
step (bench/clock_windows.py) at the end and into OUT-clocks.txt: on an H200 the FP8 GEMMs run at
the software power cap, and the clock they got is part of reading their figures.

Usage: bench/run_all.py --out results.json [--bench build/epflow-bench] [--dump PATH]
         [--png results.png] [--presets a,b] [--tokens 128,512] [--ep 1,2] [--iters N]
         [--warmup N] [--settle-ms N] [--repeats N] [--seed S] [--routing uniform,zipf]
         [--yardstick at-once|one-by-one|interleaved] [--backward] [--dtype bf16|fp8]"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR / "baselines"))
import clock_windows  # noqa: E402
import inputs  # noqa: E402  (the routing kinds' names; torch, which the baseline needs anyway)
import plot  # noqa: E402
import report  # noqa: E402

PRESETS = "deepseek-v3,qwen3-235b-a22b,qwen3-30b-a3b,deepseek-v4-flash"
TOKENS = "128,512,2048,4096,8192"
# NVLink multicast (NVLS) can take the shared host down (BRIEF §2): off in every subprocess.
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def run(cmd: list[str], env: dict[str, str]) -> None:
    """Runs one step, its output straight to the terminal; a failure ends run_all with the
    command that failed."""
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    rc = subprocess.run(cmd, env=env, cwd=REPO, check=False).returncode
    if rc != 0:
        sys.exit(f"run_all.py: FAILED (exit {rc}): {shlex.join(cmd)}")


def run_json(cmd: list[str], env: dict[str, str], json_path: Path) -> dict:
    """Runs one benchmark that writes json_path and returns that JSON."""
    run(cmd, env)
    try:
        return json.loads(json_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"run_all.py: FAILED: {shlex.join(cmd)} wrote no readable {json_path}: {e}")


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                         text=True, check=False)
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def gpu_count() -> int:
    import torch  # the baseline's own interpreter: it must have torch with CUDA anyway
    return torch.cuda.device_count()


def routing_list(text: str) -> list[str]:
    """--routing's comma-separated kinds, each known and named once, in the order given."""
    kinds = text.split(",")
    for kind in kinds:
        if kind not in inputs.ROUTINGS:
            raise argparse.ArgumentTypeError(
                f"{kind!r} is not one of {', '.join(inputs.ROUTINGS)}")
    if len(set(kinds)) < len(kinds):
        raise argparse.ArgumentTypeError(f"{text!r} names a routing twice")
    return kinds


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="merged JSON of every run")
    ap.add_argument("--png", type=Path, help="plot (default: --out with .png)")
    ap.add_argument("--bench", type=Path, default=REPO / "build" / "epflow-bench",
                    help="the epflow-bench executable (default: build/epflow-bench)")
    ap.add_argument("--dump", type=Path,
                    help="the epflow-inputs-dump executable (default: beside --bench)")
    ap.add_argument("--presets", default=PRESETS)
    ap.add_argument("--tokens", default=TOKENS, help="tokens per rank")
    ap.add_argument("--ep", help="EP sizes (default: 1, and 2 with two or more GPUs)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=100,
                    help="untimed calls first, every system and yardstick (epflow-bench's)")
    ap.add_argument("--settle-ms", type=int, default=2000,
                    help="before each warm-up, untimed calls for this many ms of GPU time, every "
                    "layer system and its yardsticks (bench/settle.h; not the FP8 GEMM step)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="every system's --repeats: medians over N runs of each point's sequence "
                    "(epflow-bench: EPFlow, its unfused chain, NCCL+cuBLAS, yardsticks; "
                    "torch_moe.py: NCCL+PyTorch forward and backward)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--routing", type=routing_list, default=[inputs.ROUTINGS[0]],
                    help="routing distributions, comma-separated: every system runs every point "
                    "under each (" + ", ".join(inputs.ROUTINGS) + "; default uniform)")
    ap.add_argument("--backward", action="store_true",
                    help="also time EPFlow's backward (epflow-bench --backward, bf16 weight "
                    "gradients like the PyTorch layer's) next to the NCCL+PyTorch backward")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"],
                    help="fp8: also EPFlow's and NCCL+PyTorch's FP8 forward; with --backward "
                    "EPFlow's FP8 backward and training step too, beside its bf16 ones and "
                    "NCCL+PyTorch's bf16 training step (its FP8 layer has no backward)")
    ap.add_argument("--yardstick", default="at-once",
                    choices=["at-once", "one-by-one", "interleaved"],
                    help="how epflow-bench measures its cuBLAS yardstick (its --yardstick)")
    args = ap.parse_args()
    if args.png is None:
        args.png = args.out.with_suffix(".png")
    if args.dump is None:
        args.dump = args.bench.parent / "epflow-inputs-dump"
    return args


def main() -> int:
    args = parse_args()
    clocks = clock_windows.Sampler()
    try:
        return run_all(args, clocks)
    finally:
        lines = clocks.close()
        if lines:
            text = "GPU 0 per step (bench/clock_windows.py):\n" + "\n".join(lines) + "\n"
            print("\n" + text)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            Path(f"{args.out.with_suffix('')}-clocks.txt").write_text(text)


def timed_step(clocks: clock_windows.Sampler, label: str, cmd: list[str], env: dict[str, str],
               json_path: Path) -> dict:
    """run_json, marked as one window of the clock samples."""
    clocks.mark(label, "begin")
    doc = run_json(cmd, env, json_path)
    clocks.mark(label, "end")
    return doc


def run_all(args: argparse.Namespace, clocks: clock_windows.Sampler) -> int:
    bench, dump = args.bench.resolve(), args.dump.resolve()
    fp8_gemm_bench = bench.parent / "epflow-fp8-gemm-bench"
    for exe in (bench, dump) + ((fp8_gemm_bench,) if args.dtype == "fp8" else ()):
        if not os.access(exe, os.X_OK):
            sys.exit(f"run_all.py: {exe} is not an executable: build it first (scripts/build.sh)")
    gpus = gpu_count()
    if gpus == 0:
        sys.exit("run_all.py: no CUDA GPU visible")
    eps = [int(e) for e in args.ep.split(",")] if args.ep else [1] + ([2] if gpus >= 2 else [])
    if max(eps) > gpus:
        sys.exit(f"run_all.py: EP {max(eps)} asked for, {gpus} GPUs present")
    commit = os.environ.get("EPFLOW_COMMIT") or git_commit()
    env = {**os.environ, **NVLS_OFF, "EPFLOW_COMMIT": commit}
    # The same points, warm-up, timed calls and repeats for every system.
    common = ["--tokens", args.tokens, "--iters", str(args.iters), "--warmup", str(args.warmup),
              "--settle-ms", str(args.settle_ms), "--repeats", str(args.repeats), "--seed",
              str(args.seed)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    torch_moe = str(BENCH_DIR / "baselines" / "torch_moe.py")

    # The selftest compares every routing kind.
    run([sys.executable, str(BENCH_DIR / "baselines" / "inputs.py"), "--selftest", str(dump),
         "--device", "cuda"], env)
    fp8 = ["--dtype", "fp8"] if args.dtype == "fp8" else []
    for routing in args.routing:
        run([*torchrun, str(max(eps)), torch_moe, "--check", "--routing", routing], env)
        if fp8:
            run([*torchrun, str(max(eps)), torch_moe, "--check", "--routing", routing, *fp8],
                env)
    docs = []
    with tempfile.TemporaryDirectory(prefix="epflow-run-all-") as tmp:
        for routing in args.routing:
            for ep in eps:
                part = Path(tmp) / f"epflow-ep{ep}-{routing}.json"
                docs.append(timed_step(
                    clocks, f"epflow-bench ep{ep} {routing}",
                    [str(bench), "--ep", str(ep), "--preset", args.presets, *common,
                     "--routing", routing, "--yardstick", args.yardstick,
                     *(["--backward"] if args.backward else []), *fp8, "--json", str(part)],
                    env, part))
                part = Path(tmp) / f"torch-ep{ep}-{routing}.json"
                docs.append(timed_step(
                    clocks, f"nccl-pytorch ep{ep} {routing}",
                    [*torchrun, str(ep), torch_moe, "--presets", args.presets, *common,
                     "--routing", routing, "--json", str(part)], env, part))
                if fp8:
                    part = Path(tmp) / f"torch-fp8-ep{ep}-{routing}.json"
                    docs.append(timed_step(
                        clocks, f"nccl-pytorch-fp8 ep{ep} {routing}",
                        [*torchrun, str(ep), torch_moe, "--presets", args.presets, *common,
                         "--routing", routing, *fp8, "--json", str(part)], env, part))

    # One layer document whose runs carry their EP and routing (report.py and plot.py read it as
    # is).
    runs = report.layer_runs(docs)
    device = " / ".join(dict.fromkeys(d["device"] for d in docs))
    for r in runs:
        del r["device"], r["commit"]
    merged = {"kind": "layer", "device": device, "commit": commit,
              "date": datetime.date.today().isoformat(), "runs": runs,
              "stages": next((d["stages"] for d in docs if "stages" in d), [])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(merged, indent=2) + "\n")
    print(f"\nmerged results: {args.out}\n")
    if fp8:
        # The GEMM alone and the yardsticks it is normalised by, in the same session; both
        # without settling (--warmup only): DeepGEMM's figures they are set against were
        # measured that way.
        stem = args.out.with_suffix("")
        gemm_path = Path(f"{stem}-fp8-gemm.json")
        yard_path = Path(f"{stem}-fp8-yardsticks.json")
        gemm_doc = timed_step(clocks, "fp8-gemm",
                              [str(fp8_gemm_bench), "--warmup", str(args.warmup), "--iters",
                               str(args.iters), "--repeats", str(args.repeats), "--json",
                               str(gemm_path)], env, gemm_path)
        yard_doc = timed_step(clocks, "fp8-yardsticks",
                              [sys.executable, str(BENCH_DIR / "fp8_yardsticks.py"), "--warmup",
                               str(args.warmup), "--iters", str(args.iters), "--repeats",
                               str(args.repeats), "--json", str(yard_path)], env, yard_path)
        print(f"\nFP8 grouped GEMM: {gemm_path}; FP8 yardsticks: {yard_path}\n")
        report.render_fp8_gemm(gemm_doc, yard_doc)
        print()
        report.render_fp8_yardsticks(yard_doc)
        print()
        report.render_fp8(report.layer_runs([merged]))
        print()
        if args.backward:
            report.render_fp8_backward(report.layer_runs([merged]))
            print()
    report.render_comparison(report.layer_runs([merged]))
    # A plot draws one series per system and point: one plot per routing.
    for routing in args.routing:
        png = (args.png if len(args.routing) == 1
               else args.png.with_name(f"{args.png.stem}-{routing}{args.png.suffix}"))
        routed = [r for r in report.layer_runs([merged]) if r["routing"] == routing]
        plot.plot(routed, f"{plot.title_of([merged])}, {routing} routing", png)
        print(f"\nplot ({routing} routing): {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
