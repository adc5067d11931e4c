"""Optimizers torch.optim lacks (Lamb, Lars), and the fused update used by ipex_train.optimize()."""
from .lamb import Lamb
from .lars import Lars

__all__ = ["Lamb", "Lars"]
