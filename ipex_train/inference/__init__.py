"""Inference passes: BatchNorm folding and dropout removal on eager models; export through TorchScript and the
oneDNN Graph fuser (jit.py) or through torch.export + AOTInductor into a .pt2 package (aoti.py), one entry point
(deploy.export)."""
from .aoti import AOTIConfig
from .deploy import export
from .dropout import replace_dropout
from .folding import fold_conv_bn, fold_linear_bn
from .jit import enable_onednn_fusion, fused_groups, load, onednn_fusion_enabled

__all__ = ["AOTIConfig", "enable_onednn_fusion", "export", "fold_conv_bn", "fold_linear_bn", "fused_groups", "load",
           "onednn_fusion_enabled", "replace_dropout"]
