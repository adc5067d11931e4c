"""ipex_train: one-line optimize() for training on CPUs, split bf16 master weights and fused optimizer steps.

    model, optimizer = ipex_train.optimize(model, optimizer, dtype=torch.bfloat16)
"""
__version__ = "0.1.0"

from . import optim
from .base import envvars as _envvars
from .base.ops import kernel_variant, set_kernel_variant  # importing base.ops loads the kernels (torch.ops.ipex_train)
from .config import OptimizeConfig
from .frontend import optimize
from .inference.jit import enable_onednn_fusion, onednn_fusion_enabled
from .precision.channels_last import disable_auto_channels_last, enable_auto_channels_last
from .reports.info import info
from .reports.memory import MemoryReport, memory_report
from .reports.summary import OptimizeSummary, summary

_envvars.apply_kernel_variable()  # a bad IPEX_TRAIN_KERNEL is raised at optimize() or the first kernel call

__all__ = ["MemoryReport", "OptimizeConfig", "OptimizeSummary", "info", "memory_report", "optim", "optimize", "summary",
           "enable_onednn_fusion", "onednn_fusion_enabled", "enable_auto_channels_last", "disable_auto_channels_last",
           "kernel_variant", "set_kernel_variant",
           "quantization", "__version__"]


def __getattr__(name):
    # ipex_train.quantization is imported on first use, so that `import ipex_train` does not load torch.ao.
    if name == "quantization":
        import importlib

        return importlib.import_module(".quantization", __name__)
    raise AttributeError(f"module 'ipex_train' has no attribute {name!r}")
