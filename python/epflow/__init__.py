"""EPFlow from PyTorch: the expert-parallel MoE layer as a torch op and an nn.Module.

    import torch, torch.distributed as dist, epflow
    dist.init_process_group("nccl")                     # torchrun: one process per GPU
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    layer = epflow.MoELayer(hidden=7168, intermediate=2048, num_experts=256, top_k=8,
                            max_tokens_per_rank=4096)   # this rank's 256/world experts
    y = layer(x, topk_idx, topk_weights)                # x [T,H] bf16 on this GPU
    y.float().square().mean().backward()                # EPFlow's GPU backward

With gradients enabled, MoELayer runs EPFlow's forward keeping what its GPU backward needs and
autograd calls that backward (gradients for x, topk_weights and the three expert weights; none
for topk_idx). Without (torch.no_grad(), inference_mode(), or no input needing a gradient) it
calls the op `torch.ops.epflow.moe_forward(handle_id, x, topk_idx, topk_weights, w_gate, w_up,
w_down)`, EPFlow's GPU forward on the current CUDA stream, which keeps nothing; the op has a fake
(meta) implementation for torch.compile and is CUDA-graph capturable, and has no autograd of its
own (NotImplementedError: train through MoELayer). `torch.ops.epflow.moe_forward.out(...,
out=y)` writes into a caller's y instead (contiguous, 16-byte aligned, overlapping no input;
eager and CUDA graphs, no fake implementation for torch.compile). There is no fallback to another
implementation.

MoELayer(..., dtype="fp8") runs in FP8 (e4m3 with DeepSeek-V3's 1x128 / 128x128 block scales):
it keeps its parameters in bf16 and quantizes them on the GPU (Handle.quantize_weights) at its
first call and whenever a parameter changed since (after each optimizer step); it trains through
EPFlow's FP8 backward (dgrad GEMMs in FP8; weight-gradient GEMMs in FP8 from 256 routed rows per
expert, in bf16 below; the gradients themselves bf16 or fp32) like the bf16 layer, and
without gradients calls `torch.ops.epflow.moe_forward_fp8(handle_id, x, topk_idx, topk_weights,
fp8_weights)`.
"""
import atexit
import glob
import math
import os

import torch
import torch.nn as nn

__all__ = ["MoELayer", "create_handle", "release_handles", "workspace_memory",
           "BACKWARD_NOT_IMPLEMENTED"]

BACKWARD_NOT_IMPLEMENTED = ("torch.ops.epflow.moe_forward is EPFlow's inference op and has no "
                            "autograd: train through epflow.MoELayer (backward=True, the default), "
                            "whose forward keeps what EPFlow's GPU backward needs")


def _load_library():
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_epflow_torch*.so")))
    if not found:
        raise ImportError(
            f"epflow: the compiled extension _epflow_torch.so is not in {here}. Build it with "
            "`pip install .` from the repository, or `cmake -S . -B build -DEPFLOW_BUILD_PYTHON=ON "
            "&& cmake --build build` (which copies it into python/epflow/) and PYTHONPATH=python.")
    torch.ops.load_library(found[0])


_load_library()
from . import _C  # noqa: E402  (the ops above must be loaded first)


# --- the op's fake implementation (torch.compile / FakeTensor / meta) and autograd --------------
@torch.library.register_fake("epflow::moe_forward_fp8")
def _moe_forward_fp8_fake(handle, x, topk_idx, topk_weights, fp8_weights):
    torch._check(x.dim() == 2, lambda: f"epflow.moe_forward_fp8: x must be [T, H], got {x.shape}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("epflow::moe_forward")
def _moe_forward_fake(handle, x, topk_idx, topk_weights, w_gate, w_up, w_down):
    torch._check(x.dim() == 2, lambda: f"epflow.moe_forward: x must be [T, H], got {x.shape}")
    torch._check(topk_idx.dim() == 2 and topk_idx.shape[0] == x.shape[0],
                 lambda: "epflow.moe_forward: topk_idx must be [T, K]")
    torch._check(topk_weights.shape == topk_idx.shape,
                 lambda: "epflow.moe_forward: topk_weights must have topk_idx's shape")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    pass


def _backward(ctx, grad_y):
    raise NotImplementedError(BACKWARD_NOT_IMPLEMENTED)


# NOTES: the inference op keeps no context, so its autograd (registered on the op itself) is a
# clear error; MoELayer trains through _MoEFunction instead. Under torch.compile with inputs that
# require grad, AOTAutograd traces the op's backward while compiling, so that error appears at
# compile time there.
torch.library.register_autograd("epflow::moe_forward", _backward, setup_context=_setup_context)


# --- workspaces and handles: one NCCL communicator + epflow::Workspace per (process group,
# device), one epflow::Layer per shape on it, shared by every layer of that shape (a training
# forward keeps its activations in its own context) ----------------------------------------------
_WORKSPACES = {}
_HANDLES = {}


def _group_info(group):
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("epflow: a process group was given but torch.distributed is not "
                               "initialized")
        return None, (0,), 1, 0
    if group is None:
        group = dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group))
    return group, ranks, dist.get_world_size(group), dist.get_rank(group)


