#!/usr/bin/env python3
"""Trains a small MoE transformer block with EPFlow, and the same model with the pure-PyTorch
expert-parallel layer (bench/baselines/torch_moe.py: all_to_all + torch._grouped_mm, autograd
backward), side by side on the same data from the same initial weights.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --standalone --nproc_per_node 2 examples/train_moe.py [--steps 300]

The block: y = x + MoE(rmsnorm(x)) routed by a linear router (top-k of a softmax, renormalised),
then a linear head; the loss is the mean squared error to a fixed random teacher network of x,
so it can fall. Experts are split over the ranks (expert parallelism); the router, norm and head
are replicated and their gradients averaged over the ranks (data parallelism), the experts'
gradients scaled by 1/world likewise (each rank's loss is a mean over its own tokens). Every 25
steps it prints both losses; at the end, their means over the last 20 steps, their relative
difference, and tokens/s of each model's training step (forward + backward + optimizer, timed
with CUDA events, the two models alternating every step). Exit status 1 if EPFlow's loss did not
fall to half its start, or ends more than 5% away from the PyTorch model's.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off (BRIEF §2)
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "bench" / "baselines"))
import epflow  # noqa: E402
import torch_moe  # noqa: E402  (the pure-PyTorch expert-parallel layer)


class TorchExperts(nn.Module):
    """This rank's experts for the pure-PyTorch layer: the same tensors as an EPFlow MoELayer's
    (copied), gate and up stored as one [E_local, 2I, H] weight as torch_moe.moe_forward wants."""

    def __init__(self, moe: epflow.MoELayer):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.cat([moe.w_gate.detach(), moe.w_up.detach()], 1))
        self.w_down = nn.Parameter(moe.w_down.detach().clone())
        self.world = moe.ep_size

    def forward(self, x, topk_idx, topk_weights):
        return torch_moe.moe_forward(x, topk_idx, topk_weights, self.w_gate_up, self.w_down,
                                     self.world)


class Block(nn.Module):
    def __init__(self, experts: nn.Module, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, device="cuda")
        self.router = nn.Linear(hidden, num_experts, bias=False, device="cuda")
        self.experts = experts
        self.head = nn.Linear(hidden, hidden, device="cuda")
        self.top_k = top_k

    def forward(self, x):
        h = self.norm(x.float())
        probs = self.router(h).softmax(-1)
        w, idx = probs.topk(self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        # int64 ids: torch_moe indexes with them; MoELayer converts to its int32 itself.
        y = self.experts(h.to(torch.bfloat16), idx.contiguous(), w.contiguous())
        return self.head(x.float() + y.float())


def replicated(model: Block):
    return [p for n, p in model.named_parameters() if not n.startswith("experts.")]


def sync_grads(model: Block, world: int):
    """Data-parallel average of the replicated parameters' gradients; the experts' gradients
    (already summed over every rank's tokens by the expert-parallel backward) scaled to match."""
    for p in replicated(model):
        dist.all_reduce(p.grad)
        p.grad /= world
    for p in model.experts.parameters():
        p.grad /= world


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank per step")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    H, T = args.hidden, args.tokens

    torch.manual_seed(0)  # the teacher: the same on every rank
    teacher = nn.Sequential(nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H)).cuda().requires_grad_(False)
    torch.manual_seed(100 + rank)  # this rank's experts
    moe = epflow.MoELayer(H, args.intermediate, args.experts, args.top_k, T)
    torch.manual_seed(1)  # the replicated router, norm and head: the same on every rank
    model_ep = Block(moe, H, args.experts, args.top_k)
    model_pt = Block(TorchExperts(moe), H, args.experts, args.top_k)
    model_pt.load_state_dict({k: v for k, v in model_ep.state_dict().items()
                              if not k.startswith("experts.")}, strict=False)
    models = {"epflow": model_ep, "pytorch": model_pt}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=args.lr) for k, m in models.items()}
    losses = {k: [] for k in models}
    times_ms = {k: [] for k in models}
    data = torch.Generator(device="cuda").manual_seed(1000 + rank)

    for step in range(args.steps):
        x = torch.randn(T, H, device="cuda", generator=data)
        target = teacher(x)
        for name, model in models.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opts[name].zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), target)
            loss.backward()
            sync_grads(model, world)
            opts[name].step()
            end.record()
            losses[name].append(loss.detach())
            times_ms[name].append((start, end))
        if step % 25 == 0 or step == args.steps - 1:
            l_ep, l_pt = (losses[k][-1].item() for k in models)
            if rank == 0:
                print(f"step {step:4d}  loss epflow {l_ep:.5f}  pytorch {l_pt:.5f}", flush=True)

    torch.cuda.synchronize()
    tail = min(20, args.steps)
    mean = {k: torch.stack(v[-tail:]).mean() for k, v in losses.items()}
    first = {k: v[0] for k, v in losses.items()}
    for v in list(mean.values()) + list(first.values()):
        dist.all_reduce(v)
        v /= world
    warm = min(10, args.steps - 1)  # untimed: allocator and autotuning warm-up
    tps = {}
    for name, events in times_ms.items():
        ms = sorted(s.elapsed_time(e) for s, e in events[warm:])
        t = torch.tensor(ms[len(ms) // 2], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
        tps[name] = world * T / (t.item() * 1e-3)
    diff = abs(mean["epflow"].item() - mean["pytorch"].item()) / mean["pytorch"].item()
    fell = mean["epflow"].item() <= 0.5 * first["epflow"].item()
    if rank == 0:
        print(f"loss start -> mean of the last {tail} steps: epflow {first['epflow'].item():.5f} "
              f"-> {mean['epflow'].item():.5f}, pytorch {first['pytorch'].item():.5f} -> "
              f"{mean['pytorch'].item():.5f} (difference {100 * diff:.2f}%)")
        print(f"tokens/s (median training step, {world} GPUs): epflow {tps['epflow']:.0f}, "
              f"pytorch {tps['pytorch']:.0f} ({tps['epflow'] / tps['pytorch']:.2f}x)")
        print("OK" if fell and diff <= 0.05 else
              f"FAILED: {'loss did not halve' if not fell else 'losses differ by more than 5%'}")
    epflow.release_handles()
    dist.destroy_process_group()
    return 0 if fell and diff <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
