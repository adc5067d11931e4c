"""Inference passes: BatchNorm folding and dropout removal on eager models, and TorchScript export through the
oneDNN Graph fuser (see jit.py for fusion, dynamic shapes and the measured pattern list)."""
from .dropout import replace_dropout
from .folding import fold_conv_bn, fold_linear_bn
from .jit import enable_onednn_fusion, export, fused_groups, load, onednn_fusion_enabled

__all__ = ["fold_conv_bn", "fold_linear_bn", "replace_dropout", "enable_onednn_fusion", "onednn_fusion_enabled",
           "export", "load", "fused_groups"]
