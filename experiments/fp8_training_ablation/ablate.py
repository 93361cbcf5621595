#!/usr/bin/env python3
"""Which of the FP8 recipe's roundings costs examples/train_moe.py's FP8 model its loss?

An experiment beside EPFlow, not part of it. It trains train_moe.py's model (its teacher, data,
optimizer and loss, imported from it) with a pure-PyTorch MoE that emulates EPFlow's FP8 recipe
(docs/design/fp8_backward.md) by quantize-dequantize in fp32, each rounding switched on its own:

    x      the routed rows, 1 x 128 blocks, as the forward GEMMs read them
    xw     the same rounding of x as d W_gate's and d W_up's operand (off: those read x itself)
    w      the expert weights, 128 x 128 blocks (both layouts: the same blocks)
    h      the down GEMM's input w*h, 1 x 128
    dy     the output gradient, 1 x 128 (dhp GEMM; the weight gradients read it too)
    dgu    [dg | du], 1 x 128 (dx GEMM)
    wgrad  the weight gradients' operands along the tokens, per expert: dy and [dg | du] 128 x 1,
           w*h and x 128 x 128 (off: those GEMMs on the rows as the rest leaves them)

Scales are amax / 448 of each block (EPFlow's default), e4m3 round-to-nearest. It runs `none`
(fp32 math on the bf16 parameters), `all` (the recipe as EPFlow runs it at these shapes), then
`all` without each rounding and each rounding alone, and prints each run's final loss (mean of
the last 20 steps, as train_moe.py's rule 4) and its distance from `none`. If `all` lands near
the real FP8 layer's gap (10.8% above bf16 at the defaults), the runs without one rounding say
which one the gap comes from.

    python3 experiments/fp8_training_ablation/ablate.py [--steps 600] [--configs none,all,...]
    python3 experiments/fp8_training_ablation/ablate.py --first-step-errors --configs none,all

The second form checks the emulation: the first step's gradients of `all` against `none`, to set
beside what train_moe.py --dtype fp8 prints for the real FP8 layer against the PyTorch one.

On a GPU (one process, EP = 1) it needs no EPFlow build; on the CPU it runs too (slowly: use
--steps and --tokens to shrink it).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_moe  # noqa: E402  (the model, teacher, training loop and final-loss rule)
from common import experts_seed, final_loss_at, parse_horizons  # noqa: E402

ROUNDINGS = ("x", "xw", "w", "h", "dy", "dgu", "wgrad")
E4M3_MAX = 448.0


def quantized(t: torch.Tensor, rows: int, cols: int, on: bool = True) -> torch.Tensor:
    """t [M, N] (fp32) rounded to e4m3 in rows x cols blocks (scale amax / 448 per block; an
    all-zero block stays zero) and returned dequantized; M and N padded to whole blocks."""
    if not on or t.numel() == 0:
        return t
    m, n = t.shape
    pm, pn = -m % rows, -n % cols
    p = F.pad(t, (0, pn, 0, pm))
    b = p.view((m + pm) // rows, rows, (n + pn) // cols, cols)
    amax = b.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (b / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
    return q.view(m + pm, n + pn)[:m, :n]


X_BLOCK = {"x": 128}  # --x-block: the forward's x blocks along K (EPFlow's: 128)


class EmulatedFp8Moe(torch.autograd.Function):
    """y[t] = sum_k w[t,k] W_down_e (silu(W_gate_e x[t]) * (W_up_e x[t])) with the roundings in
    `on`, forward and backward as EPFlow's FP8 layer computes them (fp32 accumulation)."""

    @staticmethod
    def forward(ctx, x, idx, w, w_gate, w_up, w_down, on):
        xq = quantized(x.float(), 1, X_BLOCK["x"], "x" in on)
        wq = [torch.stack([quantized(m[e].float(), 128, 128, "w" in on) for e in range(len(m))])
              for m in (w_gate, w_up, w_down)]
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        per_expert = []
        for e in range(w_gate.shape[0]):
            t, k = torch.nonzero(idx == e, as_tuple=True)  # token order: the pull table's
            xe = xq[t]
            g, u = xe @ wq[0][e].t(), xe @ wq[1][e].t()
            wh = w[t, k].float().unsqueeze(1) * F.silu(g) * u
            y.index_add_(0, t, quantized(wh, 1, 128, "h" in on) @ wq[2][e].t())
            per_expert.append((t, k, g, u))
        ctx.on, ctx.wq, ctx.per_expert = on, wq, per_expert
        ctx.save_for_backward(quantized(x.float(), 1, 128, "xw" in on), w)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xw, w = ctx.saved_tensors  # x as the weight gradients read it
        on, wq = ctx.on, ctx.wq
        dyq = quantized(dy.float(), 1, 128, "dy" in on)
        dx = torch.zeros(xw.shape, dtype=torch.float32, device=xw.device)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        grads = [torch.zeros_like(m) for m in wq]
        fp8_wgrad = "wgrad" in on
        for e, (t, k, g, u) in enumerate(ctx.per_expert):
            dye = dyq[t]
            dh = dye @ wq[2][e]  # before the routing weight
            act = F.silu(g) * u
            dw[t, k] = (dh * act).sum(1)
            we = w[t, k].float().unsqueeze(1)
            dh = dh * we
            sig = torch.sigmoid(g)
            dg = dh * u * sig * (1 + g * (1 - sig))
            du = dh * F.silu(g)
            dgu = quantized(torch.cat([dg, du], 1), 1, 128, "dgu" in on)
            i = g.shape[1]
            dx.index_add_(0, t, dgu[:, :i] @ wq[0][e] + dgu[:, i:] @ wq[1][e])
            # Weight gradients: K = the expert's tokens; the bf16 path reads dy and x as pulled
            # (their 1 x 128 roundings) and [dg | du] before its rounding.
            wh, xe = we * act, xw[t]
            grads[2][e] = quantized(dye, 128, 1, fp8_wgrad).t() @ quantized(wh, 128, 128, fp8_wgrad)
            xk = quantized(xe, 128, 128, fp8_wgrad)
            grads[0][e] = quantized(dg, 128, 1, fp8_wgrad).t() @ xk
            grads[1][e] = quantized(du, 128, 1, fp8_wgrad).t() @ xk
        return (dx.to(dy.dtype), None, dw, grads[0].to(torch.bfloat16),
                grads[1].to(torch.bfloat16), grads[2].to(torch.bfloat16), None)


