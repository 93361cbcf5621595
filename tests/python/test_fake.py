# CPU checks of the Python package: the library loads, the op's schema, the fake (meta)
# implementation used by torch.compile / torch.export, argument errors. No GPU needed.
import pytest
import torch

import epflow

pytestmark = pytest.mark.cpu

H, I, E, K, T = 256, 128, 8, 2, 48


def _args(device="cpu"):
    bf = dict(dtype=torch.bfloat16, device=device)
    return (torch.randn(T, H, **bf), torch.randint(0, E, (T, K), dtype=torch.int32, device=device),
            torch.rand(T, K, device=device), torch.randn(E, I, H, **bf), torch.randn(E, I, H, **bf),
            torch.randn(E, H, I, **bf))


def test_schema():
    s = str(torch.ops.epflow.moe_forward.default._schema)
    assert s.startswith("epflow::moe_forward(int handle, Tensor x, Tensor topk_idx")
    assert len(epflow._C.get_unique_id()) == 128


def test_fake_impl_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        args = _args()
        y = torch.ops.epflow.moe_forward(1, *args)
    assert y.shape == (T, H) and y.dtype == torch.bfloat16


def test_fake_impl_meta_device():
    y = torch.ops.epflow.moe_forward(1, *_args("meta"))
    assert y.shape == (T, H) and y.device.type == "meta"


def test_export_traces_through_fake_impl():
    class M(torch.nn.Module):
        def forward(self, x, idx, w, g, u, d):
            return torch.ops.epflow.moe_forward(7, x, idx, w, g, u, d) * 2

    ep = torch.export.export(M(), _args(), strict=False)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert "epflow.moe_forward.default" in targets, targets


def test_compile_traces_through_fake_impl():
    graphs = []

    def backend(gm, example_inputs):  # records the Dynamo graph; never runs the GPU kernel
        graphs.append(gm)
        return lambda *a: (torch.zeros(T, H, dtype=torch.bfloat16),)

    def fn(x, idx, w, g, u, d):
        return torch.ops.epflow.moe_forward(3, x, idx, w, g, u, d)

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*_args())
    assert graphs and any("epflow.moe_forward" in str(n.target) for n in graphs[0].graph.nodes)


def test_cpu_tensors_are_rejected():
    with pytest.raises(NotImplementedError, match="CPU"):
        torch.ops.epflow.moe_forward(1, *_args())


def test_bad_config_is_rejected_before_any_collective():
    # create_handle checks the shape with this before it creates a workspace or a handle.
    with pytest.raises(RuntimeError, match="hidden"):
        torch.ops.epflow.check_config(1, 100, 128, 8, 2, 64, 5.0, 0, 0, 0, 0, False, "bf16", False)
