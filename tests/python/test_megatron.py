# EPFlow as Megatron-Core's MoE layer (epflow.integrations.megatron). CPU: the routing's
# conversion and its gradient, the settings refused, the spec rewrite, the layer's construction
# (its experts' weights re-homed as views of one tensor per kind, Megatron's state dict keys).
# GPU: tests/python/run_megatron.py under torchrun (EP = 1, and EP = 2 with two GPUs) against
# Megatron's own MoELayer and an fp32 copy of it. Megatron-Core needs Python >= 3.12: on older
# Pythons (the development machines and CI) the whole module skips and says so.
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

megatron_core = pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (it needs Python >= 3.12): the "
    "Megatron-Core integration tests skip")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_decoder_block_spec, get_gpt_layer_local_spec)
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from epflow.integrations.megatron import (  # noqa: E402
    EPFlowMoELayer, _experts_view, routing_to_topk, unsupported_settings, use_epflow)
from reference_handle import ReferenceHandle  # noqa: E402

H, I, E, K = 256, 192, 8, 4


def _config(**overrides):
    kw = dict(num_layers=2, hidden_size=H, num_attention_heads=4, num_moe_experts=E,
              moe_router_topk=K, moe_ffn_hidden_size=I, ffn_hidden_size=I,
              gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
              bias_activation_fusion=False, use_cpu_initialization=True,
              moe_token_dispatcher_type="allgather", params_dtype=torch.bfloat16, bf16=True)
    kw.update(overrides)
    return TransformerConfig(**kw)


@pytest.fixture(scope="module")
def model_parallel():
    """A one-rank process group (gloo) and Megatron's parallel state over it, torn down after."""
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.cpu
def test_routing_to_topk_keeps_every_routed_expert_and_its_gradient():
    g = torch.Generator().manual_seed(3)
    T = 37
    scores = torch.rand(T, E, generator=g)
    routing_map = torch.zeros(T, E, dtype=torch.bool)
    for t in range(T):
        n = t % (K + 1)  # 0 .. K experts: dropped tokens leave slots empty
        routing_map[t, torch.randperm(E, generator=g)[:n]] = True
    probs = (scores * routing_map).requires_grad_(True)
    idx, w = routing_to_topk(probs, routing_map, K)
    assert idx.dtype == torch.int32 and w.dtype == torch.float32 and idx.shape == (T, K)
    for t in range(T):
        experts = sorted(torch.nonzero(routing_map[t]).flatten().tolist())
        assert idx[t].tolist() == experts + [-1] * (K - len(experts))
        assert w[t, :len(experts)].tolist() == probs[t, experts].tolist()
        assert (w[t, len(experts):] == 0).all()
    upstream = torch.rand(T, K, generator=g)
    w.backward(upstream)
    want = torch.zeros(T, E)
    for t in range(T):
        for k in range(K):
            if idx[t, k] >= 0:
                want[t, idx[t, k]] += upstream[t, k]
    assert torch.equal(probs.grad, want)


@pytest.mark.cpu
def test_experts_found_in_either_order_in_one_buffer():
    # Megatron's DDP buffer: parameters in reverse registration order, each expert's fc2 then
    # fc1, the last expert first.
    rows, cols, n = 6, 8, 3
    fc2_elems = 4 * cols
    stride = rows * cols + fc2_elems
    buffer = torch.arange(n * stride, dtype=torch.float32)
    fc1 = [buffer[(n - 1 - e) * stride + fc2_elems:(n - e) * stride].view(rows, cols)
           for e in range(n)]
    view, reversed_ = _experts_view(fc1, (rows, cols))
    assert reversed_ and view.stride() == (stride, cols, 1)
    for j in range(n):
        assert torch.equal(view[j], fc1[n - 1 - j])
    view, reversed_ = _experts_view(fc1[::-1], (rows, cols))
    assert not reversed_ and all(torch.equal(view[e], fc1[n - 1 - e]) for e in range(n))
    uneven = [buffer[0:48].view(rows, cols), buffer[64:112].view(rows, cols),
              buffer[144:192].view(rows, cols)]
    assert _experts_view(uneven, (rows, cols)) == (None, False)


