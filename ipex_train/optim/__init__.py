"""Optimizers torch.optim lacks (Lamb, Lars), the fused steps as typed functions (:mod:`.functional`), and the
fused update used by ipex_train.optimize()."""
from . import functional, fused
from .lamb import Lamb
from .lars import Lars

fused.check_against_kernels()  # after Lamb and Lars have registered their entries

__all__ = ["Lamb", "Lars", "functional"]