def _workspace(group, ranks, world, rank, device):
    """The process group's workspace on `device` (its NCCL communicator and the memory every
    handle on it shares), created once: collective over the group."""
    key = (ranks, device.index)
    if key in _WORKSPACES:
        return _WORKSPACES[key]
    with torch.cuda.device(device):
        if group is None:
            uid = _C.get_unique_id()
        else:
            import torch.distributed as dist
            obj = [_C.get_unique_id() if rank == 0 else None]
            dist.broadcast_object_list(obj, src=dist.get_global_rank(group, 0), group=group)
            uid = obj[0]
        ws = torch.classes.epflow.Workspace(
            torch.frombuffer(bytearray(uid), dtype=torch.uint8), world, rank, device.index)
    _WORKSPACES[key] = ws
    return ws


def create_handle(hidden, intermediate, num_experts, top_k, max_tokens_per_rank, *, group=None,
                  device=None, timeout_seconds=5.0, comm_sms=0, minibatch_rows=0, ring_rows=0,
                  saved_gate_up_rows=0, with_backward=False, dtype="bf16",
                  fp8_power_of_two_scales=False):
    """Returns (key, handle) for this shape on this process group, creating it once: the layers
    of one shape share it. Every handle of a process group on a device lives on one workspace
    (one NCCL communicator, one symmetric window, one ring and one set of backward buffers,
    grown to the largest shape): a layer adds no device memory of its own. with_backward: the
    handle's layer can run EPFlow's GPU backward (LayerConfig::with_backward).

    Creation is collective over `group` (default: the world group; without torch.distributed,
    a single rank): every rank must call it, in the same order, with the same shape. The first
    handle of a group and device also creates its workspace: rank 0 of the group makes an
    ncclUniqueId and broadcasts it over the group (broadcast_object_list), every rank makes its
    NCCL communicator on `device`.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("epflow: EPFlow runs on CUDA GPUs only (sm_90a); no CUDA device here")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None \
        else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"epflow: device must be a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    group, ranks, world, rank = _group_info(group)
    shape = (int(hidden), int(intermediate), int(num_experts), int(top_k),
             int(max_tokens_per_rank), float(timeout_seconds), int(comm_sms),
             int(minibatch_rows), int(ring_rows), int(saved_gate_up_rows), bool(with_backward),
             str(dtype), bool(fp8_power_of_two_scales))
    key = (ranks, device.index) + shape
    if key in _HANDLES:
        return key, _HANDLES[key]
    torch.ops.epflow.check_config(world, *shape)  # a bad shape fails before any collective
    ws = _workspace(group, ranks, world, rank, device)
    with torch.cuda.device(device):
        handle = torch.classes.epflow.Handle(ws, *shape)
    _HANDLES[key] = handle
    return key, handle


def workspace_memory(group=None, device=None):
    """Bytes the process group's workspace on `device` holds, as a dict by purpose (symmetric
    window, ring, schedule, backward rows), or None before its first layer."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None \
        else torch.device(device)
    _, ranks, _, _ = _group_info(group)
    ws = _WORKSPACES.get((ranks, device.index))
    if ws is None:
        return None
    return dict(zip(("symmetric", "ring", "schedule", "backward"), ws.memory()))


def release_handles():
    """Destroys every cached handle and workspace (their layers and NCCL communicators). Call it
    on every rank after the last forward, before dist.destroy_process_group(); modules that used
    them stop working."""
    if (_HANDLES or _WORKSPACES) and torch.cuda.is_available():
        torch.cuda.synchronize()
    _HANDLES.clear()
    _WORKSPACES.clear()


atexit.register(release_handles)


@torch.compiler.disable
def _train_forward(handle, fuse_grads, fp8_weights, x, topk_idx, topk_weights, w_gate, w_up,
                   w_down):
    # NOTES: outside torch.compile's graph (a graph break): the handle is a TorchScript class
    # object that dynamo does not trace through an autograd.Function; the layer's own work is
    # one stream-ordered GPU call either way.
    return _MoEFunction.apply(handle, fuse_grads, fp8_weights, x, topk_idx, topk_weights, w_gate,
                              w_up, w_down)


