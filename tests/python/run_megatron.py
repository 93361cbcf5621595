"""EPFlow as Megatron-Core's MoE layer against Megatron's own, one process per GPU:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --standalone --nproc_per_node N tests/python/run_megatron.py

EP = N. The same weights and inputs go through Megatron's MoELayer (local spec, alltoall
dispatcher, bf16), through EPFlowMoELayer (bf16, the state dict of Megatron's loaded into it) and
through an fp32 copy of Megatron's layer, the reference. Per rank, with Megatron's router and its
auxiliary loss: y, x.grad, the router weight's grad and every local expert's weight grads, each as
||a - ref|| / ||ref||; EPFlow's error must be at most max(2x Megatron's, 1e-2). Then forced
routings through the same router weights (slots left empty, an expert no token picks, most tokens
on one expert), three SGD steps of each layer from the same weights (the weights after them
compared the same way), a state dict saved from Megatron's layer loaded into a fresh
EPFlowMoELayer (no missing or unexpected keys, the same outputs bitwise), and the memory
allocated during an EPFlow training step: no allocation of an expert weight's size in the
forward, one gradient buffer per weight kind in the backward (no per-step weight copies).
Finally both layers under Megatron's DistributedDataParallel with the distributed optimizer's
buffers: the parameters and their fp32 main_grad live in DDP's buffers with the experts in
reverse order; EPFlow reads the weights there and adds its gradients into main_grad in place
(gradient-accumulation fusion), Megatron's layer through DDP's hooks; the experts' main_grad
compared as above. Last, a small GPTModel (a dense layer, then an MoE layer) built from Megatron's
decoder block spec and from the same spec through use_epflow, the same initial weights (the
checkpoint loaded strictly), trained three Adam steps on the same tokens: the losses agree within
1e-2 relative at every step. Prints one line per check and "MEGATRON OK rank r" when all hold.
"""
import copy
import dataclasses
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from epflow.integrations.megatron import EPFlowMoELayer, use_epflow

H, I, E, K = 256, 192, 8, 4  # no weight size equals an activation's (the allocation check)
S, B = 64, 2  # tokens per rank: S * B (rank 1 gets fewer: T differs per rank)
FLOOR = 1e-2


def config(world, dtype):
    return TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E,
        moe_router_topk=K, moe_ffn_hidden_size=I, ffn_hidden_size=I, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2, moe_router_dtype="fp32", expert_model_parallel_size=world,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, gradient_accumulation_fusion=False,
        # Token dropping on (with a capacity no routing here reaches): Megatron's own dispatcher
        # then takes tokens routed to fewer than top-k experts (the forced empty slots).
        moe_expert_capacity_factor=float(E))


def rel(a, ref):
    a, ref = a.float(), ref.float()
    den = ref.norm().item()
    return (a - ref).norm().item() / den if den > 0 else (a - ref).norm().item()


def as_fp32(state):
    """A state dict with its floating-point tensors in fp32 (other entries as they are)."""
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in state.items()}


def named_grads(layer):
    """The router weight's and the local experts' weight gradients, by name."""
    out = {"router.weight": layer.router.weight.grad}
    for e, expert in enumerate(layer.experts.local_experts):
        out[f"expert{e}.fc1"] = expert.linear_fc1.weight.grad
        out[f"expert{e}.fc2"] = expert.linear_fc2.weight.grad
    return out


def run(layer, x, dy, dtype):
    """One forward + backward; y, x.grad and the weight gradients."""
    layer.zero_grad(set_to_none=True)
    xi = x.detach().to(dtype).requires_grad_(True)
    y, _ = layer(xi)
    (y.float() * dy).sum().backward()
    return y.detach(), xi.grad.detach(), {k: v.detach().clone() for k, v in named_grads(layer).items()}


