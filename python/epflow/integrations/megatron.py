"""Megatron-Core's MoE layer with EPFlow running token dispatch, experts and combine.

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from epflow.integrations.megatron import use_epflow

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    spec = use_epflow(spec, max_tokens_per_rank=seq_length * micro_batch_size)
    model = GPTModel(config=config, transformer_layer_spec=spec, ...)

`EPFlowMoELayer` is Megatron's `MoELayer`: its router (with its auxiliary losses and expert bias),
its shared experts and its local experts (`SequentialMLP`, the local spec's) are Megatron's own
modules and own the parameters, so the state_dict keys are Megatron's and a Megatron checkpoint
loads unchanged. Between router and combine, one EPFlow call replaces the token dispatcher and the
experts: the router's (probs [T, E], routing_map [T, E]) become top-k expert ids and weights (the
weights a gather of probs, so EPFlow's d topk_weights reaches the router and its losses), and
EPFlow's forward and GPU backward run the routed experts over the expert-parallel group.

No per-step weight copies: at construction each expert's linear_fc1.weight [2I, H] (gate rows,
then up rows) becomes a view of one [E_local, 2I, H] tensor and each linear_fc2.weight [H, I] a
view of one [E_local, H, I]; EPFlow reads gate and up as strided views of it. Weights that a
framework later moves (Megatron's distributed optimizer keeps parameters in its own buffer, in
reverse order) are read in place wherever they now lie, as long as the experts' matrices of a
kind are equally spaced in one allocation, in either order (a clear error otherwise). The weight gradients are returned as views
of one allocation (autograd keeps them as the parameters' .grad without a copy); with
gradient-accumulation fusion (Megatron's `main_grad`) they are added into main_grad in place.

Supported: expert parallelism over Megatron's EP group (tensor and expert-tensor parallel size 1),
SwiGLU experts without biases (gated_linear_unit, silu, add_bias_linear=False), bf16 parameters
and activations, the alltoall and allgather dispatcher settings (their dispatcher is built but
unused), token dropping (dropped slots become empty slots), shared experts, activation
recomputation of the MoE layer. Anything else is refused at construction with the setting's
name. Megatron-Core (megatron-core on PyPI) needs Python >= 3.12.
"""
import dataclasses
import functools

import torch
import torch.nn.functional as F

try:
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("epflow.integrations.megatron needs Megatron-Core (pip install "
                      "megatron-core; Python >= 3.12)") from e

import epflow

__all__ = ["EPFlowMoELayer", "use_epflow", "routing_to_topk", "unsupported_settings"]


def unsupported_settings(config):
    """The settings of a TransformerConfig this layer refuses, as 'name=value (why)' strings."""
    bad = []

    def refuse(name, why, ok):
        if not ok:
            bad.append(f"{name}={getattr(config, name, None)!r} ({why})")

    refuse("tensor_model_parallel_size", "tensor parallelism is not supported",
           getattr(config, "tensor_model_parallel_size", 1) == 1)
    refuse("expert_tensor_parallel_size", "expert tensor parallelism is not supported",
           (getattr(config, "expert_tensor_parallel_size", 1) or 1) == 1)
    refuse("moe_token_dispatcher_type", "the flex dispatcher is not supported",
           config.moe_token_dispatcher_type in ("alltoall", "allgather"))
    refuse("gated_linear_unit", "EPFlow's experts are SwiGLU", config.gated_linear_unit)
    refuse("activation_func", "EPFlow's experts are SwiGLU (silu)",
           config.activation_func is F.silu)
    refuse("add_bias_linear", "expert biases are not supported", not config.add_bias_linear)
    refuse("glu_linear_offset", "SwiGLU without offset", not config.glu_linear_offset)
    refuse("activation_func_clamp_value", "SwiGLU without clamping",
           config.activation_func_clamp_value is None)
    refuse("moe_mlp_glu_interleave_size", "gate and up rows must be blocks, not interleaved",
           getattr(config, "moe_mlp_glu_interleave_size", None) is None)
    refuse("params_dtype", "bf16 parameters", config.params_dtype == torch.bfloat16)
    refuse("fp8", "Megatron's FP8 recipes are not supported (EPFlow's own FP8 layer, "
           "epflow.MoELayer(dtype='fp8'), is not wired into this integration)", not config.fp8)
    refuse("fp4", "not supported", not getattr(config, "fp4", None))
    refuse("moe_apply_probs_on_input", "not supported", not config.moe_apply_probs_on_input)
    refuse("moe_latent_size", "not supported", not getattr(config, "moe_latent_size", None))
    for name in ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute",
                 "overlap_dispatch_backward_with_experts_wgrad", "moe_shared_expert_overlap"):
        refuse(name, "EPFlow overlaps its own communication", not getattr(config, name, False))
    refuse("cuda_graph_impl", "Megatron's partial CUDA graphs of the MoE layer are not supported",
           getattr(config, "cuda_graph_impl", "none") in ("none", "full_iteration"))
    return bad


