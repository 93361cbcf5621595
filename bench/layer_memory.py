#!/usr/bin/env python3
"""GPU memory of a stack of epflow.MoELayer: what the first layer costs, what each further layer
costs, and what each training forward in flight keeps, measured on the device (used bytes from
cudaMemGetInfo, after torch's cache is emptied) beside EPFlow's own accounting
(epflow.workspace_memory(), Handle.saved_context_bytes()) and the parameters' bytes.

Creates --layers layers of a preset's per-rank shape one by one on one process group, then runs
one training forward through all of them (every context in flight, as a pipeline schedule holds
them), then the backward. One process per GPU under torchrun (EP = its world size).

Usage: torchrun --standalone --nproc_per_node 1 bench/layer_memory.py \\
           [--preset deepseek-v3] [--tokens 8192] [--layers 8] [--json out.json]"""
from __future__ import annotations

from torch_bench_env import git_commit, init_torchrun  # first: before torch loads

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import inputs  # noqa: E402

import epflow  # noqa: E402


def device_used():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="deepseek-v3")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rank, world, _ = init_torchrun()
    p = inputs.PRESETS[a.preset]
    H, I, E, K = p.hidden, p.intermediate, p.experts_per_rank * world, p.top_k
    T = a.tokens
    base = device_used()
    layers, rows = [], []
    for n in range(1, a.layers + 1):
        layers.append(epflow.MoELayer(H, I, E, K, T))
        ws = epflow.workspace_memory()
        rows.append({"layers": n, "device_used_bytes": device_used() - base,
                     "workspace_bytes": sum(ws.values()), "workspace": ws,
                     "parameter_bytes": sum(q.numel() * q.element_size()
                                            for m in layers for q in m.parameters())})
    context_bytes = int(epflow._HANDLES[layers[0]._key].saved_context_bytes())
    g = torch.Generator(device="cuda").manual_seed(1 + rank)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    w, idx = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1)
    idx, w = idx.to(torch.int32).contiguous(), (w / w.sum(1, keepdim=True)).contiguous()
    before_forward = device_used()
    ys = [m(x.detach().requires_grad_(True), idx, w) for m in layers]  # contexts in flight
    in_flight = device_used() - before_forward
    out_bytes = sum(y.numel() * y.element_size() for y in ys)
    sum(y.float().square().mean() for y in ys).backward()
    torch.cuda.synchronize()
    result = {
        "kind": "layer-memory", "device": torch.cuda.get_device_name(),
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(), "preset": a.preset, "ep": world,
        "max_tokens_per_rank": T, "rows": rows, "tokens": T,
        "contexts_in_flight": len(layers), "in_flight_device_bytes": in_flight,
        "in_flight_output_bytes": out_bytes, "saved_context_bytes": context_bytes,
    }
    if rank == 0:
        print(f"{a.preset}, {T} tokens/rank, EP {world}, {result['device']}:")
        print("layers | device used GB | EPFlow workspace GB | parameters GB")
        for r in rows:
            print(f"{r['layers']:6d} | {r['device_used_bytes'] * 1e-9:14.2f} | "
                  f"{r['workspace_bytes'] * 1e-9:19.2f} | {r['parameter_bytes'] * 1e-9:13.2f}")
        print(f"{len(layers)} training forwards in flight: {in_flight * 1e-9:.2f} GB on the device "
              f"({out_bytes * 1e-9:.2f} GB of them their outputs y); a context is "
              f"{context_bytes * 1e-9:.2f} GB")
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    epflow.release_handles()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
