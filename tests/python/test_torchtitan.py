# EPFlow as torchtitan's routed experts (epflow.integrations.torchtitan). CPU: the override
# applied through torchtitan's own mechanism (an MoE config's RoutedExperts becomes
# EPFlowRoutedExperts, the parameters' names unchanged) and the module's autograd plumbing with
# a CPU stand-in for the EPFlow handle. GPU (EP = 1): EPFlowRoutedExperts against torchtitan's
# own RoutedExperts (grouped GEMMs) on the same weights and inputs, both against an fp32
# reference: y and the gradients of x, the scores and the three expert weights. Without
# torchtitan (and its dependencies: tyro, spmd_types, ...) the module skips and says so.
import pytest
import torch

pytest.importorskip("torchtitan.models.common.moe",
                    reason="torchtitan (with its dependencies) is not installed: the torchtitan "
                    "integration tests skip")

from torchtitan.config.override import OverrideConfig, apply_overrides  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.moe import (  # noqa: E402
    MoE, GroupedExperts, RoutedExperts, TokenChoiceTopKRouter)
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: E402

from epflow.integrations.torchtitan import EPFlowRoutedExperts  # noqa: E402
from epflow.reference import reference_moe, rel_err  # noqa: E402
from reference_handle import ReferenceHandle  # noqa: E402

H, I, E, K = 256, 192, 8, 4


def _routed_config():
    return RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=H, hidden_dim=I, num_experts=E),
        token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K))


def _moe_config():
    return MoE.Config(num_experts=E, routed_experts=_routed_config(), load_balance_coeff=None,
                      router=TokenChoiceTopKRouter.Config(
                          num_experts=E, top_k=K,
                          gate=Linear.Config(in_features=H, out_features=E)))


def _inputs(device, T=48, seed=3):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(2, T // 2, H, generator=g, device=device).to(torch.bfloat16)
    scores = torch.rand(2, T // 2, K, generator=g, device=device)
    ids = torch.stack([torch.randperm(E, generator=g, device=device)[:K]
                       for _ in range(T)]).view(2, T // 2, K)
    return x, scores, ids


def _init(module, seed=7):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _reference(module, x, scores, ids):
    """fp32 y and gradients (of x, scores, w1, w2, w3) of sum(y * dy), dy = y's shape ones."""
    inner = module.inner_experts
    leaves = [t.detach().float().requires_grad_(True)
              for t in (x, scores, inner.w1_EFD, inner.w2_EDF, inner.w3_EFD)]
    xr, sr, w1, w2, w3 = leaves
    y = reference_moe(xr.view(-1, H), ids.view(-1, K), sr.view(-1, K), w1, w3, w2)
    y.sum().backward()
    return y.view(x.shape), [t.grad for t in leaves]


def _run(module, x, scores, ids):
    inner = module.inner_experts
    xi, si = x.clone().requires_grad_(True), scores.clone().requires_grad_(True)
    y = module(xi, si, ids, torch.bincount(ids.flatten(), minlength=E))
    y.float().sum().backward()
    return y.detach(), [xi.grad, si.grad, inner.w1_EFD.grad, inner.w2_EDF.grad,
                        inner.w3_EFD.grad]


@pytest.mark.cpu
def test_override_replaces_routed_experts_and_keeps_parameter_names():
    config = _moe_config()
    lines = apply_overrides(OverrideConfig(imports=[(
        "epflow.integrations.torchtitan.epflow_routed_experts",
        {"max_tokens_per_rank": 64, "comm_sms": 2})]), config)
    assert len(lines) == 1 and "EPFlowRoutedExperts" in lines[0]
    routed = config.routed_experts
    assert isinstance(routed, EPFlowRoutedExperts.Config)
    assert routed.max_tokens_per_rank == 64 and routed.epflow_options == {"comm_sms": 2}
    ours, theirs = routed.build(), _routed_config().build()
    assert isinstance(ours, EPFlowRoutedExperts)
    assert set(ours.state_dict()) == set(theirs.state_dict())


@pytest.mark.cpu
def test_autograd_plumbing_reaches_the_weights():
    module = EPFlowRoutedExperts.Config(max_tokens_per_rank=64, inner_experts=GroupedExperts.Config(
        dim=H, hidden_dim=I, num_experts=E), token_dispatcher=LocalTokenDispatcher.Config(
            num_experts=E, top_k=K)).build()
    _init(module)
    module._handle = lambda gate, group: ReferenceHandle()
    x, scores, ids = _inputs("cpu")
    y, grads = _run(module, x, scores, ids)
    y_ref, grads_ref = _reference(module, x, scores, ids)
    assert rel_err(y, y_ref) < 1e-2
    for name, got, want in zip(("x", "scores", "w1", "w2", "w3"), grads, grads_ref):
        assert rel_err(got, want) < 1e-2, name


@pytest.mark.gpu
def test_matches_torchtitans_routed_experts_ep1():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    import epflow
    theirs = _routed_config().build().cuda()
    _init(theirs)
    ours = EPFlowRoutedExperts.Config(max_tokens_per_rank=64, inner_experts=GroupedExperts.Config(
        dim=H, hidden_dim=I, num_experts=E), token_dispatcher=LocalTokenDispatcher.Config(
            num_experts=E, top_k=K)).build().cuda()
    ours.load_state_dict(theirs.state_dict())
    for m in (ours, theirs):
        m.to(torch.bfloat16)
    x, scores, ids = _inputs("cuda")
    y_ref, grads_ref = _reference(theirs, x, scores, ids)
    got, base = _run(ours, x, scores, ids), _run(theirs, x, scores, ids)
    for name, a, b, r in zip(("y", "x", "scores", "w1", "w2", "w3"), [got[0]] + got[1],
                             [base[0]] + base[1], [y_ref] + grads_ref):
        e_ours, e_theirs = rel_err(a, r), rel_err(b, r)
        print(f"{name}: EPFlow {e_ours:.2e}, torchtitan {e_theirs:.2e}")
        assert e_ours <= max(2 * e_theirs, 1e-2), name
    epflow.release_handles()
