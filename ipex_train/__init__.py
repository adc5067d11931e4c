"""ipex_train: one-line optimize() for training on CPUs, split bf16 master weights and fused optimizer steps.

    model, optimizer = ipex_train.optimize(model, optimizer, dtype=torch.bfloat16)
"""
__version__ = "0.1.0"

from . import _ops  # noqa: F401  (loads the kernels and registers torch.ops.ipex_train)
from . import optim
from ._info import info

__all__ = ["info", "optim", "__version__"]
