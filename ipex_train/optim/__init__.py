"""Optimizers torch.optim lacks (Lamb, Lars), the fused steps as typed functions (:mod:`.functional`), and the
fused update used by ipex_train.optimize()."""
from . import functional
from .lamb import Lamb
from .lars import Lars

__all__ = ["Lamb", "Lars", "functional"]
