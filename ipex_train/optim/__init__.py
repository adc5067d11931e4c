"""Optimizers torch.optim lacks (Lamb, Lars), the fused steps as typed functions (:mod:`.functional`), and the
fused update used by ipex_train.optimize().

The rest of ipex_train uses the public modules: :mod:`.registry` (one entry per fused optimizer), :mod:`.fused`
(the fused step), :mod:`.state_formats` (reduced-byte state), :mod:`.checks` (step arguments) and
:mod:`.loaded_state` (loaded state); the underscored modules are this package's own."""
from . import functional, fused
from .lamb import Lamb
from .lars import Lars

fused.check_against_kernels()  # after Lamb and Lars have registered their entries

__all__ = ["Lamb", "Lars", "functional"]
