#!/usr/bin/env python3
"""The NCCL+PyTorch baseline: the expert-parallel MoE layer as a competent PyTorch
user writes it today (all_to_all_single + torch._grouped_mm + row gathers, autograd for the
backward), on the same inputs as epflow-bench (bench/baselines/inputs.py mirrors
bench/bench_inputs.h; rank = global rank, num_experts = experts_per_rank * world).

One process per GPU under torchrun:
  torchrun --standalone --nproc_per_node N bench/baselines/torch_moe.py \\
      --presets deepseek-v3 --tokens 512,2048 --repeats 3 --routing zipf --json out.json
  torchrun --standalone --nproc_per_node N bench/baselines/torch_moe.py --check
  torchrun --standalone --nproc_per_node N bench/baselines/torch_moe.py --dtype fp8 \\
      --presets deepseek-v3 --tokens 128,512,2048,8192 --repeats 3 --json out-fp8.json
--routing uniform|zipf (as epflow-bench's; default uniform) picks inputs.py's routing
distribution, for the timing and for --check; every JSON run names it. --dtype bf16|fp8 (default
bf16) picks the layer; every JSON run names its dtype.

The layer (moe_layer) and why its backward costs no more than its GEMMs and row moves need:
- Weights are kept in the layout the grouped GEMMs read: w1 [E_local, H, 2I] (the columns of
  gate, then of up) and w2 [E_local, I, H], so the forward is x @ w1 and act @ w2 with no
  transposed view between a leaf and its GEMM: the weight gradients that torch._grouped_mm's
  backward writes ([E, H, M] @ [M, 2I] and [E, I, M] @ [M, H] per expert) have the leaves'
  layout, and no torch version's handling of a transposed operand (a contiguous copy of a weight
  or of its gradient) comes into it. inputs.py generates gate/up [E, I, H] and down [E, H, I]:
  make_weights lays them out once, untimed, before any call.
- Every row permutation (tokens to their (token, k) slots sorted by expert, received rows to
  expert order and back, returned rows to slots) is a gather (index_select) whose backward is
  again a gather, by the inverse permutation computed once in the forward (_Gather). Autograd's
  own backward of index_select or x[idx] would instead zero-fill the whole source-sized gradient
  and scatter-add into it (index_add_, atomics) or sort its indices (index_put_ accumulate).
  A token's K slots are summed back into dx by that gather plus a sum over k, with no atomics.
- SwiGLU is one autograd function (_SwiGLU) over the [rows, 2I] GEMM output: its backward
  writes d gate and d up straight into the two halves of one [rows, 2I] gradient, where autograd
  through the slices gate_up[:, :I] and gate_up[:, I:] would zero-fill a [rows, 2I] tensor per
  slice, copy each half in and add the two.
- With one rank (EP=1) the received rows are already in expert order: that permutation and its
  inverse are skipped, not run as identity gathers.
- All in bf16 with fp32 accumulation: the grouped GEMMs, the weighted sum over k as a batched
  matmul, the sum over k of dx (torch's reduction); the routing weights are cast to bf16 for
  the weighted sum, the layer's only dtype change.
moe_forward is the same layer for callers that hold gate|up as [E_local, 2I, H] and down as
[E_local, H, I] (examples/train_moe.py): it passes transposed views, which _grouped_mm reads
column-major.

The FP8 layer (--dtype fp8, moe_layer_fp8; system "nccl-pytorch-fp8"): the inference forward as
a competent PyTorch user writes it with torch._scaled_grouped_mm, timed forward only (no autograd,
no backward: --backward is an error with it). Expert weights are quantized once, untimed, to e4m3
with one fp32 scale per output column of each expert (row-wise, what _scaled_grouped_mm takes on
sm_90), kept [E_local, N, K] and passed as the [E_local, K, N] column-major view the op reads.
Timed: each token row is quantized once (scale = row amax / 448, fp32) into a wire row [e4m3 row |
fp32 scale | 12 pad bytes], so one all_to_all_single carries FP8 rows and their scales (row
stride a multiple of 16 bytes, as the GEMM's row-major operand needs); the received rows go to
expert order by the gathers of the BF16 path; gate|up by _scaled_grouped_mm (bf16 out,
[rows, 2I]), SwiGLU in bf16, its rows requantized to e4m3 row-wise, down by _scaled_grouped_mm
(bf16 out); bf16 rows return and are summed over k exactly as in the BF16 path. Both GEMMs
accumulate in fp32 without fast accumulation. --check --dtype fp8 compares y with the same fp32
reference at a relative L2 error <= 0.08 (e4m3 costs ~3-4% per quantized GEMM operand); it needs
CUDA (sm_90/sm_100) and is skipped, exit 0, without.

Timing: CUDA events, median per rank after warm-up, the slowest rank's median reported. Forward
is timed with autograd recording (a training forward); backward between an event recorded once
the forward is enqueued and one after backward() returns (it starts when the forward's GPU work
ends), in calls that each run a forward then a backward. --repeats N (as epflow-bench's): the
whole sequence of a point (forward: warm-up + timed calls, then backward: warm-up + timed calls)
N times; per rank the median over the repeats of each repeat's median, the slowest rank's of
those reported, and each repeat's slowest-rank figure in the run's repeat_layer_us (N > 1).
TFLOP/s per GPU count 6 * routed slots * H * I per rank forward, twice that backward. --dtype fp8
times the forward alone (under torch.inference_mode), the same way, and writes "fwd" runs only.
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
from typing import NamedTuple  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.nn.functional import all_to_all_single as all_to_all_autograd  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import inputs  # noqa: E402
from torch_bench_env import settle  # noqa: E402

SYSTEM = "nccl-pytorch"
SYSTEM_FP8 = "nccl-pytorch-fp8"  # --dtype fp8: its own rows in a merged report
CHECK_PRESET, CHECK_TOKENS, CHECK_TOL = "tiny", 64, 2e-2
# --check --dtype fp8: relative L2 error of y over the whole output. e4m3 rounds to 3 mantissa
# bits: ~3.6% relative error per GEMM with row-wise scales, ~6% after both GEMMs (x and the
# weights quantized, then the SwiGLU output requantized).
CHECK_TOL_FP8 = 0.08
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_AMAX_MIN = 1e-12  # a row of zeros gets a tiny scale, not 0 / 0
FP8_WIRE_PAD = 16  # bytes after a wire row's e4m3 values: its fp32 scale, then padding


def _rows(src: torch.Tensor, index: torch.Tensor, zero_row: bool) -> torch.Tensor:
    """src's rows at index; with zero_row, index len(src) reads a row of zeros."""
    if zero_row:
        src = torch.cat([src, src.new_zeros(1, src.shape[1])])
    return src.index_select(0, index)


