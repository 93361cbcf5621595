#!/usr/bin/env python3
"""Megatron-Core's MoE layer, its own local path against the EPFlow-backed one
(epflow.integrations.megatron.EPFlowMoELayer): a training step (forward, then backward of
sum(y * dy)) timed with CUDA events, one process per GPU under torchrun (EP = its world size).

Both layers are Megatron's MoELayer built from the local spec (get_gpt_layer_local_spec: the
alltoall token dispatcher and SequentialMLP experts, a Python loop of per-expert GEMMs) with the
same weights (Megatron's state dict loaded into EPFlow's), the same router and the same inputs, so
they route identically. Information, not a claim about production Megatron: Megatron's fast path
(TransformerEngine's grouped GEMMs, its fused permutation and DeepEP) needs TransformerEngine,
whose wheel (~280 MB, built against a given torch) cannot be brought to the GPU machine.

Usage: torchrun --standalone --nproc_per_node 1 bench/megatron_layer.py \\
           [--preset deepseek-v3] [--tokens 2048,8192] [--warmup 10] [--settle-ms 2000] [--iters 20]
           [--repeats 3] [--json out.json]"""
from __future__ import annotations

from torch_bench_env import (git_commit, init_torchrun, median_step_ms,  # first: before torch
                             step_arguments)

import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import inputs  # noqa: E402


def parse_args():
    return step_arguments(__doc__, warmup=10).parse_args()


def main() -> int:
    args = parse_args()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    import epflow
    from epflow.integrations.megatron import use_epflow

    rank, world, device = init_torchrun()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    p = inputs.PRESETS[args.preset]
    tokens = [int(t) for t in args.tokens.split(",")]
    experts = p.experts_per_rank * world
    config = TransformerConfig(
        num_layers=1, hidden_size=p.hidden, num_attention_heads=8, num_moe_experts=experts,
        moe_router_topk=p.top_k, moe_ffn_hidden_size=p.intermediate,
        ffn_hidden_size=p.intermediate, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bias_activation_fusion=False,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
        moe_router_dtype="fp32", expert_model_parallel_size=world, params_dtype=torch.bfloat16,
        bf16=True)
    spec = get_gpt_layer_local_spec(num_experts=experts)
    build = lambda s: s.submodules.mlp(config=config, pg_collection=None, is_mtp_layer=False)
    layers = {"megatron-local": build(spec)}
    layers["megatron-epflow"] = build(use_epflow(spec, max_tokens_per_rank=max(tokens)))
    layers["megatron-epflow"].load_state_dict(layers["megatron-local"].state_dict())
    for layer in layers.values():
        layer.train()
    runs = []
    for T in tokens:
        x = inputs.make_x(args.seed, rank, T, p.hidden, device).view(T, 1, p.hidden)
        dy = inputs.make_dy(args.seed, rank, T, p.hidden, device).view(T, 1, p.hidden)
        x.requires_grad_(True)
        per_repeat = {k: [] for k in layers}
        for _ in range(args.repeats):
            for name, layer in layers.items():
                def step(layer=layer):
                    y, _ = layer(x)
                    y.backward(dy)
                ms = torch.tensor(median_step_ms(step, list(layer.parameters()), args.warmup,
                                                 args.iters, args.settle_ms), device=device)
                dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the slowest rank
                per_repeat[name].append(ms.item() * 1e3)
        flops = 18.0 * T * p.top_k * p.hidden * p.intermediate  # forward 6, backward 12 per row
        for name, us in per_repeat.items():
            step_us = statistics.median(us)
            run = {"system": name, "preset": args.preset, "tokens": T, "ep": world,
                   "step_us": step_us, "repeat_step_us": us,
                   "tokens_per_s": T / (step_us * 1e-6),
                   "tflops": flops / (step_us * 1e-6) / 1e12}
            runs.append(run)
            if rank == 0:
                print(f"{name} {args.preset} tokens/rank {T} EP {world}: step {step_us:.1f} us, "
                      f"{run['tokens_per_s']:.0f} tokens/s, {run['tflops']:.0f} TFLOP/s (repeats: "
                      + " / ".join(f"{u:.1f}" for u in us) + ")", flush=True)
        if rank == 0:
            local_us = next(r["step_us"] for r in runs[-2:] if r["system"] == "megatron-local")
            ours_us = next(r["step_us"] for r in runs[-2:] if r["system"] == "megatron-epflow")
            print(f"  EPFlow-backed / local: {local_us / ours_us:.2f}x", flush=True)
    if rank == 0 and args.json:
        import megatron.core
        args.json.write_text(json.dumps(
            {"kind": "megatron-layer-step", "device": torch.cuda.get_device_name(device),
             "commit": git_commit(), "date": datetime.date.today().isoformat(),
             "megatron_core": megatron.core.__version__, "torch": torch.__version__,
             "warmup": args.warmup, "settle_ms": args.settle_ms, "iters": args.iters,
             "repeats": args.repeats, "seed": args.seed, "runs": runs}, indent=2) + "\n")
    epflow.release_handles()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
