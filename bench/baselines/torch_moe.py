#!/usr/bin/env python3
"""The NCCL+PyTorch baseline: the expert-parallel MoE layer as a competent PyTorch
user writes it today (all_to_all_single + torch._grouped_mm + permutation kernels, autograd for
the backward), on the same inputs as epflow-bench (bench/baselines/inputs.py mirrors
bench/bench_inputs.h; rank = global rank, num_experts = experts_per_rank * world).

One process per GPU under torchrun:
  torchrun --standalone --nproc_per_node N bench/baselines/torch_moe.py \\
      --presets deepseek-v3 --tokens 512,2048 --json out.json
  torchrun --standalone --nproc_per_node N bench/baselines/torch_moe.py --check

Timing: CUDA events, median per rank after warm-up, the slowest rank's median reported. Forward
is timed with autograd recording (a training forward); backward between an event recorded once
the forward is enqueued and one after backward() returns (it starts when the forward's GPU work
ends), in calls that each run a forward then a backward. TFLOP/s per GPU count 6 * routed slots
* H * I per rank forward, twice that backward.
Without CUDA (gloo on CPU) only --check runs."""
from __future__ import annotations

import os

# NVLink multicast (NVLS) can take the shared host down (BRIEF §2): forced off, not merely
# defaulted, before torch loads NCCL or NVSHMEM.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.nn.functional import all_to_all_single as all_to_all_autograd  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import inputs  # noqa: E402

SYSTEM = "nccl-pytorch"
CHECK_PRESET, CHECK_TOKENS, CHECK_TOL = "tiny", 64, 2e-2