class _Gather(torch.autograd.Function):
    """out = src[index] (rows), whose backward is a gather too: d src = d out[inverse], summed
    over each `fan` consecutive rows (a token's K slots; fan 1: a permutation). inverse[j] is
    the row of out that row j of src went to (the inverse permutation). zero_fwd / zero_bwd:
    index / inverse may hold len(source), a zero row (empty slots: --check only)."""

    @staticmethod
    def forward(ctx, src: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, fan: int,
                zero_fwd: bool, zero_bwd: bool) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.fan, ctx.zero_bwd = fan, zero_bwd
        return _rows(src, index, zero_fwd)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        g = _rows(grad, inverse, ctx.zero_bwd)
        if ctx.fan > 1:
            g = g.view(-1, ctx.fan, g.shape[1]).sum(1)
        return g, None, None, None, None, None


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up over h = [gate | up] ([rows, 2I]); the backward writes d gate and d up
    into the halves of one [rows, 2I] gradient."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        inter = h.shape[1] // 2
        gate, up = h[:, :inter], h[:, inter:]
        s = F.silu(gate)
        ctx.save_for_backward(h, s)
        return s * up

    @staticmethod
    def backward(ctx, d_act: torch.Tensor):
        h, s = ctx.saved_tensors
        inter = h.shape[1] // 2
        d_h = torch.empty_like(h)
        d_gate, d_up = d_h[:, :inter], d_h[:, inter:]
        torch.mul(d_act, s, out=d_up)
        torch.mul(d_act, h[:, inter:], out=d_gate)  # d silu(gate), then through silu in place
        torch.ops.aten.silu_backward.grad_input(d_gate, h[:, :inter], grad_input=d_gate)
        return d_h