class Checks:
    def __init__(self, rank):
        self.rank, self.failed = rank, []

    def compare(self, what, got, mega, ref):
        e_got, e_mega = rel(got, ref), rel(mega, ref)
        bound = max(2 * e_mega, FLOOR)
        ok = e_got <= bound
        print(f"rank {self.rank} {what}: EPFlow {e_got:.2e}, Megatron {e_mega:.2e} "
              f"(bound {bound:.1e}) {'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            self.failed.append(what)

    def require(self, what, ok, detail=""):
        print(f"rank {self.rank} {what}: {'ok' if ok else 'FAILED'} {detail}", flush=True)
        if not ok:
            self.failed.append(what)


def forced_routing(kind, generator):
    """A routing(logits) replacement: the router's softmax over a fixed map (so the router
    weight still gets gradients)."""
    def routing(logits, padding_mask=None):
        logits = logits.reshape(-1, E)  # [S, B, E] from the gate, as Megatron's routing takes it
        T = logits.shape[0]
        scores = torch.rand(T, E, generator=generator, device=logits.device)
        if kind == "empty_slots":  # every third token gets only two experts
            keep = torch.full((T,), K, device=logits.device)
            keep[::3] = 2
        else:
            keep = torch.full((T,), K, device=logits.device)
        if kind == "idle_expert":
            scores[:, 3] = -1.0
        if kind == "skewed":
            scores[: (T * 4) // 5, 0] = 2.0
        order = scores.argsort(dim=1, descending=True)
        rank_of = torch.empty_like(order)
        rank_of.scatter_(1, order, torch.arange(E, device=logits.device).expand(T, E))
        routing_map = rank_of < keep.unsqueeze(1)
        probs = torch.softmax(logits.float().masked_fill(~routing_map, float("-inf")), dim=1)
        return probs * routing_map, routing_map
    return routing


def ddp_main_grads(checks, world, spec, initial, build, x, dy):
    """Megatron's layer and EPFlow's (grad_accumulation_fusion) under Megatron's DDP with the
    distributed optimizer's parameter and fp32 gradient buffers: the experts' main_grad after one
    backward, against the fp32 reference's gradients (scaled as DDP scales them)."""
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                               grad_reduce_in_fp32=True)
    fused_spec = use_epflow(spec, max_tokens_per_rank=S * B, grad_accumulation_fusion=True)
    layers = [build(spec, torch.bfloat16), build(fused_spec, torch.bfloat16)]
    ref = build(spec, torch.float32)
    ref.load_state_dict(as_fp32(initial))
    ref.train()
    want = run(ref, x, dy, torch.float32)[2]
    main_grads = []
    for layer in layers:
        layer.load_state_dict(initial)
        layer.train()
        ddp = DistributedDataParallel(config(world, torch.bfloat16), ddp_config, layer)
        ddp.zero_grad_buffer()
        xi = x.detach().clone().requires_grad_(True)
        y, _ = ddp(xi)
        (y.float() * dy).sum().backward()
        ddp.finish_grad_sync()
        main_grads.append({f"expert{e}.{kind}": getattr(expert, f"linear_{kind}").weight.main_grad
                           for e, expert in enumerate(layer.experts.local_experts)
                           for kind in ("fc1", "fc2")})
    _, _, reversed_ = layers[1]._expert_weights(layers[1]._expert_params())
    checks.require("EPFlow reads the experts' weights in DDP's buffer in place", True,
                   f"(experts in {'reverse' if reversed_ else 'forward'} order)")
    checks.require("EPFlow's gradients fused into main_grad",
                   layers[1]._main_grads(layers[1]._expert_params()) is not None)
    mega_grads, our_grads = main_grads
    for name in mega_grads:
        r = want[name].float()
        # DDP scales gradients (1 / data-parallel size): the reference scaled to Megatron's.
        scale = (mega_grads[name].float() * r).sum() / (r * r).sum().clamp_min(1e-30)
        checks.compare(f"DDP main_grad {name}", our_grads[name], mega_grads[name], r * scale)


def model_training(checks, world):
    """Megatron's GPTModel with its local MoE layer and with EPFlow's: three Adam steps from the
    same weights on the same tokens, losses compared per step."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.module import Float16Module
    cfg = dataclasses.replace(config(world, torch.bfloat16), num_layers=2, moe_layer_freq=[0, 1],
                              ffn_hidden_size=2 * I)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    vocab, seq, batch = 512, 64, 2
    models = []
    for s in (spec, use_epflow(spec, max_tokens_per_rank=seq * batch)):
        torch.manual_seed(4321)
        # On the GPU and wrapped in Float16Module (bf16 parameters and inputs), as Megatron's
        # get_model does (the embeddings are built on the CPU, in fp32).
        models.append(Float16Module(cfg, GPTModel(config=cfg, transformer_layer_spec=s,
                                                  vocab_size=vocab,
                                                  max_sequence_length=seq).cuda()))
    models[1].load_state_dict(models[0].state_dict(), strict=True)
    g = torch.Generator(device="cuda").manual_seed(11 + dist.get_rank())
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g, device="cuda")
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(seq, device="cuda").expand(batch, seq)
    mask = ~torch.tril(torch.ones(seq, seq, dtype=torch.bool, device="cuda")).view(1, 1, seq, seq)
    losses = []
    for model in models:
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        per_step = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss = model(inputs, position_ids, mask, labels=labels).float().mean()
            loss.backward()
            opt.step()
            per_step.append(loss.item())
        losses.append(per_step)
    worst = max(abs(a - b) / abs(a) for a, b in zip(*losses))
    checks.require("GPTModel, 3 Adam steps: losses agree", worst <= 1e-2,
                   f"(Megatron {losses[0]}, EPFlow {losses[1]}, worst relative {worst:.1e})")


def main():
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)  # the same router weights on every rank
    checks = Checks(rank)
    T = S * B - (40 if rank == 1 else 0)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    epflow_spec = use_epflow(spec, max_tokens_per_rank=S * B)
    build = lambda s, dtype: s.submodules.mlp(config=config(world, dtype), pg_collection=None,
                                              is_mtp_layer=False)
    mega = build(spec, torch.bfloat16)
    initial = copy.deepcopy(mega.state_dict())
    ours = build(epflow_spec, torch.bfloat16)
    assert isinstance(ours, EPFlowMoELayer)
    missing, unexpected = ours.load_state_dict(mega.state_dict(), strict=False)
    checks.require("Megatron's state dict loads", not missing and not unexpected,
                   f"missing {missing} unexpected {unexpected}")
    ref = build(spec, torch.float32)
    ref.load_state_dict(as_fp32(mega.state_dict()))
    for m in (mega, ours, ref):
        m.train()

    g = torch.Generator(device="cuda").manual_seed(77 + rank)
    x = torch.randn(T // B, B, H, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(T // B, B, H, device="cuda", generator=g)

    def compare_all(tag):
        got, want, base = (run(ours, x, dy, torch.bfloat16), run(ref, x, dy, torch.float32),
                           run(mega, x, dy, torch.bfloat16))
        checks.compare(f"{tag} y", got[0], base[0], want[0])
        checks.compare(f"{tag} x.grad", got[1], base[1], want[1])
        for name in want[2]:
            checks.compare(f"{tag} d {name}", got[2][name], base[2][name], want[2][name])

    compare_all("router's own routing")
    for kind in ("empty_slots", "idle_expert", "skewed"):
        saved = [m.router.routing for m in (mega, ours, ref)]
        for m in (mega, ours, ref):
            m.router.routing = forced_routing(
                kind, torch.Generator(device="cuda").manual_seed(5 + rank))
        compare_all(kind)
        for m, r in zip((mega, ours, ref), saved):
            m.router.routing = r

    # No per-step weight copies: what the EPFlow layer's forward and backward allocate.
    torch.cuda.synchronize()
    ours.zero_grad(set_to_none=True)
    xi = x.detach().clone().requires_grad_(True)
    torch.cuda.memory._record_memory_history(max_entries=100000)
    y, _ = ours(xi)
    (y.float() * dy).sum().backward()
    torch.cuda.synchronize()
    events = torch.cuda.memory._snapshot()["device_traces"][local]
    torch.cuda.memory._record_memory_history(enabled=None)
    sizes = [ev["size"] for ev in events if ev["action"] == "alloc"]
    E_local = E // world
    fc1_bytes, fc2_bytes = 2 * I * H * 2, H * I * 2
    per_expert = [s for s in sizes if s in (fc1_bytes, fc2_bytes)]
    whole = [s for s in sizes if s in (E_local * fc1_bytes, E_local * fc2_bytes)]
    checks.require("no per-step weight copies",
                   not per_expert and sorted(whole) == sorted([E_local * fc1_bytes,
                                                               E_local * fc2_bytes]),
                   f"({len(sizes)} allocations in a step; of weight sizes: per expert "
                   f"{per_expert}, whole kinds {whole} = the two gradient buffers)")

    # Three SGD steps from the same weights. NOTES: a step small against the weights (a large
    # one moves the router enough to flip near-tied routing choices between bf16 and fp32, and
    # the comparison then measures those flips, not the layer).
    before = {k: v.detach().float().clone() for k, v in ref.named_parameters()}
    steppers = []
    for m in (mega, ours, ref):
        steppers.append(torch.optim.SGD(m.parameters(), lr=1e-3))
    for step in range(3):
        for m, opt, dtype in zip((mega, ours, ref), steppers,
                                 (torch.bfloat16, torch.bfloat16, torch.float32)):
            run(m, x, dy, dtype)
            opt.step()
    wo, wm, wr = (dict(m.named_parameters()) for m in (ours, mega, ref))
    for name in wr:
        checks.compare(f"after 3 SGD steps {name}", wo[name], wm[name], wr[name])
        b = before[name]
        print(f"rank {rank} (information) the 3 steps' update of {name}: EPFlow "
              f"{rel(wo[name].float() - b, wr[name].float() - b):.2e}, Megatron "
              f"{rel(wm[name].float() - b, wr[name].float() - b):.2e}", flush=True)

    # A Megatron checkpoint loads into a fresh EPFlow layer and gives the same outputs.
    fresh = build(epflow_spec, torch.bfloat16)
    missing, unexpected = fresh.load_state_dict(copy.deepcopy(ours.state_dict()), strict=False)
    checks.require("state dict into a fresh EPFlowMoELayer", not missing and not unexpected,
                   f"missing {missing} unexpected {unexpected}")
    fresh.train()
    a, b = run(ours, x, dy, torch.bfloat16), run(fresh, x, dy, torch.bfloat16)
    checks.require("the same outputs after loading", torch.equal(a[0], b[0]) and
                   torch.equal(a[1], b[1]) and all(torch.equal(a[2][k], b[2][k]) for k in a[2]))

    ddp_main_grads(checks, world, spec, initial, build, x, dy)
    model_training(checks, world)

    dist.barrier()
    import epflow
    epflow.release_handles()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if checks.failed:
        print(f"rank {rank} FAILED: {checks.failed}", flush=True)
        sys.exit(1)
    print(f"MEGATRON OK rank {rank}", flush=True)


if __name__ == "__main__":
    main()