def _grad_buffers(params):
    """Where grad_accumulation_fusion adds the parameters' gradients: Megatron-Core's main_grad
    where a parameter has one, else its .grad. Returns (buffers, accumulate): when none of them
    holds a gradient yet, fresh .grad tensors the kernels overwrite (no zero fill first)."""
    if all(getattr(p, "main_grad", None) is None and p.grad is None for p in params):
        for p in params:
            p.grad = torch.empty_like(p, memory_format=torch.contiguous_format)
        return [p.grad for p in params], False
    buffers = []
    for p in params:
        buffer = getattr(p, "main_grad", None)
        if buffer is None:
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            buffer = p.grad
        buffers.append(buffer)
    return buffers, True


class _MoEFunction(torch.autograd.Function):
    """EPFlow's forward keeping its context, and its GPU backward (bf16 weight gradients, like
    the parameters; fp32 d topk_weights). What the backward reads (the call's routing schedule
    and g | u) lives in a uint8 buffer saved like any activation: autograd frees it with the
    graph, and activation checkpointing drops and recomputes it with the rest. fp8_weights (an
    FP8 layer): the parameters quantized (Handle.quantize_weights), which forward and backward
    read; the parameters' gradients are those of the bf16 weights (straight-through)."""

    @staticmethod
    def forward(ctx, handle, fuse_grads, fp8_weights, x, topk_idx, topk_weights, w_gate, w_up,
                w_down):
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        buffer = torch.empty(handle.saved_context_bytes(), dtype=torch.uint8, device=x.device)
        if fp8_weights is None:
            context = handle.forward_train(x, topk_idx, topk_weights, w_gate, w_up, w_down, y,
                                           buffer, False)
        else:
            context = handle.forward_train_fp8(x, topk_idx, topk_weights, fp8_weights, y, buffer)
        ctx.fp8_weights = fp8_weights  # alive until the backward, which reads them
        ctx.handle, ctx.context = handle, context
        ctx.params = (w_gate, w_up, w_down) if fuse_grads else None
        ctx.save_for_backward(x, topk_idx, topk_weights, w_gate, w_up, w_down, buffer)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, topk_idx, topk_weights, w_gate, w_up, w_down, buffer = ctx.saved_tensors
        weights = (w_gate, w_up, w_down)
        if ctx.params is None:
            dx, dw, dg, du, dd = ctx.handle.backward(ctx.context, buffer, dy.contiguous(), x,
                                                     topk_idx, topk_weights, *weights)
            return None, None, None, dx, None, dw, dg, du, dd
        # Gradient accumulation fusion: the weight gradients added in place by the kernels.
        targets, accumulate = _grad_buffers(ctx.params)
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        dw = torch.empty_like(topk_weights, memory_format=torch.contiguous_format)
        ctx.handle.backward_out(ctx.context, buffer, dy.contiguous(), x, topk_idx, topk_weights,
                                *weights, dx, dw, *targets, accumulate, False, False)
        return None, None, None, dx, None, dw, None, None, None


