"""The native policy's routing of ``nn.Linear`` modules with a bias to ``ipex_train.linear`` (the bias in the GEMM's
epilogue, not copied into the output first; the same bits as ``F.linear``).

The module's forward is swapped on the instance (:mod:`._swap`); the class is untouched, and hooks on the module run
as before (the swapped forward is what ``__call__`` calls). Calls the op does not take
(:func:`ipex_train.linear.supports`: other dtypes, autocast, non-contiguous inputs) run ``F.linear``, as the class's
forward does.
"""
from __future__ import annotations

import torch

from .. import linear as _fused
from ._swap import Swap, same_as_class

# Narrowest layer routed: a call runs the op only for outputs of at least ipex_train.linear.MIN_OUTPUT_ELEMENTS
# (2^19) elements, which 512 features reach at 1024 rows (a BERT-base batch); narrower layers (classifier heads,
# small CNNs' MLPs) would only pay the routed forward's Python call.
MIN_OUT_FEATURES = 512


def routable(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Linear`` (or a subclass keeping its forward) with a bias tensor and at least
    :data:`MIN_OUT_FEATURES` output features, whose forward is not already replaced on the instance."""
    return (isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward
            and "forward" not in vars(module) and isinstance(module.bias, torch.Tensor)
            and module.out_features >= MIN_OUT_FEATURES)


@same_as_class
def forward(self, input):
    """The routed forward: ``F.linear(input, self.weight, self.bias)`` through ``ipex_train.linear.linear``."""
    return _fused.linear(input, self.weight, self.bias)


def swap(module: torch.nn.Module) -> Swap:
    """Route ``module`` (see :func:`routable`) through the forward above; the handle's ``remove()`` undoes it."""
    return Swap(module, forward)