def routing_to_topk(probs, routing_map, top_k):
    """Megatron's routing (probs [T, E], zero off the map; routing_map [T, E] bool, at most top_k
    experts per token) as EPFlow's topk_idx [T, top_k] int32 (global expert ids, ascending, -1
    for slots no expert fills: dropped tokens) and topk_weights [T, top_k] float32, a gather of
    probs (its gradient flows back to probs). No host synchronisation; a row with more than
    top_k experts fails a device-side assertion instead of losing a token."""
    flags = routing_map.to(torch.int8)
    torch._assert_async(flags.sum(dim=1).max() <= top_k,
                        "epflow: a token was routed to more than top_k experts")
    ranked, order = torch.sort(flags, dim=1, descending=True, stable=True)
    ids = order[:, :top_k]
    routed = ranked[:, :top_k].bool()
    weights = probs.gather(1, ids).float() * routed
    return torch.where(routed, ids, -1).to(torch.int32).contiguous(), weights.contiguous()


def _experts_view(tensors, shape):
    """The E tensors of one shape ([R, C] each, row-major), when they are equally spaced in one
    allocation (any spacing that is a multiple of 16 bytes), as (view, reversed): view [E, R, C]
    in memory order, reversed when the experts lie from the last to the first (view[j] is expert
    E - 1 - j: Megatron-Core's DDP buffers hold parameters in reverse order). (None, False)
    otherwise."""
    first = tensors[0]
    if any(t.shape != shape or t.dtype != first.dtype or t.device != first.device or
           not t.is_contiguous() or
           t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
           for t in tensors):
        return None, False
    if len(tensors) == 1:
        return first.unsqueeze(0), False
    step = tensors[1].data_ptr() - first.data_ptr()
    if step == 0 or step % 16 != 0 or any(
            t.data_ptr() - first.data_ptr() != e * step for e, t in enumerate(tensors)):
        return None, False
    base = first if step > 0 else tensors[-1]
    view = base.as_strided((len(tensors),) + tuple(shape),
                           (abs(step) // first.element_size(), shape[1], 1), base.storage_offset())
    return view, step < 0


class _EPFlowExperts(torch.autograd.Function):
    """EPFlow's forward keeping its context and its GPU backward, over the experts' parameters
    themselves (E linear_fc1 weights, then E linear_fc2 weights: autograd's leaves), read in
    place as strided views."""

    @staticmethod
    def forward(ctx, layer, x, topk_idx, topk_weights, *params):
        fc1, fc2, reversed_ = layer._expert_weights(params)
        gate, up = fc1[:, :layer.intermediate], fc1[:, layer.intermediate:]
        handle = layer._handle()
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        buffer = torch.empty(handle.saved_context_bytes(), dtype=torch.uint8, device=x.device)
        ctx.context = handle.forward_train(x, topk_idx, topk_weights, gate, up, fc2, y, buffer,
                                           reversed_)
        ctx.layer, ctx.params, ctx.reversed = layer, params, reversed_
        ctx.save_for_backward(x, topk_idx, topk_weights, fc1, fc2, buffer)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, topk_idx, topk_weights, fc1, fc2, buffer = ctx.saved_tensors
        layer, params = ctx.layer, ctx.params
        I = layer.intermediate
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        dtw = torch.empty_like(topk_weights, memory_format=torch.contiguous_format)
        weights = (fc1[:, :I], fc1[:, I:], fc2)
        fresh = lambda t: torch.empty(t.shape, dtype=t.dtype, device=t.device)  # packed
        fused = layer._main_grads(params) if layer.grad_accumulation_fusion else None
        if fused is not None:
            # Megatron's gradient-accumulation fusion: added into main_grad in place; autograd
            # gets uninitialised placeholders, as from Megatron's own linear layers (its DDP hook
            # skips them), views of one allocation per kind.
            g1, g2, grads_reversed = fused
            for p in params:
                p.grad_added_to_main_grad = True
            out1, out2 = fresh(fc1), fresh(fc2)
        else:
            g1, g2, grads_reversed = fresh(fc1), fresh(fc2), False
            out1, out2 = g1, g2
        layer._handle().backward_out(ctx.context, buffer, dy.contiguous(), x, topk_idx,
                                     topk_weights, *weights, dx, dtw, g1[:, :I], g1[:, I:], g2,
                                     fused is not None, ctx.reversed, grads_reversed)
        grads = list(out1.unbind(0)) + list(out2.unbind(0))
        ctx.context = ctx.layer = ctx.params = None
        return (None, dx, None, dtw, *grads)


class EPFlowMoELayer(MoELayer):
    """Megatron-Core's MoELayer whose dispatch, experts and combine run as one EPFlow call (see
    the module's docstring). Extra arguments (bind them with use_epflow):

    max_tokens_per_rank: the most tokens one call gets on a rank (sequence length x micro-batch
        size, over the context-parallel size); a larger call is refused.
    grad_accumulation_fusion: add the expert weights' gradients into their `main_grad` in place
        (default: config.gradient_accumulation_fusion); when the main_grad tensors are not
        equally spaced in one buffer, the gradients go through autograd instead.
    epflow_options: further keyword arguments of epflow.create_handle (comm_sms, ring_rows,
        saved_gate_up_rows, timeout_seconds, ...).
    """

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                 is_mtp_layer=False, name=None, *, max_tokens_per_rank,
                 grad_accumulation_fusion=None, epflow_options=None):
        bad = unsupported_settings(config)
        if bad:
            raise ValueError("epflow: EPFlowMoELayer does not support " + "; ".join(bad))
        super().__init__(config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection, is_mtp_layer=is_mtp_layer, name=name)
        if not isinstance(self.experts, SequentialMLP):
            raise ValueError("epflow: EPFlowMoELayer needs Megatron's local experts "
                             f"(SequentialMLP, the local spec's), got {type(self.experts).__name__}")
        if self.attn_tp_group.size() > 1 or self.experts.tp_group.size() > 1:
            raise ValueError("epflow: EPFlowMoELayer does not support tensor parallelism")
        self.hidden = config.hidden_size
        self.intermediate = config.moe_ffn_hidden_size
        self.top_k = config.moe_router_topk
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.grad_accumulation_fusion = (config.gradient_accumulation_fusion
                                         if grad_accumulation_fusion is None
                                         else bool(grad_accumulation_fusion))
        self._epflow_options = dict(epflow_options or {})
        self._rehome_expert_weights()
        self._handle_key = None

    @torch.no_grad()
    def _rehome_expert_weights(self, kinds=("linear_fc1", "linear_fc2")):
        """Each expert's weights become views of one tensor per kind (values kept): EPFlow reads
        them in place with no per-step copy, and the state_dict keys stay Megatron's."""
        for kind in kinds:
            params = [getattr(e, kind).weight for e in self.experts.local_experts]
            fused = torch.stack([p.detach() for p in params])
            for e, p in enumerate(params):
                p.data = fused[e]

    def _expert_params(self):
        experts = self.experts.local_experts
        return ([e.linear_fc1.weight for e in experts] +
                [e.linear_fc2.weight for e in experts])

    def _expert_weights(self, params):
        """(fc1 [E, 2I, H], fc2 [E, H, I], reversed): the experts' weights as views in memory
        order (reversed: from the last expert to the first, in both). A kind whose parameters
        something moved into tensors of their own (module.cuda(), .to()) is re-homed again, once;
        parameters that share another allocation unevenly are refused (re-homing them would
        detach them from whoever owns it, e.g. a distributed optimizer's buffer)."""
        E = self.num_local_experts
        kinds = (("linear_fc1", params[:E], (2 * self.intermediate, self.hidden)),
                 ("linear_fc2", params[E:], (self.hidden, self.intermediate)))
        views = []
        for kind, group, shape in kinds:
            view, reversed_ = _experts_view(group, shape)
            if view is None and all(p.untyped_storage().nbytes() == p.numel() * p.element_size()
                                    for p in group):
                self._rehome_expert_weights((kind,))
                view, reversed_ = _experts_view(group, shape)
            if view is None:
                raise RuntimeError(
                    f"epflow: the experts' {kind} weights are not equally spaced in one "
                    "allocation (EPFlow reads them in place, with no per-step copy); something "
                    "placed them unevenly (e.g. padding between experts in a distributed "
                    "optimizer's buffer)")
            views.append((view, reversed_))
        (fc1, fc1_reversed), (fc2, fc2_reversed) = views
        if fc1_reversed != fc2_reversed:
            raise RuntimeError("epflow: the experts' linear_fc1 weights lie in one expert order "
                               "and their linear_fc2 weights in the other")
        return fc1, fc2, fc1_reversed

    def _main_grads(self, params):
        """(g1, g2, reversed): the parameters' main_grad as expert views (see _expert_weights),
        or None where they are missing or not equally spaced (gradients then go through
        autograd)."""
        grads = [getattr(p, "main_grad", None) for p in params]
        if any(g is None for g in grads):
            return None
        E = self.num_local_experts
        g1, r1 = _experts_view(grads[:E], (2 * self.intermediate, self.hidden))
        g2, r2 = _experts_view(grads[E:], (self.hidden, self.intermediate))
        if g1 is None or g2 is None or r1 != r2 or g1.dtype != g2.dtype or \
                g1.dtype not in (torch.float32, torch.bfloat16):
            return None
        return g1, g2, r1

    def _handle(self):
        if self._handle_key is None:
            dev = self.experts.local_experts[0].linear_fc1.weight.device
            self._handle_key, _ = epflow.create_handle(
                self.hidden, self.intermediate, self.config.num_moe_experts, self.top_k,
                self.max_tokens_per_rank, group=self.ep_group, device=dev, with_backward=True,
                **self._epflow_options)
        handle = epflow._HANDLES.get(self._handle_key)
        if handle is None:
            raise RuntimeError("epflow: this layer's handle was released "
                               "(epflow.release_handles())")
        return handle

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        if intermediate_tensors is not None:
            raise NotImplementedError("epflow: EPFlowMoELayer runs as one call (no partial "
                                      "CUDA-graph capture of the MoE layer)")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()

        def run(hidden_states, padding_mask):
            shared = self.shared_experts_compute(hidden_states)
            probs, routing_map = self.route(hidden_states, padding_mask)
            x = hidden_states.reshape(-1, self.hidden)
            if x.dtype != torch.bfloat16:
                raise TypeError(f"epflow: EPFlowMoELayer's activations must be bf16, got "
                                f"{x.dtype}")
            if x.shape[0] > self.max_tokens_per_rank:
                raise ValueError(f"epflow: {x.shape[0]} tokens exceed max_tokens_per_rank="
                                 f"{self.max_tokens_per_rank}")
            topk_idx, topk_weights = routing_to_topk(probs, routing_map, self.top_k)
            y = _EPFlowExperts.apply(self, x.contiguous(), topk_idx, topk_weights,
                                     *self._expert_params())
            y = y.view(hidden_states.shape)
            return y if shared is None else y + shared

        if self.moe_layer_recompute and self.training:
            from megatron.core import tensor_parallel
            output = tensor_parallel.checkpoint(run, False, hidden_states, padding_mask)
        else:
            output = run(hidden_states, padding_mask)
        return output, None


def _layer_with_epflow(spec, options):
    """A transformer layer spec whose mlp builds EPFlowMoELayer where it built MoELayer."""
    submodules = getattr(spec, "submodules", None)
    if submodules is None or not hasattr(submodules, "mlp"):
        raise TypeError(f"epflow.use_epflow: expected a transformer layer or block spec, got "
                        f"{type(spec).__name__}")
    mlp = submodules.mlp
    if isinstance(mlp, functools.partial) and isinstance(mlp.func, type) and \
            issubclass(mlp.func, MoELayer):
        mlp = functools.partial(EPFlowMoELayer, *mlp.args, **{**mlp.keywords, **options})
    return dataclasses.replace(spec, submodules=dataclasses.replace(submodules, mlp=mlp))


def use_epflow(spec, *, max_tokens_per_rank, grad_accumulation_fusion=None, **epflow_options):
    """A copy of a Megatron-Core layer spec (get_gpt_layer_local_spec's ModuleSpec) or decoder
    block spec (get_gpt_decoder_block_spec(..., use_transformer_engine=False)) whose MoE layers
    are EPFlowMoELayer; dense layers stay as they are. epflow_options go to epflow.create_handle."""
    options = dict(max_tokens_per_rank=max_tokens_per_rank,
                   grad_accumulation_fusion=grad_accumulation_fusion,
                   epflow_options=epflow_options)
    if hasattr(spec, "layer_specs"):  # TransformerBlockSubmodules
        return dataclasses.replace(
            spec, layer_specs=[_layer_with_epflow(s, options) for s in spec.layer_specs])
    return _layer_with_epflow(spec, options)