@pytest.mark.cpu
def test_unsupported_settings_are_named():
    assert unsupported_settings(_config()) == []
    bad = unsupported_settings(_config(activation_func=F.gelu, add_bias_linear=True,
                                       moe_token_dispatcher_type="flex"))
    joined = " ".join(bad)
    for name in ("activation_func", "add_bias_linear", "moe_token_dispatcher_type"):
        assert name in joined, joined


@pytest.mark.cpu
def test_use_epflow_replaces_only_the_moe_layers(model_parallel):
    layer = use_epflow(get_gpt_layer_local_spec(num_experts=E), max_tokens_per_rank=64,
                       comm_sms=2)
    assert layer.submodules.mlp.func is EPFlowMoELayer
    assert layer.submodules.mlp.keywords["epflow_options"] == {"comm_sms": 2}
    block = use_epflow(get_gpt_decoder_block_spec(_config(moe_layer_freq=[0, 1]),
                                                  use_transformer_engine=False),
                       max_tokens_per_rank=64)
    mlps = [s.submodules.mlp for s in block.layer_specs]
    assert getattr(mlps[0], "func", None) is not EPFlowMoELayer
    assert mlps[1].func is EPFlowMoELayer
    with pytest.raises(TypeError, match="transformer layer or block spec"):
        use_epflow(object(), max_tokens_per_rank=64)


@pytest.mark.cpu
def test_construction_rehomes_the_experts_and_keeps_megatrons_keys(model_parallel):
    spec = get_gpt_layer_local_spec(num_experts=E)
    torch.manual_seed(0)
    megatron = spec.submodules.mlp(config=_config(), pg_collection=None, is_mtp_layer=False)
    ours = use_epflow(spec, max_tokens_per_rank=64).submodules.mlp(
        config=_config(), pg_collection=None, is_mtp_layer=False)
    missing, unexpected = ours.load_state_dict(megatron.state_dict(), strict=False)
    assert not missing and not unexpected
    assert set(ours.state_dict()) == set(megatron.state_dict())
    fc1, fc2, reversed_ = ours._expert_weights(ours._expert_params())
    assert not reversed_
    assert fc1.shape == (E, 2 * I, H) and fc1.stride() == (2 * I * H, H, 1)
    assert fc2.shape == (E, H, I) and fc2.stride() == (H * I, I, 1)
    for e, expert in enumerate(megatron.experts.local_experts):
        assert torch.equal(fc1[e], expert.linear_fc1.weight)
        assert torch.equal(fc2[e], expert.linear_fc2.weight)
    # Parameters moved into tensors of their own are re-homed again (once, not per step).
    for expert in ours.experts.local_experts:
        expert.linear_fc1.weight.data = expert.linear_fc1.weight.data.clone()
    again, _, _ = ours._expert_weights(ours._expert_params())
    assert torch.equal(again, fc1) and again.stride() == fc1.stride()


@pytest.mark.cpu
def test_a_megatron_model_checkpoint_loads_into_the_epflow_backed_model(model_parallel):
    from megatron.core.models.gpt import GPTModel
    config = _config(moe_layer_freq=[0, 1], ffn_hidden_size=2 * I)  # a dense layer, then MoE
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    build = lambda s: GPTModel(config=config, transformer_layer_spec=s, vocab_size=128,
                               max_sequence_length=64)
    torch.manual_seed(1)
    megatron = build(spec)
    ours = build(use_epflow(spec, max_tokens_per_rank=64))
    assert isinstance(ours.decoder.layers[1].mlp, EPFlowMoELayer)
    ours.load_state_dict(megatron.state_dict(), strict=True)
    theirs, mine = megatron.state_dict(), ours.state_dict()
    assert set(theirs) == set(mine)
    for name, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, mine[name]), name


@pytest.mark.cpu
def test_refused_settings_fail_at_construction(model_parallel):
    spec = use_epflow(get_gpt_layer_local_spec(num_experts=E), max_tokens_per_rank=64)
    with pytest.raises(ValueError, match="add_bias_linear"):
        spec.submodules.mlp(config=_config(add_bias_linear=True), pg_collection=None,
                            is_mtp_layer=False)


