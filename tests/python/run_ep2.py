"""EPFlow's forward at EP=2, one process per GPU, bootstrapped from torch.distributed (NCCL):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --standalone --nproc_per_node 2 tests/python/run_ep2.py

Each rank owns half the experts; every rank checks its own tokens' output against a pure-PyTorch
reference over all experts' weights (all-gathered), then the gradients: of x and topk_weights
against the reference's on this rank's tokens, of its experts' weights against the reference's
summed over both ranks' tokens (all-reduced). Prints "EP2 OK rank r" per rank.
"""
import os
import sys

import torch
import torch.distributed as dist

import epflow
from epflow.reference import reference_moe, rel_err

H, I, E, K, T_MAX, TOL = 256, 128, 8, 4, 256, 2e-2


def main():
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)
    layer = epflow.MoELayer(H, I, E, K, T_MAX)
    assert layer.experts_per_rank == E // world
    full = {}
    for name in ("w_gate", "w_up", "w_down"):
        p = getattr(layer, name).detach()
        out = torch.empty((world * p.shape[0],) + tuple(p.shape[1:]), dtype=p.dtype,
                          device=p.device)
        dist.all_gather_into_tensor(out, p.contiguous())
        full[name] = out
    ok = True
    for T in (T_MAX, 37 + 50 * rank, 0 if rank == 1 else 5):  # T differs per rank, may be 0
        g = torch.Generator(device="cuda").manual_seed(1000 * rank + T)
        x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        w, idx = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1)
        idx = idx.to(torch.int32)
        if T:
            idx[::5, 0] = -1
        w = (w / w.sum(1, keepdim=True)).float().contiguous()
        with torch.no_grad():
            y = layer(x, idx.contiguous(), w)
        torch.cuda.synchronize()
        ref = reference_moe(x, idx, w, full["w_gate"], full["w_up"], full["w_down"])
        err = rel_err(y, ref) if T else 0.0
        good = bool(torch.isfinite(y).all()) and err <= TOL
        print(f"rank {rank} T={T} rel_err={err:.3e} {'ok' if good else 'FAIL'}", flush=True)
        ok &= good
    params = (layer.w_gate, layer.w_up, layer.w_down)
    e0, e1 = rank * layer.experts_per_rank, (rank + 1) * layer.experts_per_rank
    for T in (100 + 23 * rank, 0 if rank == 1 else 9):  # T differs per rank, may be 0
        g = torch.Generator(device="cuda").manual_seed(2000 * rank + T)
        x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        w, idx = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1)
        idx = idx.to(torch.int32).contiguous()
        w = (w / w.sum(1, keepdim=True)).float().contiguous()
        dy = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        x.requires_grad_(True)
        w.requires_grad_(True)
        for p in params:
            p.grad = None
        y = layer(x, idx, w)
        (y.float() * dy.float()).sum().backward()
        leaves = [t.detach().float().requires_grad_(True)
                  for t in (x, w, full["w_gate"], full["w_up"], full["w_down"])]
        loss = (reference_moe(leaves[0], idx, leaves[1], *leaves[2:]) * dy.float()).sum()
        if loss.requires_grad:  # not with T = 0: nothing depends on the leaves
            loss.backward()
        for t in leaves:
            if t.grad is None:
                t.grad = torch.zeros_like(t)
        for t in leaves[2:]:
            dist.all_reduce(t.grad)  # every rank's tokens reach every expert
        torch.cuda.synchronize()
        got = (x.grad, w.grad) + tuple(p.grad for p in params)
        want = (leaves[0].grad, leaves[1].grad) + tuple(t.grad[e0:e1] for t in leaves[2:])
        for name, a, b in zip(("x", "topk_weights", "w_gate", "w_up", "w_down"), got, want):
            err = rel_err(a, b) if a.numel() else 0.0
            good = a.shape == b.shape and bool(torch.isfinite(a).all()) and err <= 3 * TOL
            print(f"rank {rank} T={T} grad {name} rel_err={err:.3e} {'ok' if good else 'FAIL'}",
                  flush=True)
            ok &= good
    dist.barrier()
    epflow.release_handles()
    dist.destroy_process_group()
    if ok:
        print(f"EP2 OK rank {rank}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
