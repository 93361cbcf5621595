#!/usr/bin/env python3
"""How the FP8 model's loss gap moves as training goes on, with the real layers.

An experiment beside EPFlow, not part of it. For each seed it trains examples/train_moe.py's
models (imported from it: its teacher, data, AdamW, loss; seed s draws teacher s and the experts'
initial weights from 100 + 7919 s, seed 0 being the example's own run) for --steps, and takes
the example's final-loss rule (the mean of the last 20 steps) at each of --horizons: with a
constant learning rate the loss at step n of a long run is the loss of an n-step run. At the end
it evaluates each MoE model's weights through both layers on fresh batches:

    bf16 weights, bf16 layer   the bf16 model as trained
    bf16 weights, FP8 layer    what FP8's rounding alone adds to those weights
    FP8 weights, bf16 layer    whether FP8 training left worse weights, its rounding aside
    FP8 weights, FP8 layer     the FP8 model as trained

    python3 experiments/fp8_training_ablation/horizons.py --seeds 0,1,2 --steps 2400 \
        --horizons 600,1200,1800,2400 [--json OUT.json] [train_moe.py's options]
    python3 experiments/fp8_training_ablation/horizons.py --table OUT.json

It needs EPFlow's PyTorch extension (built with -DEPFLOW_BUILD_PYTHON=ON) and one GPU (EP = 1);
the second form (markdown tables of a saved run) needs neither, only PyTorch.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_moe  # noqa: E402  (the models, teacher, training loop and final-loss rule)
from common import experts_seed, final_loss_at, parse_horizons  # noqa: E402


def tables(path: str) -> None:
    """Markdown tables of a saved run: the FP8 model's and the PyTorch model's final loss
    against the bf16 EPFlow model's at each horizon and seed, then the cross-evaluation."""
    saved = json.loads(Path(path).read_text())
    runs = saved["runs"]
    seeds = [r["seed"] for r in runs]
    print("| steps | " + " | ".join(f"seed {s}: bf16 / FP8 (gap) / PyTorch (gap)" for s in seeds)
          + " | mean FP8 gap |")
    print("|---:|" + "---|" * len(seeds) + "---:|")
    for h in saved["horizons"]:
        cells, gaps = [], []
        for r in runs:
            f = r["final_loss_at"][str(h)]
            gap = 100 * (f["epflow-fp8"] / f["epflow"] - 1)
            gaps.append(gap)
            cells.append(f"{f['epflow']:.5f} / {f['epflow-fp8']:.5f} ({gap:+.1f}%) / "
                         f"{f['pytorch']:.5f} ({100 * (f['pytorch'] / f['epflow'] - 1):+.1f}%)")
        print(f"| {h} | " + " | ".join(cells) + f" | {sum(gaps) / len(gaps):+.1f}% |")
    print()
    names = list(runs[0]["cross_evaluation"])
    print("| weights, layer | " + " | ".join(f"seed {s}" for s in seeds) + " |")
    print("|---|" + "---:|" * len(seeds))
    for name in names:
        cells = []
        for r in runs:
            c = r["cross_evaluation"]
            base = c["bf16 weights, bf16 layer"]
            cells.append(f"{c[name]:.5f} ({100 * (c[name] / base - 1):+.1f}%)")
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", metavar="JSON", help="print a saved run's tables and exit")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--horizons", default="",
                    help="comma-separated step counts (default: --steps alone)")
    ap.add_argument("--json", help="write the results here as well")
    ours, rest = ap.parse_known_args()
    if ours.table:
        tables(ours.table)
        return 0
    args = train_moe.parse_args(rest + ["--dtype", "fp8"])
    horizons = parse_horizons(ours.horizons, args.steps, "horizons.py") or [args.steps]
    if not torch.cuda.is_available():
        sys.exit("horizons.py: EPFlow needs a CUDA GPU (H100/H200)")
    import epflow

    rank, world, device = train_moe.init_distributed()
    if world != 1:
        sys.exit("horizons.py: one process (EP = 1)")
    results = []
    for seed in (int(s) for s in ours.seeds.split(",")):
        start = time.time()
        teacher = train_moe.Teacher(args.hidden, args.experts, args.top_k,
                                    args.teacher_intermediate, device, seed=seed)
        torch.manual_seed(experts_seed(seed))
        shape = (args.hidden, args.intermediate, args.experts, args.top_k, args.tokens)
        moes = [epflow.MoELayer(*shape)]
        moes_fp8 = [epflow.MoELayer(*shape, dtype="fp8")]
        models = train_moe.build_models(moes, teacher, args, 1, device, moes_fp8)
        losses, _, _ = train_moe.train(models, teacher, args.steps, args.tokens, args.lr, 1, 0,
                                       device, log_every=300, log=lambda s: print(s, flush=True))
        per_step = {k: torch.stack(v).tolist() for k, v in losses.items()}
        at = {h: {k: final_loss_at(v, h) for k, v in per_step.items()} for h in horizons}
        cross = train_moe.cross_evaluate(models, teacher, args.tokens, 0, 1, device)
        results.append({"seed": seed, "final_loss_at": at, "cross_evaluation": cross,
                        "losses": per_step})
        print(f"== seed {seed} ({time.time() - start:.0f} s)")
        for h in horizons:
            f = at[h]
            print(f"   step {h:5d}: epflow {f['epflow']:.5f}  epflow-fp8 {f['epflow-fp8']:.5f} "
                  f"({100 * (f['epflow-fp8'] / f['epflow'] - 1):+.1f}%)  pytorch "
                  f"{f['pytorch']:.5f} ({100 * (f['pytorch'] / f['epflow'] - 1):+.1f}%)  "
                  f"linear {f['linear']:.5f}", flush=True)
        base = cross["bf16 weights, bf16 layer"]
        for name, loss in cross.items():
            print(f"   {name}: {loss:.5f} ({100 * (loss / base - 1):+.1f}%)", flush=True)
        if ours.json:  # after every seed: a run cut short keeps the seeds it finished
            Path(ours.json).write_text(json.dumps({"args": vars(args), "horizons": horizons,
                                                   "runs": results}) + "\n")
        del models, moes, moes_fp8
        epflow.release_handles()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