def moe_forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                w_gate_up: torch.Tensor, w_down: torch.Tensor, world: int) -> torch.Tensor:
    """y[t] = sum_k topk_weights[t, k] * expert_{topk_idx[t, k]}(x[t]) over the EP group.

    x [T, H] bf16; topk_idx [T, K] global expert ids (-1: empty slot); topk_weights [T, K] fp32;
    w_gate_up [E_local, 2I, H] (gate rows then up rows); w_down [E_local, H, I]."""
    tokens, hidden = x.shape
    top_k = topk_idx.shape[1]
    experts_local, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    experts = experts_local * world
    dev = x.device

    # Sort the (token, k) slots by destination expert; empty slots get key E and sort last.
    slot_expert = topk_idx.reshape(-1)
    key = torch.where(slot_expert >= 0, slot_expert, experts)
    order = torch.argsort(key, stable=True)
    # scatter_add_, not bincount: CUDA bincount reads the max id back to the host.
    send_per_expert = torch.zeros(experts + 1, dtype=torch.int64, device=dev).scatter_add_(
        0, key, torch.ones_like(key))[:experts]
    # Each owner learns how many rows every source sends to each of its experts ([src, local e]).
    recv_per_expert = torch.empty_like(send_per_expert)
    dist.all_to_all_single(recv_per_expert, send_per_expert)
    recv_per_expert = recv_per_expert.view(world, experts_local)
    # The pipeline's one host sync: NCCL takes the split sizes on the host.
    sizes = torch.cat([send_per_expert.view(world, experts_local).sum(1),
                       recv_per_expert.sum(1)]).tolist()
    send_sizes, recv_sizes = sizes[:world], sizes[world:]
    n_send, n_recv = sum(send_sizes), sum(recv_sizes)

    send_rows = x.index_select(0, order[:n_send] // top_k)
    recv_rows = all_to_all_autograd(x.new_empty(n_recv, hidden), send_rows, recv_sizes,
                                    send_sizes)
    # Rows arrive grouped [source rank][local expert]; the grouped GEMM wants them by expert.
    row_expert = torch.arange(experts_local, device=dev).repeat(world).repeat_interleave(
        recv_per_expert.reshape(-1), output_size=n_recv)
    perm = torch.argsort(row_expert, stable=True)
    offs = torch.cumsum(recv_per_expert.sum(0), 0, dtype=torch.int32)
    gate_up = torch._grouped_mm(recv_rows.index_select(0, perm), w_gate_up.transpose(1, 2),
                                offs=offs)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    out = torch._grouped_mm(act, w_down.transpose(1, 2), offs=offs)
    inv_perm = torch.empty_like(perm).scatter_(0, perm, torch.arange(n_recv, device=dev))
    back = all_to_all_autograd(x.new_empty(n_send, hidden), out.index_select(0, inv_perm),
                               send_sizes, recv_sizes)

    # Slot s's result is row inv_order[s] of `back`; empty slots read an appended zero row, so
    # they add nothing and their weights get zero gradient.
    inv_order = torch.empty_like(order).scatter_(0, order,
                                                 torch.arange(order.numel(), device=dev))
    if n_send < order.numel():
        back = torch.cat([back, back.new_zeros(1, hidden)])
    rows = back.index_select(0, inv_order.clamp(max=n_send)).view(tokens, top_k, hidden)
    # The weighted sum over k as a batched matmul in bf16 (fp32 accumulate): no fp32 row copy.
    return torch.bmm(topk_weights.to(x.dtype).unsqueeze(1), rows).squeeze(1)


def make_weights(seed: int, rank: int, p: inputs.Preset, device: torch.device) -> tuple[
        torch.Tensor, torch.Tensor]:
    """(w_gate_up, w_down) leaves: gate and up stored as one tensor, as a user would to run one
    GEMM for both."""
    w = inputs.make_weights(seed, rank, p, device)
    w_gate_up = torch.cat([w.gate, w.up], dim=1).requires_grad_()
    return w_gate_up, w.down.requires_grad_()


def make_tokens(seed: int, rank: int, p: inputs.Preset, tokens: int, world: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = inputs.make_x(seed, rank, tokens, p.hidden, device).requires_grad_()
    idx, w = inputs.make_routing(seed, rank, tokens, p.experts_per_rank * world, p.top_k,
                                 device)
    return x, idx, w.requires_grad_()


def grad_output(seed: int, rank: int, tokens: int, hidden: int,
                device: torch.device) -> torch.Tensor:
    """dL/dy for the backward: seeded on the CPU so that every rank (and the check's reference)
    can regenerate any rank's."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    return torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16)


# --- --check: against a per-token fp32 reference on all ranks' inputs ---------------------------

def drop_slots(topk_idx: torch.Tensor) -> torch.Tensor:
    """The check's routing: the benchmark's with the last slot of every 5th token empty (-1), so
    that the empty-slot path runs too."""
    idx = topk_idx.clone()
    idx[::5, -1] = -1
    return idx


def reference(seed: int, p: inputs.Preset, tokens: int, world: int) -> tuple[
        list[torch.Tensor], list[list[torch.Tensor]]]:
    """Every rank's y and gradients [dx, d topk_weights, d w_gate_up, d w_down], in fp32 on the
    CPU, token by token, for loss = sum over ranks of <y_r, dy_r>."""
    cpu = torch.device("cpu")
    leaves, idx_all, ys = [], [], []
    for r in range(world):
        w_gate_up, w_down = make_weights(seed, r, p, cpu)
        x, idx, tw = make_tokens(seed, r, p, tokens, world, cpu)
        leaves.append([t.detach().float().requires_grad_() for t in (x, tw, w_gate_up, w_down)])
        idx_all.append(drop_slots(idx))
    inter, el = p.intermediate, p.experts_per_rank
    for r in range(world):
        x, tw = leaves[r][0], leaves[r][1]
        y = []
        for t in range(tokens):
            acc = torch.zeros(p.hidden)
            for k in range(p.top_k):
                e = int(idx_all[r][t, k])
                if e < 0:
                    continue
                w_gate_up, w_down = leaves[e // el][2][e % el], leaves[e // el][3][e % el]
                h = w_gate_up @ x[t]
                acc = acc + tw[t, k] * (w_down @ (F.silu(h[:inter]) * h[inter:]))
            y.append(acc)
        ys.append(torch.stack(y))
    loss = sum((ys[r] * grad_output(seed, r, tokens, p.hidden, cpu).float()).sum()
               for r in range(world))
    loss.backward()
    return [y.detach() for y in ys], [[t.grad for t in rank_leaves] for rank_leaves in leaves]


def run_check(seed: int, rank: int, world: int, device: torch.device) -> bool:
    p = inputs.PRESETS[CHECK_PRESET]
    w_gate_up, w_down = make_weights(seed, rank, p, device)
    x, idx, tw = make_tokens(seed, rank, p, CHECK_TOKENS, world, device)
    y = moe_forward(x, drop_slots(idx), tw, w_gate_up, w_down, world)
    y.backward(grad_output(seed, rank, CHECK_TOKENS, p.hidden, device))
    ref_y, ref_grads = reference(seed, p, CHECK_TOKENS, world)
    got = [y, x.grad, tw.grad, w_gate_up.grad, w_down.grad]
    want = [ref_y[rank]] + ref_grads[rank]
    ok = True
    for name, g, w in zip(["y", "dx", "d topk_weights", "d w_gate_up", "d w_down"], got, want,
                          strict=True):
        err = float((g.detach().float().cpu() - w).norm() / w.norm())
        ok &= err <= CHECK_TOL
        print(f"rank {rank}: {name:15} relative error {err:.2e} "
              f"{'OK' if err <= CHECK_TOL else 'MISMATCH'}", flush=True)
    return ok


# --- timing ----------------------------------------------------------------------------------

def median_ms(fn: Callable[[], None], warmup: int, iters: int) -> float:
    """Median over `iters` runs (after `warmup`) of fn's GPU time, between CUDA events."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(warmup + iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median([s.elapsed_time(e) for s, e in events[warmup:]])


def median_backward_ms(forward: Callable[[], torch.Tensor],
                       backward: Callable[[torch.Tensor], None], warmup: int,
                       iters: int) -> float:
    """Median over `iters` forward+backward calls (after `warmup`) of the backward's GPU time.
    NOTES: timed directly, not as (forward + backward) - forward: at 512 tokens/rank this layer's
    forward is bound by its host work (split sizes copied to the host for all_to_all_single) and
    its median moved by up to 1.8x between runs on 2xH200 (Qwen3-235B-A22B: 1168 to 2139 us),
    which the difference of two medians passed on to the backward (V4-Flash: 1741 to 2772 us
    over four runs)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(warmup + iters)]
    for start, end in events:
        y = forward()
        start.record()
        backward(y)
        end.record()
    torch.cuda.synchronize()
    return statistics.median([s.elapsed_time(e) for s, e in events[warmup:]])


def bench_config(p: inputs.Preset, tokens: int, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                 args: argparse.Namespace, rank: int, world: int,
                 device: torch.device) -> tuple[float, float, int]:
    """This rank's (forward ms, backward ms, routed slots)."""
    x, idx, tw = make_tokens(args.seed, rank, p, tokens, world, device)
    dy = grad_output(args.seed, rank, tokens, p.hidden, device)
    leaves = [x, tw, w_gate_up, w_down]

    def forward() -> torch.Tensor:
        return moe_forward(x, idx, tw, w_gate_up, w_down, world)

    def forward_fresh() -> torch.Tensor:
        for t in leaves:  # fresh gradients, as after optimizer.zero_grad(set_to_none=True)
            t.grad = None
        return forward()

    fwd = median_ms(forward, args.warmup, args.iters)
    bwd = median_backward_ms(forward_fresh, lambda y: y.backward(dy), args.warmup, args.iters)
    for t in leaves:
        t.grad = None
    return fwd, bwd, int((idx >= 0).sum())


def run_bench(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> None:
    runs = []
    for name in args.presets:
        p = inputs.PRESETS[name]
        w_gate_up, w_down = make_weights(args.seed, rank, p, device)
        for tokens in args.tokens:
            fwd, bwd, routed = bench_config(p, tokens, w_gate_up, w_down, args, rank, world,
                                            device)
            # Every rank's numbers, so the slowest rank's time goes with its own FLOPs.
            mine = torch.zeros(world, 3, dtype=torch.float64, device=device)
            mine[rank] = torch.tensor([fwd, bwd, routed], dtype=torch.float64)
            dist.all_reduce(mine)
            per_rank = mine.tolist()
            slow_fwd = max(per_rank, key=lambda v: v[0])
            slow_bwd = max(per_rank, key=lambda v: v[1])
            flops = 6.0 * p.hidden * p.intermediate  # per routed slot, forward
            fwd_us = slow_fwd[0] * 1e3
            bwd_us = slow_bwd[1] * 1e3
            results = [("fwd", fwd_us, flops * slow_fwd[2] / fwd_us * 1e-6),
                       ("bwd", bwd_us, 2 * flops * slow_bwd[2] / bwd_us * 1e-6)]
            for direction, us, tflops in results:
                runs.append({"system": SYSTEM, "direction": direction, "preset": name,
                             "tokens": tokens, "layer_us": us, "layer_tflops_per_gpu": tflops})
                if rank == 0:
                    print(f"{SYSTEM} {name} tokens/rank {tokens} EP {world} {direction}: "
                          f"{us:.1f} us, {tflops:.1f} TFLOP/s/GPU", flush=True)
        del w_gate_up, w_down
        torch.cuda.empty_cache()
    if rank == 0 and args.json:
        doc = {"kind": "layer", "device": torch.cuda.get_device_name(device), "ep": world,
               "commit": os.environ.get("EPFLOW_COMMIT", "unknown"), "runs": runs}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="deepseek-v3",
                    help="comma-separated presets (bench/presets.h): " + ", ".join(inputs.PRESETS))
    ap.add_argument("--tokens", default="4096", help="comma-separated tokens per rank")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=100)  # as epflow-bench: sustained clocks
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the results here (rank 0)")
    ap.add_argument("--check", action="store_true",
                    help=f"compare with an fp32 per-token reference on the {CHECK_PRESET} preset, "
                         f"{CHECK_TOKENS} tokens/rank, instead of timing; exit 1 on mismatch")
    args = ap.parse_args()
    args.presets = [s for s in args.presets.split(",") if s]
    args.tokens = [int(s) for s in args.tokens.split(",") if s]
    unknown = [s for s in args.presets if s not in inputs.PRESETS]
    if unknown:
        ap.error(f"unknown presets {unknown}")
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")
    return args


def main() -> int:
    args = parse_args()
    if "RANK" not in os.environ:
        sys.exit("torch_moe.py: run it under torchrun (one process per GPU)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    elif args.check:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        sys.exit("torch_moe.py: timing needs CUDA GPUs; without them only --check runs (gloo)")
    try:
        if args.check:
            ok = run_check(args.seed, rank, world, device)
            flag = torch.tensor([0 if ok else 1], device=device)
            dist.all_reduce(flag)
            if rank == 0:
                print("OK" if int(flag) == 0 else "MISMATCH", flush=True)
            return 1 if int(flag) else 0
        run_bench(args, rank, world, device)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
