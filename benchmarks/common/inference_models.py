"""Models shared by bench_inference and bench_int8: torchvision ResNet-50 with spread BatchNorm statistics and a
BERT-style encoder written out (Q/K/V/output projections, softmax attention, GELU FFN), traceable by torch.fx."""
import math

import torch
import torchvision
from torch import nn


class BertStyleEncoderLayer(nn.Module):
    """Post-norm BERT layer written out: Q/K/V/output projections, softmax attention, GELU FFN, residual adds."""

    def __init__(self, d_model=768, heads=12, ffn=3072, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value, self.out = (nn.Linear(d_model, d_model) for _ in range(4))
        self.ffn_in, self.ffn_out = nn.Linear(d_model, ffn), nn.Linear(ffn, d_model)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.act, self.drop = nn.GELU(), nn.Dropout(dropout)

    def forward(self, x):
        b, s, d = x.shape

        def split(t):
            return t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        attn = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d // self.heads), dim=-1)
        ctx = torch.matmul(attn, v).transpose(1, 2).reshape(b, s, d)
        x = self.norm1(x + self.drop(self.out(ctx)))
        return self.norm2(x + self.drop(self.ffn_out(self.act(self.ffn_in(x)))))


class BertStyleEncoder(nn.Module):
    """A stack of BertStyleEncoderLayer (traceable by torch.fx, so stock FX int8 can be compared on it)."""

    def __init__(self, layers=4, d_model=768, heads=12, ffn=3072):
        super().__init__()
        self.layers = nn.ModuleList(BertStyleEncoderLayer(d_model, heads, ffn) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def resnet50():
    """torchvision ResNet-50, random weights, eval mode, BatchNorm statistics and affine set to spread values."""
    model = torchvision.models.resnet50(weights=None).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.2, 1.0)
                m.bias.uniform_(-0.1, 0.1)
    return model