class _Plan(NamedTuple):
    """Where every (token, k) slot goes: computed by _plan, shared by the BF16 and FP8 layers."""
    slot_pos: torch.Tensor  # [T * K]: the row of the sorted send buffer of each slot
    sent_slot: torch.Tensor  # [n_send]: the slot of each row of the send buffer
    recv_per_expert: torch.Tensor  # [world, E_local]: rows each source sends each local expert
    send_sizes: list[int]
    recv_sizes: list[int]
    n_send: int
    n_recv: int
    empty: bool  # some slots are empty (-1)


def _plan(topk_idx: torch.Tensor, experts_local: int, world: int) -> _Plan:
    """Sorts the (token, k) slots by destination expert and exchanges the row counts (the
    layer's one host sync)."""
    slots = topk_idx.numel()
    experts = experts_local * world
    dev = topk_idx.device
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
    empty = n_send < slots  # empty slots (-1) sort last, past the n_send sent rows

    # slot_pos[s]: the row of the sorted send buffer that slot s went to (n_send: empty slot).
    slot_pos = torch.empty_like(order).scatter_(0, order, torch.arange(slots, device=dev))
    if empty:
        slot_pos = slot_pos.clamp_(max=n_send)
    return _Plan(slot_pos, order[:n_send], recv_per_expert, send_sizes, recv_sizes, n_send,
                 n_recv, empty)


def _expert_order(plan: _Plan, world: int) -> tuple[torch.Tensor, torch.Tensor | None,
                                                     torch.Tensor | None]:
    """(offs, perm, inv_perm) of the received rows: the grouped GEMMs' int32 cumulative row ends
    per local expert, and with world > 1 the permutation of the received rows ([source rank]
    [local expert]) into expert order and its inverse (None with one rank: already in order)."""
    offs = torch.cumsum(plan.recv_per_expert.sum(0), 0, dtype=torch.int32)
    if world == 1:
        return offs, None, None
    experts_local = plan.recv_per_expert.shape[1]
    dev = offs.device
    # Rows arrive grouped [source rank][local expert]; the grouped GEMM wants them by expert.
    row_expert = torch.arange(experts_local, device=dev).repeat(world).repeat_interleave(
        plan.recv_per_expert.reshape(-1), output_size=plan.n_recv)
    perm = torch.argsort(row_expert, stable=True)
    inv_perm = torch.empty_like(perm).scatter_(0, perm, torch.arange(plan.n_recv, device=dev))
    return offs, perm, inv_perm


def moe_layer(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
              w1: torch.Tensor, w2: torch.Tensor, world: int) -> torch.Tensor:
    """y[t] = sum_k topk_weights[t, k] * expert_{topk_idx[t, k]}(x[t]) over the EP group,
    expert_e(v) = (silu(v @ w1[e][:, :I]) * (v @ w1[e][:, I:])) @ w2[e].

    x [T, H] bf16; topk_idx [T, K] global expert ids (-1: empty slot); topk_weights [T, K] fp32;
    w1 [E_local, H, 2I] (gate columns then up columns); w2 [E_local, I, H]."""
    tokens, hidden = x.shape
    top_k = topk_idx.shape[1]
    plan = _plan(topk_idx, w1.shape[0], world)
    slot_pos, sent_slot, n_send, empty = plan.slot_pos, plan.sent_slot, plan.n_send, plan.empty
    send_sizes, recv_sizes = plan.send_sizes, plan.recv_sizes
    send_rows = _Gather.apply(x, sent_slot // top_k, slot_pos, top_k, False, empty)
    recv_rows = all_to_all_autograd(x.new_empty(plan.n_recv, hidden), send_rows, recv_sizes,
                                    send_sizes)
    offs, perm, inv_perm = _expert_order(plan, world)
    if world > 1:
        recv_rows = _Gather.apply(recv_rows, perm, inv_perm, 1, False, False)
    act = _SwiGLU.apply(torch._grouped_mm(recv_rows, w1, offs=offs))
    out = torch._grouped_mm(act, w2, offs=offs)
    if world > 1:
        out = _Gather.apply(out, inv_perm, perm, 1, False, False)
    back = all_to_all_autograd(x.new_empty(n_send, hidden), out, send_sizes, recv_sizes)

    # Slot s's result is row slot_pos[s] of `back`; empty slots read a zero row, so they add
    # nothing and their weights get zero gradient.
    rows = _Gather.apply(back, slot_pos, sent_slot, 1, empty, False).view(tokens, top_k, hidden)
    # The weighted sum over k as a batched matmul in bf16 (fp32 accumulate): no fp32 row copy.
    return torch.bmm(topk_weights.to(x.dtype).unsqueeze(1), rows).squeeze(1)


def moe_forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                w_gate_up: torch.Tensor, w_down: torch.Tensor, world: int) -> torch.Tensor:
    """moe_layer with w_gate_up [E_local, 2I, H] (gate rows then up rows) and w_down
    [E_local, H, I], as transposed views (the grouped GEMMs read them column-major)."""
    return moe_layer(x, topk_idx, topk_weights, w_gate_up.transpose(1, 2),
                     w_down.transpose(1, 2), world)


