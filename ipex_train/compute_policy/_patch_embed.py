"""The native policy's route for patch embeddings: a ``Conv2d`` whose stride equals its kernel (ViT, Swin, ConvNeXt
stems) computed as one GEMM over the unfolded patches, forward and backward.

Such a convolution reads every input pixel once, so unfolding the patches is a reshape and a permute (one copy of
the image), and the convolution is ``patches @ weight.view(out, -1).T + bias``: oneDNN's bf16 GEMM instead of its
convolution kernels, whose weight-gradient pass is slow at these shapes (a 35 ms convolution backward in a ~320 ms
ViT-B/16 step on a 16-core AMX Xeon; docs/compute_policy.md). The module's forward is swapped on the instance, as
for RMSNorm; ``remove()`` deletes it again.
"""
from __future__ import annotations

import torch

from .. import linear as _linear
from ._swap import Swap


def routable(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a plain ``nn.Conv2d`` patch embedding: stride equal to the kernel, no padding or
    dilation, one group, its class's own forward (not already swapped)."""
    return (type(module) is torch.nn.Conv2d and "forward" not in vars(module)
            and tuple(module.stride) == tuple(module.kernel_size) and max(module.kernel_size) > 1
            and tuple(module.dilation) == (1, 1) and module.groups == 1 and module.padding_mode == "zeros"
            and not isinstance(module.padding, str) and tuple(module.padding) == (0, 0))


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The calls the GEMM takes: a batched (4-D) bf16 CPU input as large as one patch, bf16 weight."""
    return (x.dim() == 4 and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and x.device.type == "cpu" and weight.device.type == "cpu" and x.shape[1] == weight.shape[1]
            and x.shape[2] >= weight.shape[2] and x.shape[3] >= weight.shape[3])


def patch_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride=weight.shape[2:])`` as a GEMM over the unfolded patches. The output has the
    convolution's shape and the input's memory format (channels-last input: channels-last output)."""
    b, c, h, w = x.shape
    kh, kw = weight.shape[2], weight.shape[3]
    nh, nw = h // kh, w // kw
    if h != nh * kh or w != nw * kw:  # the convolution drops the rows and columns past the last whole patch
        x = x[:, :, :nh * kh, :nw * kw]
    patches = x.reshape(b, c, nh, kh, nw, kw).permute(0, 2, 4, 1, 3, 5).reshape(b * nh * nw, c * kh * kw)
    out = _linear.linear(patches, weight.reshape(weight.shape[0], -1), bias)
    out = out.view(b, nh, nw, -1).permute(0, 3, 1, 2)  # channels-last strides
    if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return out
    return out.contiguous()


def forward(self, input):
    """The routed forward: bf16 CPU input through :func:`patch_conv`, any other through the class's own forward."""
    if not supports(input, self.weight):
        return type(self).forward(self, input)
    return patch_conv(input, self.weight, self.bias)


def swap(module: torch.nn.Module) -> Swap:
    """Route ``module`` (see :func:`routable`) through the forward above; the handle's ``remove()`` undoes it."""
    return Swap(module, forward)
