"""A pure-PyTorch MoE layer with EPFlow's math (docs/ARCHITECTURE.md, "Math"), for tests.

y[t] = sum_k w[t,k] * W_down_e (silu(W_gate_e x[t]) * (W_up_e x[t])), e = topk_idx[t,k];
topk_idx = -1 is an empty slot. Computed in fp32 from the given (bf16) tensors.
"""
import torch
import torch.nn.functional as F


def reference_moe(x, topk_idx, topk_weights, w_gate, w_up, w_down):
    """x [T,H]; topk_idx/topk_weights [T,K]; w_gate/w_up [E,I,H], w_down [E,H,I] for ALL E
    experts of the EP group (global ids). Returns fp32 [T,H]."""
    xf = x.float()
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    idx = topk_idx.long()
    for e in torch.unique(idx[idx >= 0]).tolist():
        t, k = torch.nonzero(idx == e, as_tuple=True)
        xe = xf[t]
        h = F.silu(xe @ w_gate[e].float().t()) * (xe @ w_up[e].float().t())
        ye = h @ w_down[e].float().t()
        y.index_add_(0, t, topk_weights[t, k].float().unsqueeze(1) * ye)
    return y


def rel_err(y, ref):
    """||y - ref|| / ||ref|| in fp32 (0 when both are zero)."""
    y, ref = y.float(), ref.float()
    den = ref.norm().item()
    num = (y - ref).norm().item()
    return num / den if den > 0 else num
