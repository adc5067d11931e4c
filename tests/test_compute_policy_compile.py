"""torch.compile and optimize(bf16) compose under both compute policies: the policy adds no graph break, and
compiled train steps give the eager losses.

The backend is aot_eager: it traces forward and backward (the emulated policy's autograd Functions included)
exactly as inductor receives them, without needing a C++ compiler on the test machine or inductor's compile time.
Tolerance: both runs compute the same ops in the same dtypes; only fusion-free reordering may differ, so losses
agree to rtol 1e-3.
"""
import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

import ipex_train

BF16 = torch.bfloat16


class TinyNet(nn.Module):
    """Conv, BatchNorm, nn.MultiheadAttention (a torch.nn.functional composite) and linears, all tiny."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 16, 3, padding=1)
        self.bn = nn.BatchNorm1d(16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x))).transpose(1, 2)
        h = self.norm(h + self.attn(h, h, h, need_weights=False)[0])
        return self.head(h.mean(1))


def _setup(policy):
    torch.manual_seed(0)
    model = TinyNet()
    return ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), dtype=BF16,
                               bf16_compute=policy)


def _losses(model, optimizer, steps=3, shape=(4, 8, 6)):
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(shape, generator=gen), torch.randint(0, 4, (shape[0],), generator=gen)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("policy", ["native", "emulated"])
def test_policy_adds_no_graph_break(policy):
    model, _ = _setup(policy)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(torch.randn(4, 8, 6))
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=record)(torch.randn(4, 8, 6))
    # The emulated policy's weight casts are in the graph (not bypassed); native leaves the ops as they are.
    casts = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_method" and n.target == "float"]
    assert bool(casts) == (policy == "emulated")


@pytest.mark.parametrize("policy", ["native", "emulated"])
def test_compiled_train_steps_match_eager(policy):
    eager = _losses(*_setup(policy))
    model, optimizer = _setup(policy)
    torch._dynamo.reset()
    compiled = _losses(torch.compile(model, backend="aot_eager"), optimizer)
    assert compiled == pytest.approx(eager, rel=1e-3)
    assert compiled[-1] < compiled[0]


def test_native_depthwise_in_fp32_compiles_without_graph_break():
    # The native policy's fp32 depthwise convs (tests/test_compute_policy_native.py) enter the emulated scope from
    # module hooks: no graph break, and compiled steps give the eager losses.
    from test_compute_policy_native import _net

    def setup():
        torch.manual_seed(0)
        model = nn.Sequential(_net(), nn.Flatten(), nn.Linear(16 * 3 * 3, 4))
        return ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.05), dtype=BF16,
                                   bf16_compute="native")

    shape = (4, 3, 12, 12)
    eager = _losses(*setup(), shape=shape)
    model, optimizer = setup()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(torch.randn(shape))
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    torch._dynamo.reset()
    assert _losses(torch.compile(model, backend="aot_eager"), optimizer, shape=shape) == pytest.approx(eager, rel=1e-3)
