"""What :func:`ipex_train.optimize` refuses in a model or an optimizer, checked before anything is changed.

Each case would otherwise fail later or change the model silently:

* a parameter or buffer of a lazy module not yet materialised (``nn.LazyLinear`` before its first forward): its
  shape decides its conversion, layout and optimizer state;
* a TorchScript submodule (``torch.jit.script``/``trace``) when parameters go low precision (the conversion adds
  forward hooks, which TorchScript modules do not take) or when a training model is copied (``inplace=False``:
  torch's deep copy of a TorchScript module gives parameters that are not leaves, which never get grads);
* distinct Parameters sharing storage (one aliasing the other): conversion, the model copy of ``inplace=False``
  and the SYCL placement give each its own storage, so the alias would be lost;
* a param group with ``differentiable=True``: ipex_train steps under ``torch.no_grad()`` (fused kernels, fp32
  working copies of low-precision parameters), so the step could not be differentiated.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .selection import LOW_PRECISION, convertible_parameters


def check_model(model: nn.Module, dtype: torch.dtype | None, training_copy: bool) -> None:
    """Raise ValueError for a lazy (unmaterialised) parameter or buffer, or for a TorchScript submodule when
    ``dtype`` is low precision or the model is to be copied for training (``training_copy``), naming it."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if is_lazy(t):
                raise ValueError(f"optimize(): {kind} {name!r} is not materialised yet (a lazy module such as "
                                 "nn.LazyLinear infers its shape at its first forward); run one forward with a sample "
                                 "batch before optimize() (and build the optimizer after it)")
    for name, m in model.named_modules() if dtype in LOW_PRECISION or training_copy else ():
        if isinstance(m, torch.jit.ScriptModule):
            where = f"optimize(): {'submodule ' + repr(name) if name else 'the model'} is a TorchScript module"
            if dtype in LOW_PRECISION:
                raise ValueError(f"{where}; with dtype={dtype} optimize() converts weights and adds forward hooks, "
                                 "which TorchScript modules do not take. Pass the eager module (script or trace the "
                                 "optimized model afterwards), or use dtype=None/torch.float32")
            raise ValueError(f"{where}; the model copy of inplace=False would not train it (torch's deep copy of a "
                             "TorchScript module gives parameters that are not leaves, so they get no grads). Pass "
                             "the eager module, or use inplace=True")


def check_aliases(model: nn.Module, dtype: torch.dtype | None, copies: bool) -> None:
    """Raise ValueError when distinct Parameters of ``model`` share storage and optimize() would give them
    separate storage: ``copies`` (inplace=False deep copy, or the SYCL placement), or one of them going to the low
    precision ``dtype``."""
    by_storage = defaultdict(list)
    for name, p in model.named_parameters():
        if p.untyped_storage().nbytes():
            by_storage[p.untyped_storage().data_ptr()].append((name, p))
    shared = [named for named in by_storage.values() if len(named) > 1]
    if not shared:
        return
    converted = set(convertible_parameters(model)) if dtype in LOW_PRECISION else set()
    for named in shared:
        if copies or any(p in converted for _, p in named):
            names = ", ".join(repr(n) for n, _ in named)
            why = ("the model copy (inplace=False) or the SYCL placement" if copies
                   else f"the conversion to {dtype}")
            raise ValueError(f"optimize(): parameters {names} are distinct Parameters sharing one storage; "
                             f"{why} would give each its own, losing the alias. Tie them as one Parameter "
                             "(module_b.weight = module_a.weight), give each its own storage (.clone()), or, for "
                             "fp32 training on the CPU, use inplace=True")


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError for a param group with ``differentiable=True``, naming it."""
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable", False):
            raise ValueError(f"optimize(): param group {i} has differentiable=True, but ipex_train steps under "
                             "torch.no_grad() (fused kernels, fp32 working copies of low-precision parameters), so "
                             "the step could not be differentiated; create the optimizer with differentiable=False")