class MoELayer(nn.Module):
    """EPFlow's expert-parallel MoE layer (SwiGLU experts), this rank's experts as parameters.

    Experts are split over the ranks of `group` (default: the world group; a single rank
    without torch.distributed): rank r owns global experts [r*E_local, (r+1)*E_local),
    E_local = num_experts / world. Parameters (bf16, nn.Linear's layout and init):
    w_gate, w_up [E_local, intermediate, hidden], w_down [E_local, hidden, intermediate].

    forward(x [..., H] bf16, topk_idx [..., K] global expert ids (-1: empty slot),
    topk_weights [..., K]) -> y [..., H] bf16. Every rank of the group must call forward the
    same number of times (each call is collective); T may differ per rank, up to
    max_tokens_per_rank.

    Every layer of a group lives on one workspace per device (one NCCL communicator, one set
    of EPFlow buffers sized to the largest layer: epflow.workspace_memory()), and layers of one
    shape share one handle, so an extra layer costs its parameters. Calls of all of them run one
    at a time: a call on another stream waits for the previous call (an event, no host sync).

    backward=True (default): the layer can train (its handle has the backward's buffers). With
    gradients enabled, each forward keeps a context of Handle.saved_context_bytes() bytes from
    PyTorch's allocator, freed with the autograd graph: any number of forwards may be in flight
    (micro-batches, pipeline schedules) and their backwards may run in any order; activation
    checkpointing composes. A context serves one backward (backward(retain_graph=True) twice is
    refused). It keeps the gate/up pre-activations of up to saved_gate_up_rows routed rows (0:
    what balanced routing brings, plus 25%; every row at EP = 1); the backward recomputes the
    rest on the GPU, so any routing works and one past the bound costs a GEMM. backward=False:
    inference only.

    dtype="fp8": the FP8 layer, forward and backward; the bf16 parameters are quantized on the
    GPU (e4m3, 128x128 block scales; activations 1x128) at the first call and after any change to
    them (their version counters), so a model can update them and run on; their gradients are
    the bf16 weights' (straight-through).
    fp8_power_of_two_scales: the activations' scales are powers of two.

    grad_accumulation_fusion=True: the backward adds the expert weights' gradients in place, into
    each parameter's `main_grad` (Megatron-Core's fp32 buffer) where it has one, else into its
    `.grad` (written by the first backward), and gives autograd none for them: no separate pass
    over every expert weight per micro-batch. Use it with loss.backward(): hooks on the expert weights do
    not see these gradients and torch.autograd.grad does not return them.
    """

    def __init__(self, hidden, intermediate, num_experts, top_k, max_tokens_per_rank, *,
                 group=None, device=None, timeout_seconds=5.0, comm_sms=0, minibatch_rows=0,
                 ring_rows=0, saved_gate_up_rows=0, backward=True, grad_accumulation_fusion=False,
                 dtype="bf16", fp8_power_of_two_scales=False):
        super().__init__()
        if dtype not in ("bf16", "fp8"):
            raise ValueError(f"epflow: dtype must be 'bf16' or 'fp8', got {dtype!r}")
        self._key, handle = create_handle(
            hidden, intermediate, num_experts, top_k, max_tokens_per_rank, group=group,
            device=device, timeout_seconds=timeout_seconds, comm_sms=comm_sms,
            minibatch_rows=minibatch_rows, ring_rows=ring_rows,
            saved_gate_up_rows=saved_gate_up_rows, with_backward=backward, dtype=dtype,
            fp8_power_of_two_scales=fp8_power_of_two_scales)
        self.dtype = dtype
        self._fp8 = None  # (parameter versions, the 6 quantized tensors)
        self._handle_id = int(handle.id())
        self._backward = bool(backward)
        self._fuse_grads = bool(grad_accumulation_fusion)
        dev = torch.device("cuda", int(handle.device()))
        _, _, world, rank = _group_info(group)
        self.hidden, self.intermediate = int(hidden), int(intermediate)
        self.num_experts, self.top_k = int(num_experts), int(top_k)
        self.ep_size, self.ep_rank = world, rank
        self.experts_per_rank = self.num_experts // world
        e = self.experts_per_rank
        kw = dict(device=dev, dtype=torch.bfloat16)
        self.w_gate = nn.Parameter(torch.empty(e, self.intermediate, self.hidden, **kw))
        self.w_up = nn.Parameter(torch.empty(e, self.intermediate, self.hidden, **kw))
        self.w_down = nn.Parameter(torch.empty(e, self.hidden, self.intermediate, **kw))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        # nn.Linear's default: kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        for w, fan_in in ((self.w_gate, self.hidden), (self.w_up, self.hidden),
                          (self.w_down, self.intermediate)):
            bound = 1.0 / math.sqrt(fan_in)
            w.uniform_(-bound, bound)

    def extra_repr(self):
        return (f"hidden={self.hidden}, intermediate={self.intermediate}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, dtype={self.dtype}, "
                f"ep_rank={self.ep_rank}/{self.ep_size}, experts_per_rank={self.experts_per_rank}")

    def forward(self, x, topk_idx, topk_weights):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.hidden).contiguous()
        idx = topk_idx.reshape(-1, self.top_k).to(torch.int32).contiguous()
        w = topk_weights.reshape(-1, self.top_k).to(torch.float32).contiguous()
        params = (self.w_gate, self.w_up, self.w_down)
        fp8 = self._fp8_weights() if self.dtype == "fp8" else None
        if self._backward and torch.is_grad_enabled() and any(
                t.requires_grad for t in (x2, w) + params):
            handle = _HANDLES.get(self._key)
            if handle is None:
                raise RuntimeError("epflow: this MoELayer's handle was released "
                                   "(epflow.release_handles())")
            y = _train_forward(handle, self._fuse_grads, fp8, x2, idx, w, *params)
        elif fp8 is not None:
            y = torch.ops.epflow.moe_forward_fp8(self._handle_id, x2, idx, w, fp8)
        else:
            y = torch.ops.epflow.moe_forward(self._handle_id, x2, idx, w, *params)
        return y.reshape(*lead, self.hidden)

    @torch.no_grad()
    def _fp8_weights(self):
        """The parameters quantized (Handle.quantize_weights), again after any change to them."""
        params = (self.w_gate, self.w_up, self.w_down)
        versions = tuple((p.data_ptr(), p._version) for p in params)
        if self._fp8 is None or self._fp8[0] != versions:
            handle = _HANDLES.get(self._key)
            if handle is None:
                raise RuntimeError("epflow: this MoELayer's handle was released "
                                   "(epflow.release_handles())")
            self._fp8 = (versions, handle.quantize_weights(*(p.detach() for p in params)))
        return self._fp8[1]