class EmulatedExperts(nn.Module):
    """A stand-in for epflow.MoELayer (bf16 parameters w_gate, w_up [E, I, H], w_down [E, H, I],
    initialized as MoELayer's) whose forward and backward are EmulatedFp8Moe's."""

    def __init__(self, hidden, intermediate, experts, on, device):
        super().__init__()
        kw = dict(device=device, dtype=torch.bfloat16)
        self.intermediate, self.on = intermediate, frozenset(on)
        self.w_gate = nn.Parameter(torch.empty(experts, intermediate, hidden, **kw))
        self.w_up = nn.Parameter(torch.empty(experts, intermediate, hidden, **kw))
        self.w_down = nn.Parameter(torch.empty(experts, hidden, intermediate, **kw))
        with torch.no_grad():
            for p, fan_in in ((self.w_gate, hidden), (self.w_up, hidden),
                              (self.w_down, intermediate)):
                p.uniform_(-fan_in ** -0.5, fan_in ** -0.5)

    def forward(self, x, topk_idx, topk_weights):
        return EmulatedFp8Moe.apply(x, topk_idx, topk_weights, self.w_gate, self.w_up,
                                    self.w_down, self.on)


def configs(names: str):
    """name -> the roundings it switches on."""
    table = {"none": (), "all": ROUNDINGS}
    table.update({f"all-{r}": tuple(o for o in ROUNDINGS if o != r) for r in ROUNDINGS})
    table.update({f"only-{r}": (r,) for r in ROUNDINGS})
    chosen = list(table) if names == "every" else names.split(",")
    unknown = [n for n in chosen if n not in table]
    if unknown:
        sys.exit(f"ablate.py: unknown configs {unknown}; known: {', '.join(table)}, every")
    return {n: table[n] for n in chosen}


