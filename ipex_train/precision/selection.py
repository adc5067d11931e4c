"""Which parameters go low precision: the matmul-class modules, the units that convert together, and the rule.

The weights of matmul-class modules (:data:`MATMUL_MODULES`: Linear, Conv*, Embedding*, RNNs, MultiheadAttention,
transformers' Conv1D, ...) go low precision; normalisation layers and every other parameter stay fp32. A matched
module converts together with every module under it, all or nothing (:func:`convertible_parameters`).
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor, nn

from ..base.choices import LOW_PRECISION

__all__ = ["LOW_PRECISION", "MATMUL_MODULES", "MATMUL_MODULE_NAMES", "convertible_parameters", "is_matmul_module",
           "matmul_units", "owners"]

# Module types whose own parameters feed only matmul-class ops (matmuls, convolutions, embedding lookups, RNN gates)
# and the bias adds after them, so all of them can go low precision together. A matched module converts together
# with every module under it, all or nothing: nn.MultiheadAttention and Swin's attention read their child Linears'
# weights directly, beside their own parameters, in one computation.
MATMUL_MODULES = (nn.Linear, nn.Bilinear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                  nn.ConvTranspose3d, nn.Embedding, nn.EmbeddingBag, nn.RNNBase, nn.MultiheadAttention)
# The same for classes of optional libraries, named "module.QualName" and matched along a module's MRO, so that
# their library is never imported here.
MATMUL_MODULE_NAMES = frozenset({
    "transformers.pytorch_utils.Conv1D",  # GPT-2's projections: a Linear with a transposed weight (addmm)
    # qkv/proj weights read directly; its relative position bias table is added to the (bf16) attention logits
    "torchvision.models.swin_transformer.ShiftedWindowAttention",
})


def is_matmul_module(module: nn.Module) -> bool:
    """Whether ``module``'s type is one whose parameters may go low precision (MATMUL_MODULES and
    MATMUL_MODULE_NAMES)."""
    return isinstance(module, MATMUL_MODULES) or any(
        f"{c.__module__}.{c.__qualname__}" in MATMUL_MODULE_NAMES for c in type(module).__mro__)


def matmul_units(model: nn.Module) -> dict[int, nn.Module]:
    """id of every module lying under a matmul module (itself included) -> the outermost such module: the unit
    whose parameters convert together."""
    roots: dict[int, nn.Module] = {}

    def visit(m: nn.Module, root: nn.Module | None) -> None:
        if root is None and is_matmul_module(m):
            root = m
        if root is not None:
            roots.setdefault(id(m), root)
        for child in m.children():
            visit(child, root)

    visit(model, None)
    return roots


def owners(model: nn.Module) -> dict[Tensor, list[nn.Module]]:
    """Every parameter of ``model`` with the modules that register it (several for tied weights)."""
    found: dict[Tensor, list[nn.Module]] = defaultdict(list)
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                found[p].append(m)
    return found


def convertible_parameters(model: nn.Module) -> list[Tensor]:
    """The fp32 parameters of ``model`` that go low precision: every module registering one lies in a matmul
    module's unit (see MATMUL_MODULES), and each unit converts all of its fp32 parameters or none (a Linear with
    an fp32 weight and a bf16 bias could not run)."""
    units = matmul_units(model)
    found = owners(model)
    chosen = {p for p, mods in found.items() if p.dtype == torch.float32 and all(id(m) in units for m in mods)}
    changed = True
    while changed:  # a tie can carry an exclusion from one unit to the next
        changed = False
        for p in list(chosen):
            siblings = (q for m in found[p] for q in units[id(m)].parameters())
            if any(q.dtype == torch.float32 and q not in chosen for q in siblings):
                chosen.discard(p)
                changed = True
    return [p for p in found if p in chosen]
