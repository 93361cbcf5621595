"""torchtitan's routed experts with EPFlow running token dispatch, experts and combine.

Activate it through torchtitan's override mechanism, on the command line or in a config:

    --override.imports 'epflow.integrations.torchtitan.epflow_routed_experts={"max_tokens_per_rank": 8192}'

`epflow_routed_experts` replaces every `RoutedExperts` (torchtitan.models.common.moe) with
`EPFlowRoutedExperts`: the same module tree and parameters (`inner_experts.w1_EFD` = gate,
`w3_EFD` = up [E, F, D], `w2_EDF` = down [E, D, F], nn.Linear's layout per expert, which is
EPFlow's), so checkpoints are unchanged; torchtitan's router, load balancing and shared experts
stay. Its forward (x, top-k scores, top-k expert ids) is one EPFlow call over the expert-parallel
group (torchtitan's EP mesh after `parallelize`, else this rank alone); the scores weigh the
expert outputs, as torchtitan's combine does. The weights are read in place (no copies) and
their gradients come back through autograd.

Supported: bf16 activations and weights, EP over torchtitan's "ep" mesh. Refused with a clear
error: experts sharded on their hidden dimensions (expert tensor parallelism). torchtitan 0.3
needs Python >= 3.11 and imports with its dependencies (tyro, spmd_types, ...).
"""
from dataclasses import dataclass, field

import torch

try:
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.config.override import derive, override
    from torchtitan.models.common.moe import RoutedExperts
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("epflow.integrations.torchtitan needs torchtitan (pip install torchtitan) "
                      "and its dependencies") from e

import epflow

__all__ = ["EPFlowRoutedExperts", "epflow_routed_experts"]

_SELF_GROUP = []  # a one-rank process group per process, made once (collective)


def _self_group():
    """A process group of this rank alone when torch.distributed runs several ranks, else None
    (EPFlow then runs without one)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if not _SELF_GROUP:
        group, _ = dist.new_subgroups(group_size=1)
        _SELF_GROUP.append(group)
    return _SELF_GROUP[0]


class EPFlowRoutedExperts(RoutedExperts):
    """torchtitan's RoutedExperts whose dispatch, experts and combine run as one EPFlow call
    (see the module's docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        max_tokens_per_rank: int  # tokens of one call on a rank (batch x sequence), at most
        epflow_options: dict = field(default_factory=dict)  # more epflow.create_handle kwargs

    def __init__(self, config: Config):
        super().__init__(config)
        self.max_tokens_per_rank = int(config.max_tokens_per_rank)
        self._epflow_options = dict(config.epflow_options)
        self._ep_group = None
        self._handle_key = None

    def parallelize(self, parallel_dims) -> None:
        super().parallelize(parallel_dims)
        ep_mesh = parallel_dims.get_optional_mesh("ep")
        self._ep_group = ep_mesh.get_group() if ep_mesh is not None else None

    def _weights(self):
        """(gate, up, down) of this rank's experts as local tensors (autograd flows through)."""
        out = []
        for p in (self.inner_experts.w1_EFD, self.inner_experts.w3_EFD,
                  self.inner_experts.w2_EDF):
            if isinstance(p, DTensor):
                if any(isinstance(pl, Shard) and pl.dim != 0 for pl in p.placements):
                    raise NotImplementedError(
                        "epflow: EPFlowRoutedExperts does not support experts sharded on their "
                        f"hidden dimensions (expert tensor parallelism): placements "
                        f"{p.placements}")
                p = p.to_local()
            out.append(p)
        return out

    def _handle(self, gate, group):
        if self._handle_key is None:
            dim, hidden = gate.shape[2], gate.shape[1]
            self._handle_key, _ = epflow.create_handle(
                dim, hidden, self.token_dispatcher.num_experts, self.token_dispatcher.top_k,
                self.max_tokens_per_rank, group=group, device=gate.device, with_backward=True,
                **self._epflow_options)
        handle = epflow._HANDLES.get(self._handle_key)
        if handle is None:
            raise RuntimeError("epflow: this layer's handle was released "
                               "(epflow.release_handles())")
        return handle

    def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK,
                num_local_tokens_per_expert_E):
        del num_local_tokens_per_expert_E  # EPFlow counts on the GPU
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.size(-1)
        x = x_BLD.reshape(-1, D)
        if x.dtype != torch.bfloat16:
            raise TypeError(f"epflow: EPFlowRoutedExperts' activations must be bf16, got {x.dtype}")
        if x.shape[0] > self.max_tokens_per_rank:
            raise ValueError(f"epflow: {x.shape[0]} tokens exceed max_tokens_per_rank="
                             f"{self.max_tokens_per_rank}")
        weights = self._weights()
        group = self._ep_group if self._ep_group is not None else _self_group()
        handle = self._handle(weights[0], group)
        idx = topk_expert_ids_BLK.reshape(-1, K).to(torch.int32).contiguous()
        scores = topk_scores_BLK.reshape(-1, K).to(torch.float32).contiguous()
        x = x.contiguous()
        if torch.is_grad_enabled() and any(t.requires_grad for t in [x, scores] + weights):
            y = epflow._train_forward(handle, False, x, idx, scores, *weights)
        else:
            y = torch.ops.epflow.moe_forward(int(handle.id()), x, idx, scores, *weights)
        return y.view(B, -1, D)


@override(target=RoutedExperts.Config,
          description="EPFlow: routed experts, dispatch and combine as one EPFlow call")
def epflow_routed_experts(cfg: RoutedExperts.Config, *, max_tokens_per_rank: int,
                          **epflow_options) -> EPFlowRoutedExperts.Config:
    """torchtitan override factory: every RoutedExperts becomes EPFlowRoutedExperts
    (max_tokens_per_rank: tokens of one call on a rank; other kwargs: epflow.create_handle's)."""
    return derive(cfg, EPFlowRoutedExperts.Config, max_tokens_per_rank=max_tokens_per_rank,
                  epflow_options=epflow_options)
