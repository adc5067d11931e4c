"""benchmarks.roof: the GEMM-only bound replays exactly the products torch's flop counter charges a step."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.roof import gemm_only_bound, replay_calls, step_flops
from benchmarks.train_models import ModelSpec


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
