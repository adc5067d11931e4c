"""Small models and helpers shared by the ipex_train.quantization tests."""
import torch
import torch.nn.functional as F
from torch import nn

from ipex_train import quantization as q
from ipex_train.quantization._runtime import Int8Layer


def cos(a, b):
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def quantize(model, example, calib, qconfig=q.default_static_qconfig):
    prepared = q.prepare(model, qconfig, example_inputs=example)
    with torch.no_grad():
        for c in calib:
            prepared(*c) if isinstance(c, tuple) else prepared(c)
    return prepared, q.convert(prepared)


def calibrated(model, x, batches=3, seed=3):
    """``model`` prepared on example ``x`` and calibrated on ``batches`` random batches of its shape."""
    prepared = q.prepare(model, example_inputs=x)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(batches):
            prepared(torch.randn(x.shape, generator=g))
    return prepared


def int8_layers(quantized):
    return [m for m in quantized.modules() if isinstance(m, Int8Layer)]


class Residual(nn.Module):
    """conv-bn-relu, a second conv, a residual add written as ``out += y`` and a relu, max-pool, linear head."""

    def __init__(self, c=8):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(c * 4 * 4, 5)

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        out = self.conv2(y)
        out += y
        out = self.relu(out)
        return self.fc(torch.flatten(self.pool(out), 1))


def residual_data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.relu(torch.randn(4, 8, 8, 8, generator=g)) for _ in range(3)]