def make_weights(seed: int, rank: int, p: inputs.Preset, device: torch.device) -> tuple[
        torch.Tensor, torch.Tensor]:
    """(w1 [E_local, H, 2I], w2 [E_local, I, H]) leaves: inputs.py's gate/up [E, I, H] and down
    [E, H, I] laid out once as the GEMMs read them, gate and up in one tensor for one GEMM."""
    w = inputs.make_weights(seed, rank, p, device)
    w1 = torch.cat([w.gate, w.up], dim=1).transpose(1, 2).contiguous()
    w2 = w.down.transpose(1, 2).contiguous()
    del w
    return w1.requires_grad_(), w2.requires_grad_()


def make_tokens(seed: int, rank: int, p: inputs.Preset, tokens: int, world: int,
                device: torch.device,
                routing: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = inputs.make_x(seed, rank, tokens, p.hidden, device).requires_grad_()
    idx, w = inputs.make_routing(seed, rank, tokens, p.experts_per_rank * world, p.top_k,
                                 device, routing)
    return x, idx, w.requires_grad_()


def grad_output(seed: int, rank: int, tokens: int, hidden: int,
                device: torch.device) -> torch.Tensor:
    """dL/dy for the backward: the counter-based one of bench_inputs.h, so that EPFlow's backward
    gets the same dy and every rank (and the check's reference) can regenerate any rank's."""
    return inputs.make_dy(seed, rank, tokens, hidden, device)


# --- the FP8 layer (--dtype fp8): the inference forward with torch._scaled_grouped_mm -----------

def fp8_unsupported(device: torch.device) -> str | None:
    """Why this torch or GPU cannot run the FP8 layer (None: it can)."""
    missing = [name for name in ("float8_e4m3fn", "_scaled_grouped_mm")
               if not hasattr(torch, name)]
    if missing:
        return (f"this torch ({torch.__version__}) has no "
                + ", ".join(f"torch.{name}" for name in missing))
    if device.type != "cuda":
        return "torch._scaled_grouped_mm has no CPU kernel: the FP8 layer needs CUDA"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return (f"torch._scaled_grouped_mm runs on sm_90 / sm_100 only, this GPU is "
                f"sm_{major}{minor}")
    return None


def quantize_rows(v: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Row-wise e4m3: scale [rows, 1] (fp32) = the row's amax / 448 and q [rows, K]
    (float8_e4m3fn) = v / scale, so that v ~ q * scale; both written in place (strided views
    are fine). The amax is exact in v's dtype; the division is computed in fp32 and cast to e4m3
    as it is stored (no fp32 copy of v)."""
    amax = torch.linalg.vector_norm(v, float("inf"), dim=1, keepdim=True)
    torch.div(amax.float().clamp_(min=FP8_AMAX_MIN), FP8_MAX, out=scale)
    torch.div(v, scale, out=q)


def make_weights_fp8(seed: int, rank: int, p: inputs.Preset, device: torch.device) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w1, w1_scale, w2, w2_scale), quantized once (untimed) from inputs.py's bf16 weights:
    e4m3 with one fp32 scale per output column of each expert, as _scaled_grouped_mm's row-wise
    mode wants them on sm_90. w1 [E_local, H, 2I] (gate columns then up columns) and w2
    [E_local, I, H] are column-major views of [E_local, 2I, H] and [E_local, H, I] contiguous
    (K innermost: the op's mat_b); w1_scale [E_local, 2I], w2_scale [E_local, H]."""
    w = inputs.make_weights(seed, rank, p, device)
    out = []
    for bf16 in (torch.cat([w.gate, w.up], dim=1), w.down):  # [E_local, N, K]
        experts, n, k = bf16.shape
        q = torch.empty(experts, n, k, dtype=torch.float8_e4m3fn, device=device)
        scale = torch.empty(experts * n, 1, dtype=torch.float32, device=device)
        quantize_rows(bf16.view(-1, k), q.view(-1, k), scale)
        out += [q.transpose(1, 2), scale.view(experts, n)]
    return out[0], out[1], out[2], out[3]


@torch.inference_mode()
def moe_layer_fp8(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                  w1: torch.Tensor, w1_scale: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor, world: int) -> torch.Tensor:
    """moe_layer's y with e4m3 expert GEMMs, an inference forward (no autograd). x, topk_idx,
    topk_weights as moe_layer's; the weights as make_weights_fp8 returns them."""
    tokens, hidden = x.shape
    top_k = topk_idx.shape[1]
    inter = w2.shape[1]
    plan = _plan(topk_idx, w1.shape[0], world)
    # Every token row quantized once (not once per slot) into its wire row: [e4m3 row (H bytes) |
    # fp32 scale | 12 bytes], so that one all_to_all_single carries the FP8 rows and their
    # scales, and the received buffer's row stride (H + 16 bytes) stays a multiple of 16 bytes
    # as the GEMM's row-major operand requires (H is a multiple of 16 in every preset).
    wire = torch.empty(tokens, hidden + FP8_WIRE_PAD, dtype=torch.uint8, device=x.device)
    quantize_rows(x, wire[:, :hidden].view(torch.float8_e4m3fn),
                  wire[:, hidden:hidden + 4].view(torch.float32))
    send = wire.index_select(0, plan.sent_slot // top_k)
    recv = wire.new_empty(plan.n_recv, wire.shape[1])
    dist.all_to_all_single(recv, send, plan.recv_sizes, plan.send_sizes)
    offs, perm, inv_perm = _expert_order(plan, world)
    if world > 1:
        recv = recv.index_select(0, perm)
    # The ragged expert segments are not padded: _scaled_grouped_mm (GroupMMCommon.cuh since
    # torch 2.9) checks 16-byte alignment only along a dynamic K or a column-major A, never along
    # the M offsets of a row-major A, so any row counts work, as they do for the BF16 layer's
    # _grouped_mm on the same torch (torch <= 2.8 asserted 16-byte-aligned segments for both).
    rows_q = recv[:, :hidden].view(torch.float8_e4m3fn)
    # [n_recv] contiguous, as the op requires (a reshape would keep the wire's row stride)
    rows_scale = recv[:, hidden:hidden + 4].view(torch.float32).squeeze(1).contiguous()
    h = torch._scaled_grouped_mm(rows_q, w1, rows_scale, w1_scale, offs=offs,
                                 out_dtype=torch.bfloat16)
    act = F.silu(h[:, :inter]).mul_(h[:, inter:])  # SwiGLU in bf16
    act_q = torch.empty(act.shape, dtype=torch.float8_e4m3fn, device=x.device)
    act_scale = torch.empty(act.shape[0], 1, dtype=torch.float32, device=x.device)
    quantize_rows(act, act_q, act_scale)
    out = torch._scaled_grouped_mm(act_q, w2, act_scale.view(-1), w2_scale, offs=offs,
                                   out_dtype=torch.bfloat16)
    if world > 1:
        out = out.index_select(0, inv_perm)
    back = out.new_empty(plan.n_send, hidden)
    dist.all_to_all_single(back, out, plan.send_sizes, plan.recv_sizes)
    # As moe_layer: slot s's result is row slot_pos[s] of `back` (empty slots: a zero row), and
    # the weighted sum over k is a batched matmul in bf16 (fp32 accumulate).
    rows = _rows(back, plan.slot_pos, plan.empty).view(tokens, top_k, hidden)
    return torch.bmm(topk_weights.to(x.dtype).unsqueeze(1), rows).squeeze(1)


# --- --check: against a per-token fp32 reference on all ranks' inputs ---------------------------

def drop_slots(topk_idx: torch.Tensor) -> torch.Tensor:
    """The check's routing: the benchmark's with the last slot of every 5th token empty (-1), so
    that the empty-slot path runs too."""
    idx = topk_idx.clone()
    idx[::5, -1] = -1
    return idx


def reference(seed: int, p: inputs.Preset, tokens: int, world: int, routing: str) -> tuple[
        list[torch.Tensor], list[list[torch.Tensor]]]:
    """Every rank's y and gradients [dx, d topk_weights, d w1, d w2], in fp32 on the CPU, token
    by token, for loss = sum over ranks of <y_r, dy_r>."""
    cpu = torch.device("cpu")
    leaves, idx_all, ys = [], [], []
    for r in range(world):
        w1, w2 = make_weights(seed, r, p, cpu)
        x, idx, tw = make_tokens(seed, r, p, tokens, world, cpu, routing)
        leaves.append([t.detach().float().requires_grad_() for t in (x, tw, w1, w2)])
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
                w1, w2 = leaves[e // el][2][e % el], leaves[e // el][3][e % el]
                h = x[t] @ w1
                acc = acc + tw[t, k] * ((F.silu(h[:inter]) * h[inter:]) @ w2)
            y.append(acc)
        ys.append(torch.stack(y))
    loss = sum((ys[r] * grad_output(seed, r, tokens, p.hidden, cpu).float()).sum()
               for r in range(world))
    loss.backward()
    return [y.detach() for y in ys], [[t.grad for t in rank_leaves] for rank_leaves in leaves]


def run_check(seed: int, rank: int, world: int, device: torch.device, routing: str) -> bool:
    p = inputs.PRESETS[CHECK_PRESET]
    w1, w2 = make_weights(seed, rank, p, device)
    x, idx, tw = make_tokens(seed, rank, p, CHECK_TOKENS, world, device, routing)
    y = moe_layer(x, drop_slots(idx), tw, w1, w2, world)
    y.backward(grad_output(seed, rank, CHECK_TOKENS, p.hidden, device))
    ref_y, ref_grads = reference(seed, p, CHECK_TOKENS, world, routing)
    got = [y, x.grad, tw.grad, w1.grad, w2.grad]
    want = [ref_y[rank]] + ref_grads[rank]
    ok = True
    for name, g, w in zip(["y", "dx", "d topk_weights", "d w1", "d w2"], got, want,
                          strict=True):
        err = float((g.detach().float().cpu() - w).norm() / w.norm())
        ok &= err <= CHECK_TOL
        print(f"rank {rank}: {name:15} relative error {err:.2e} "
              f"{'OK' if err <= CHECK_TOL else 'MISMATCH'}", flush=True)
    return ok


def run_check_fp8(seed: int, rank: int, world: int, device: torch.device, routing: str) -> bool:
    """The FP8 layer's y against the same fp32 reference as run_check's, relative L2 error over
    the whole output <= CHECK_TOL_FP8."""
    p = inputs.PRESETS[CHECK_PRESET]
    weights = make_weights_fp8(seed, rank, p, device)
    x, idx, tw = make_tokens(seed, rank, p, CHECK_TOKENS, world, device, routing)
    y = moe_layer_fp8(x.detach(), drop_slots(idx), tw.detach(), *weights, world)
    ref_y, _ = reference(seed, p, CHECK_TOKENS, world, routing)
    want = ref_y[rank]
    err = float((y.float().cpu() - want).norm() / want.norm())
    ok = err <= CHECK_TOL_FP8
    print(f"rank {rank}: {'y (fp8)':15} relative error {err:.2e} (tolerance {CHECK_TOL_FP8}) "
          f"{'OK' if ok else 'MISMATCH'}", flush=True)
    return ok


# --- timing ----------------------------------------------------------------------------------

def median_ms(fn: Callable[[], None], warmup: int, iters: int, settle_ms: float) -> float:
    """Median over `iters` runs (after settle_ms of untimed runs and `warmup` more) of fn's GPU
    time, between CUDA events."""
    settle(fn, settle_ms)
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
    NOTES: timed directly, not as (forward + backward) - forward: at small sizes this layer's
    forward is bound by its host work (split sizes copied to the host for all_to_all_single) and
    its median moves between runs, which the difference of two medians would pass on to the
    backward (docs/benchmarks.md, history)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(warmup + iters)]
    for start, end in events:
        y = forward()
        start.record()
        backward(y)
        end.record()
    torch.cuda.synchronize()
    return statistics.median([s.elapsed_time(e) for s, e in events[warmup:]])


def median_step_ms(forward: Callable[[], torch.Tensor],
                   backward: Callable[[torch.Tensor], None], warmup: int, iters: int) -> float:
    """Median over `iters` training steps (after `warmup`): forward and backward timed as one."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(warmup + iters)]
    for start, end in events:
        start.record()
        backward(forward())
        end.record()
    torch.cuda.synchronize()
    return statistics.median([s.elapsed_time(e) for s, e in events[warmup:]])


def bench_config(p: inputs.Preset, tokens: int, w1: torch.Tensor, w2: torch.Tensor,
                 args: argparse.Namespace, rank: int, world: int,
                 device: torch.device) -> tuple[list[float], list[float], list[float], int]:
    """This rank's (forward ms per repeat, backward ms per repeat, training step ms per repeat,
    routed slots): each repeat the forward's median over its warm-up + timed calls, then the
    backward's likewise, then the training step's (forward and backward timed as one)."""
    x, idx, tw = make_tokens(args.seed, rank, p, tokens, world, device, args.routing)
    dy = grad_output(args.seed, rank, tokens, p.hidden, device)
    leaves = [x, tw, w1, w2]

    def forward() -> torch.Tensor:
        return moe_layer(x, idx, tw, w1, w2, world)

    def forward_fresh() -> torch.Tensor:
        for t in leaves:  # fresh gradients, as after optimizer.zero_grad(set_to_none=True)
            t.grad = None
        return forward()

    fwd, bwd, step = [], [], []
    for _ in range(args.repeats):
        fwd.append(median_ms(forward, args.warmup, args.iters, args.settle_ms))
        bwd.append(median_backward_ms(forward_fresh, lambda y: y.backward(dy), args.warmup,
                                      args.iters))
        step.append(median_step_ms(forward_fresh, lambda y: y.backward(dy), args.warmup,
                                   args.iters))
        for t in leaves:
            t.grad = None
    return fwd, bwd, step, int((idx >= 0).sum())


def bench_config_fp8(p: inputs.Preset, tokens: int, weights: tuple[torch.Tensor, ...],
                     args: argparse.Namespace, rank: int, world: int,
                     device: torch.device) -> tuple[list[float], int]:
    """The FP8 layer's (forward ms per repeat, routed slots): each repeat the inference
    forward's median over its warm-up + timed calls."""
    x, idx, tw = make_tokens(args.seed, rank, p, tokens, world, device, args.routing)
    x, tw = x.detach(), tw.detach()

    def forward() -> None:
        moe_layer_fp8(x, idx, tw, *weights, world)

    fwd = [median_ms(forward, args.warmup, args.iters, args.settle_ms)
           for _ in range(args.repeats)]
    return fwd, int((idx >= 0).sum())


def run_bench(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> None:
    runs = []
    reps = args.repeats
    fp8 = args.dtype == "fp8"
    system = SYSTEM_FP8 if fp8 else SYSTEM
    # The FP8 layer is an inference forward: no backward, no training step.
    directions = ((0, "fwd", 1),) if fp8 else ((0, "fwd", 1), (1, "bwd", 2))
    for name in args.presets:
        p = inputs.PRESETS[name]
        weights = (make_weights_fp8 if fp8 else make_weights)(args.seed, rank, p, device)
        for tokens in args.tokens:
            if fp8:
                fwd, routed = bench_config_fp8(p, tokens, weights, args, rank, world, device)
                bwd = step = [0.0] * reps  # not timed: keeps the gathered columns' layout
            else:
                fwd, bwd, step, routed = bench_config(p, tokens, *weights, args, rank, world,
                                                      device)
            # Every rank's numbers, so the slowest rank's time goes with its own FLOPs: [median
            # over repeats fwd, bwd, routed slots, fwd per repeat..., bwd per repeat..., median
            # step, step per repeat...].
            mine = torch.zeros(world, 4 + 3 * reps, dtype=torch.float64, device=device)
            mine[rank] = torch.tensor([statistics.median(fwd), statistics.median(bwd), routed,
                                       *fwd, *bwd, statistics.median(step), *step],
                                      dtype=torch.float64)
            dist.all_reduce(mine)
            per_rank = mine.tolist()
            flops = 6.0 * p.hidden * p.intermediate  # per routed slot, forward
            for col, direction, mult in directions:
                slow = max(per_rank, key=lambda v: v[col])
                us = slow[col] * 1e3
                tflops = mult * flops * slow[2] / us * 1e-6
                run = {"system": system, "direction": direction, "preset": name,
                       "tokens": tokens, "routing": args.routing, "dtype": args.dtype,
                       "layer_us": us, "layer_tflops_per_gpu": tflops}
                # As epflow-bench: each repeat's slowest rank, when there is more than one.
                first = 3 + col * reps
                repeat_us = [max(v[first + i] for v in per_rank) * 1e3 for i in range(reps)]
                if reps > 1:
                    run["repeat_layer_us"] = [round(u, 2) for u in repeat_us]
                if direction == "bwd":  # the training step, forward + backward timed as one
                    step_col = 3 + 2 * reps
                    run["train_step_us"] = max(v[step_col] for v in per_rank) * 1e3
                    if reps > 1:
                        run["repeat_train_step_us"] = [
                            round(max(v[step_col + 1 + i] for v in per_rank) * 1e3, 2)
                            for i in range(reps)]
                runs.append(run)
                if rank == 0:
                    each = (" (repeats: " + " / ".join(f"{u:.1f}" for u in repeat_us) + ")"
                            if reps > 1 else "")
                    print(f"{system} {name} tokens/rank {tokens} EP {world} {args.routing} "
                          f"routing {direction}: "
                          f"{us:.1f} us, {tflops:.1f} TFLOP/s/GPU{each}", flush=True)
                    if direction == "bwd":
                        print(f"{system} {name} tokens/rank {tokens} EP {world} {args.routing} "
                              f"routing training step: {run['train_step_us']:.1f} us", flush=True)
        del weights
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
    ap.add_argument("--settle-ms", type=float, default=2000.0,
                    help="untimed calls for this many ms of GPU time before each forward "
                    "measurement's warm-up (as epflow-bench)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="as epflow-bench's --repeats: time each point's sequence (forward, then "
                         "backward, each warm-up + --iters calls) N times and report per rank the "
                         "median over the repeats of each repeat's median (default 1)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--routing", default=inputs.ROUTINGS[0], choices=inputs.ROUTINGS,
                    help="how tokens pick their experts, as epflow-bench's --routing: uniform "
                         "(default) or zipf (expert popularity proportional to 1 / (1 + its place "
                         "in a seeded ranking)); for --check too")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"],
                    help="bf16 (default): the training layer, forward, backward and training "
                         "step timed; fp8: e4m3 expert GEMMs (torch._scaled_grouped_mm, row-wise "
                         "scales), the inference forward only (system " + SYSTEM_FP8 + ")")
    ap.add_argument("--backward", action="store_true",
                    help="time the backward: the bf16 layer always does (this flag changes "
                         "nothing there); with --dtype fp8 an error, that layer is forward-only")
    ap.add_argument("--json", help="write the results here (rank 0)")
    ap.add_argument("--check", action="store_true",
                    help=f"compare with an fp32 per-token reference on the {CHECK_PRESET} preset, "
                         f"{CHECK_TOKENS} tokens/rank, instead of timing; exit 1 on mismatch "
                         f"(--dtype fp8: y alone, relative error <= {CHECK_TOL_FP8}; skipped, "
                         f"exit 0, without CUDA)")
    args = ap.parse_args()
    args.presets = [s for s in args.presets.split(",") if s]
    args.tokens = [int(s) for s in args.tokens.split(",") if s]
    unknown = [s for s in args.presets if s not in inputs.PRESETS]
    if unknown:
        ap.error(f"unknown presets {unknown}")
    if args.iters < 1 or args.warmup < 0 or args.repeats < 1:
        ap.error("--iters and --repeats must be >= 1 and --warmup >= 0")
    if args.dtype == "fp8" and args.backward:
        ap.error("the FP8 baseline (--dtype fp8) is forward-only: an inference forward with no "
                 "autograd, so no backward or training step to time; drop --backward")
    return args


def main() -> int:
    args = parse_args()
    if "RANK" not in os.environ:
        sys.exit("torch_moe.py: run it under torchrun (one process per GPU)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    fp8 = args.dtype == "fp8"
    if fp8 and args.check and not torch.cuda.is_available():
        if rank == 0:
            print("torch_moe.py --check --dtype fp8: skipped, the FP8 layer needs CUDA "
                  "(torch._scaled_grouped_mm has no CPU kernel)", flush=True)
        return 0
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    elif args.check:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        sys.exit("torch_moe.py: timing needs CUDA GPUs; without them only --check runs (gloo)")
    if fp8 and (why := fp8_unsupported(device)):
        dist.destroy_process_group()
        sys.exit(f"torch_moe.py --dtype fp8: {why}")
    try:
        if args.check:
            ok = (run_check_fp8 if fp8 else run_check)(args.seed, rank, world, device,
                                                        args.routing)
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
