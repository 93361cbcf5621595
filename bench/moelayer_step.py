#!/usr/bin/env python3
"""EPFlow through PyTorch: epflow.MoELayer's training step (forward, then backward() of a loss
with the bench's dy), timed with CUDA events, on epflow-bench's inputs (bench/baselines/
inputs.py: the same x, routing, dy and expert weights for a preset, tokens and seed), one
process per GPU under torchrun (EP = its world size).

Each point runs --micro-batches forward-backward pairs per step with the expert gradients
accumulating, in the two ways a user can: autograd's (.grad += each backward's fresh bf16
gradient) and MoELayer(grad_accumulation_fusion=True) (the backward adds into .grad in place).
Compare with epflow-bench --backward --accumulate-grads's train_step_us (EPFlow's own forward +
accumulating backward, C++ API, same gradient dtype) run on the same inputs.

Usage: torchrun --standalone --nproc_per_node 1 bench/moelayer_step.py \\
           [--preset deepseek-v3] [--tokens 2048,8192] [--warmup 20] [--settle-ms 2000] [--iters 20]
           [--repeats 3]
           [--routing uniform|zipf] [--seed 1] [--json out.json]"""
from __future__ import annotations

from torch_bench_env import (git_commit, init_torchrun, median_step_ms,  # first: before torch
                             step_arguments)

import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import inputs  # noqa: E402


def parse_args():
    ap = step_arguments(__doc__, warmup=20)
    ap.add_argument("--micro-batches", type=int, default=2,
                    help="forward-backward pairs per step, gradients accumulating")
    ap.add_argument("--routing", default=inputs.ROUTINGS[0], choices=inputs.ROUTINGS)
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    import epflow

    rank, world, device = init_torchrun()
    p = inputs.PRESETS[args.preset]
    tokens = [int(t) for t in args.tokens.split(",")]
    weights = inputs.make_weights(args.seed, rank, p, device)
    layers = {}
    for fused in (False, True):
        layer = epflow.MoELayer(p.hidden, p.intermediate, p.experts_per_rank * world, p.top_k,
                                max(tokens), grad_accumulation_fusion=fused)
        with torch.no_grad():
            layer.w_gate.copy_(weights.gate)
            layer.w_up.copy_(weights.up)
            layer.w_down.copy_(weights.down)
        layers["fused" if fused else "autograd"] = layer
    del weights
    runs = []
    for T in tokens:
        x = inputs.make_x(args.seed, rank, T, p.hidden, device)
        idx, w = inputs.make_routing(args.seed, rank, T, p.experts_per_rank * world, p.top_k,
                                     device, args.routing)
        dy = inputs.make_dy(args.seed, rank, T, p.hidden, device)
        x.requires_grad_(True)
        w.requires_grad_(True)
        per_repeat = {k: [] for k in layers}
        for _ in range(args.repeats):
            for name, layer in layers.items():
                # A training step: micro_batches x (forward, backward of sum(y * dy)), the expert
                # gradients accumulating in .grad.
                def step(layer=layer):
                    for _ in range(args.micro_batches):
                        layer(x, idx, w).backward(dy)
                ms = torch.tensor(median_step_ms(step, list(layer.parameters()), args.warmup,
                                                 args.iters, args.settle_ms), device=device)
                dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the slowest rank
                per_repeat[name].append(ms.item() * 1e3)
        for name, us in per_repeat.items():
            run = {"system": f"epflow-moelayer-{name}", "preset": args.preset, "tokens": T,
                   "ep": world, "routing": args.routing, "micro_batches": args.micro_batches,
                   "step_us": statistics.median(us), "repeat_step_us": us}
            runs.append(run)
            if rank == 0:
                print(f"MoELayer ({name} accumulation) {args.preset} tokens/rank {T} EP {world} "
                      f"{args.routing}: step of {args.micro_batches} micro-batches "
                      f"{run['step_us']:.1f} us (repeats: "
                      + " / ".join(f"{u:.1f}" for u in us) + ")", flush=True)
    if rank == 0 and args.json:
        args.json.write_text(json.dumps(
            {"kind": "moelayer-step", "device": torch.cuda.get_device_name(device),
             "commit": git_commit(), "date": datetime.date.today().isoformat(),
             "warmup": args.warmup, "settle_ms": args.settle_ms, "iters": args.iters,
             "repeats": args.repeats, "seed": args.seed, "runs": runs}, indent=2) + "\n")
    epflow.release_handles()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
