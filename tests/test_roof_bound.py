"""benchmarks.common.roof: the GEMM-only bound replays exactly the products torch's flop counter charges a step."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common.roof import attention_flops, attention_products, gemm_only_bound, replay_calls, step_flops
from benchmarks.common.train_models import ModelSpec


class _Block(nn.Module):
    """A convolution, linears, attention with grouped key/value heads (4 query heads over 2) and a batched product."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(32, 32, 3, padding=1)
        self.q, self.kv, self.head = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 3)

    def forward(self, x):
        b, s, _ = x.shape
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)
        q = self.q(x).view(b, s, 4, 8).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).reshape(b, s, 32)
        return self.head(torch.bmm(y, y.transpose(1, 2)) @ y)


def test_replayed_products_carry_the_flop_counters_flops():
    spec = ModelSpec(_Block, (2, 16, 32), 0.01, 0.05)
    calls = replay_calls(spec)
    names = {op.overloadpacket.__name__ for op, _ in calls}
    assert {"convolution", "convolution_backward", "addmm", "mm", "bmm"} <= names
    assert all(a.dtype == torch.bfloat16 for _, args in calls for a in args if isinstance(a, torch.Tensor))
    with FlopCounterMode(display=False) as counter:
        for op, args in calls:
            op(*args)
    counted = step_flops(spec)
    assert counted > 0 and counter.get_total_flops() == counted
    bound = gemm_only_bound(spec, repeats=1)
    assert bound["products"] == len(calls) and bound["seconds"] > 0


class _GQA(nn.Module):
    """Attention alone: 6 query heads over 2 key/value heads, no other product (the scalings are elementwise)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Parameter(torch.randn(1, 6, 16, 8))
        self.k = nn.Parameter(torch.randn(1, 2, 24, 8))
        self.v = nn.Parameter(torch.randn(1, 2, 24, 8))

    def forward(self, x):
        return F.scaled_dot_product_attention(self.q * x, self.k, self.v, enable_gqa=True)


def test_gqa_attention_flops_are_counted_from_the_shapes():
    # Counted without torch's SDPA formula (torch 2.11's asserts equal head counts): batch 1 x 6 query heads,
    # s=16 queries, t=24 keys, d=dv=8; 2 products forward, 5 backward, each 2*s*t*d per head.
    per_product = 2 * 6 * 16 * 24 * 8
    assert step_flops(ModelSpec(_GQA, (1, 6, 16, 8), 0.01, 0.05)) == 7 * per_product
    calls = replay_calls(ModelSpec(_GQA, (1, 6, 16, 8), 0.01, 0.05))
    assert [tuple(a.shape[0] for a in args) for _, args in calls] == [(6, 6)] * 7


def test_attention_products_with_a_value_width_of_its_own():
    fwd = attention_products((2, 8, 10, 16), (2, 4, 12, 16), (2, 4, 12, 32), backward=False)
    assert fwd == [(16, (10, 16), (16, 12)), (16, (10, 12), (12, 32))]
    bwd = attention_flops((2, 8, 10, 16), (2, 4, 12, 16), (2, 4, 12, 32), backward=True)
    assert bwd == 2 * 16 * 10 * 12 * (3 * 16 + 2 * 32)
    with pytest.raises(ValueError, match="attention call"):
        attention_products((2, 8, 10, 16), (2, 3, 12, 16), (2, 3, 12, 16), backward=False)