def first_step_errors(models: dict, teacher, tokens: int, device) -> None:
    """Each model's first-step gradients against the first model's (the same weights and batch):
    the worst relative error over the experts for w_gate, w_up, w_down, the whole tensor for the
    rest, as train_moe.py prints the real FP8 layer's against the PyTorch layer's."""
    x = torch.randn(tokens, teacher.head_weight.shape[0], device=device,
                    generator=torch.Generator(device=device).manual_seed(1000))
    target = teacher(x)
    grads = {}
    for name, model in models.items():
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), target).backward()
        grads[name] = {n: p.grad.float() for n, p in model.named_parameters()}
    ref_name, ref = next(iter(grads.items()))

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    for name, g in list(grads.items())[1:]:
        parts = []
        for n, want in ref.items():
            short = n.split(".")[-1] if ".experts." in n else n.removeprefix("blocks.0.")
            err = (max(rel(g[n][e], want[e]) for e in range(want.shape[0]))
                   if ".experts." in n else rel(g[n], want))
            parts.append(f"{short} {err:.1e}")
        print(f"first-step gradients, {name} against {ref_name}: " + ", ".join(parts))


def build(name: str, on, args, teacher, device):
    """train_moe.py's model around EmulatedExperts with the roundings `on`: the same initial
    weights for every config, the router copied from the teacher's."""
    torch.manual_seed(experts_seed(args.seed))
    experts = EmulatedExperts(args.hidden, args.intermediate, args.experts, on, device)
    torch.manual_seed(1)  # the norm and head (train_moe.build_models' seed)
    model = train_moe.Model(args.hidden, args.experts, args.top_k, [experts], device)
    with torch.no_grad():
        model.blocks[0].router.weight.copy_(teacher.router)
    return model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--teacher-intermediate", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--configs", default="none,all," + ",".join(f"all-{r}" for r in ROUNDINGS),
                    help="comma-separated, or 'every' (also each rounding alone)")
    ap.add_argument("--x-block", type=int, default=128, choices=(32, 64, 128),
                    help="the forward's x blocks along K (EPFlow's: 128; 32, 64: what finer "
                         "blocks would give)")
    ap.add_argument("--seed", type=int, default=0,
                    help="teacher `seed` and the experts' initial weights from 100 + 7919 seed "
                         "(0: train_moe.py's; horizons.py draws the same)")
    ap.add_argument("--horizons", default="",
                    help="comma-separated step counts at which to take the final loss too "
                         "(constant learning rate: the loss an n-step run would end with)")
    ap.add_argument("--first-step-errors", action="store_true",
                    help="only the first step's gradients of each config against the first's")
    args = ap.parse_args()
    X_BLOCK["x"] = args.x_block
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    teacher = train_moe.Teacher(args.hidden, args.experts, args.top_k, args.teacher_intermediate,
                                device, seed=args.seed)
    horizons = parse_horizons(args.horizons, args.steps, "ablate.py")
    if args.first_step_errors:
        first_step_errors({n: build(n, on, args, teacher, device)
                           for n, on in configs(args.configs).items()}, teacher, args.tokens,
                          device)
        dist.destroy_process_group()
        return 0
    results = {}
    for name, on in configs(args.configs).items():
        model = build(name, on, args, teacher, device)
        start = time.time()
        losses, _, _ = train_moe.train({name: model}, teacher, args.steps, args.tokens, args.lr,
                                       1, 0, device, log=lambda s: print(s, flush=True))
        per_step = torch.stack(losses[name]).tolist()
        for h in horizons:
            print(f"== {name} at step {h}: final loss {final_loss_at(per_step, h):.5f}",
                  flush=True)
        _, final = train_moe.final_losses(losses, 1)
        results[name] = final[name]
        base = results.get("none")
        rel = f" ({100 * (final[name] / base - 1):+.1f}% against none)" if base else ""
        print(f"== {name} (roundings: {', '.join(on) or 'none'}): final loss {final[name]:.5f}"
              f"{rel}, {time.time() - start:.0f} s", flush=True)
    if "none" in results:
        print("\nconfig      final loss   against none")
        for name, loss in results.items():
            print(f"{name:<10}  {loss:.5f}      {100 * (loss / results['none'] - 1):+6.1f}%")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