def _torchrun(nproc):
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1")
    torchrun = shutil.which("torchrun")
    cmd = ([torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]) + [
        "--standalone", "--nproc_per_node", str(nproc), os.path.join(here, "run_megatron.py")]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    print(r.stdout)
    assert r.returncode == 0, f"torchrun failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    for rank in range(nproc):
        assert f"MEGATRON OK rank {rank}" in r.stdout


@pytest.mark.gpu
def test_matches_megatron_ep1():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    _torchrun(1)


@pytest.mark.gpu
def test_matches_megatron_ep2():
    if torch.cuda.device_count() < 2:
        pytest.skip("EP = 2 needs two GPUs")
    _torchrun(2)


@pytest.mark.cpu
@pytest.mark.parametrize("fused", [False, True])
def test_autograd_plumbing_reaches_every_expert_parameter(model_parallel, fused):
    from epflow.integrations.megatron import _EPFlowExperts
    from epflow.reference import reference_moe
    spec = use_epflow(get_gpt_layer_local_spec(num_experts=E), max_tokens_per_rank=64,
                      grad_accumulation_fusion=fused)
    layer = spec.submodules.mlp(config=_config(), pg_collection=None, is_mtp_layer=False)
    layer._handle = lambda: ReferenceHandle()
    params = layer._expert_params()
    # As Megatron's DDP with the distributed optimizer leaves them: parameters and main_grad in
    # one buffer each, the last expert first, each expert's fc2 before its fc1.
    fc1_elems, fc2_elems = 2 * I * H, H * I
    stride = fc1_elems + fc2_elems
    buffers = {dtype: torch.zeros(E * stride, dtype=dtype)
               for dtype in (torch.bfloat16, torch.float32)}
    for e, expert in enumerate(layer.experts.local_experts):
        at = (E - 1 - e) * stride
        for kind, offset, shape in (("linear_fc2", 0, (H, I)), ("linear_fc1", fc2_elems, (2 * I, H))):
            p = getattr(expert, kind).weight
            n = shape[0] * shape[1]
            view = buffers[torch.bfloat16][at + offset:at + offset + n].view(shape)
            view.copy_(p.detach())
            p.data = view
            p.main_grad = buffers[torch.float32][at + offset:at + offset + n].view(shape)
    _, _, reversed_ = layer._expert_weights(params)
    assert reversed_
    g = torch.Generator().manual_seed(5)
    T = 24
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).requires_grad_(True)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    idx[3, 1:] = -1
    w = torch.rand(T, K, generator=g).requires_grad_(True)
    y = _EPFlowExperts.apply(layer, x, idx, w, *params)
    dy = torch.randn(T, H, generator=g)
    (y.float() * dy).sum().backward()
    # The reference over the same weights, gathered per expert.
    experts = layer.experts.local_experts
    fc1 = torch.stack([e.linear_fc1.weight.detach().float() for e in experts]).requires_grad_(True)
    fc2 = torch.stack([e.linear_fc2.weight.detach().float() for e in experts]).requires_grad_(True)
    xr, wr = x.detach().float().requires_grad_(True), w.detach().requires_grad_(True)
    yr = reference_moe(xr, idx, wr, fc1[:, :I], fc1[:, I:], fc2)
    (yr * dy).sum().backward()
    assert torch.allclose(y.float(), yr, atol=2e-2, rtol=2e-2)
    assert torch.allclose(x.grad.float(), xr.grad, atol=2e-2, rtol=2e-2)
    assert torch.allclose(w.grad, wr.grad, atol=2e-2, rtol=2e-2)
    for e, expert in enumerate(experts):
        for p, want in ((expert.linear_fc1.weight, fc1.grad[e]), (expert.linear_fc2.weight, fc2.grad[e])):
            if fused:  # added into main_grad in place, autograd given placeholders
                got = p.main_grad
                assert p.grad_added_to_main_grad
            else:
                got = p.grad.float()
                assert (p.main_grad == 0).all()
            assert torch.allclose(got, want, atol=3e-2, rtol=3e-2), (e, (got - want).abs().max())
