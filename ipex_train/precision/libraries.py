"""What other libraries do to an optimized model's weights, kept from undoing the fp32 truth.

optimize() applies both hooks to every model it trains, each only when the user has imported its library already
(nothing here imports transformers or peft):

* transformers: ``PreTrainedModel.save_pretrained`` writes the state_dict (fp32 from an optimized model) but records
  ``config.dtype`` from the model's first floating-point parameter, which optimize(bf16) made bf16; transformers 5
  ``from_pretrained`` would then load the checkpoint in bf16. :func:`keep_fp32_checkpoints` gives the model an
  instance ``save_pretrained`` that runs transformers' own while the model reports the dtype of its state_dict
  (fp32). ``Trainer.save_model`` and the Trainer's checkpoints go through it too. ``model.dtype`` outside a save
  stays bf16: transformers sizes its caches and attention masks by it.
* peft: peft upcasts adapter weights to fp32 whenever it loads or adds an adapter (``BaseTuner._cast_adapter_dtype``)
  by replacing ``param.data`` with an fp32 copy of the bf16 top; the truth lives in the residual or master and the
  fused step takes the top. :func:`keep_adapter_storage` runs peft's own cast, then gives the held parameters their
  low-precision storage back (nothing is lost: the value peft cast is the top itself). Adapters added after
  optimize() are left as peft makes them (fp32; they train in fp32).
"""
from __future__ import annotations

import functools
import sys

import torch
from torch import nn

from . import record as _record
from .master_weights import MasterWeights


def keep_fp32_checkpoints(model: nn.Module) -> None:
    """Make ``model.save_pretrained`` record the dtype of ``model.state_dict()`` when ``model`` is an optimized
    transformers ``PreTrainedModel``; no-op for other models or when transformers is not imported."""
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        model.save_pretrained = functools.partial(_save_pretrained, model)


def _saved_dtype(model: nn.Module) -> torch.dtype:
    # What PreTrainedModel.dtype reads (the first floating-point parameter), as the state_dict holds it.
    p = next(p for p in model.parameters() if p.is_floating_point())
    return torch.float32 if p in _record.masters(model).aux else p.dtype


@functools.cache
def _saving_class(cls: type) -> type:
    """``cls`` reporting the saved dtype; same name and module, so config.json's ``architectures`` are unchanged."""
    return type(cls.__name__, (cls,), {"dtype": property(_saved_dtype), "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def _save_pretrained(model: nn.Module, *args, **kwargs):
    """transformers' own save_pretrained, run while ``model`` reports the dtype it saves."""
    cls = type(model)
    model.__class__ = _saving_class(cls)
    try:
        return cls.save_pretrained(model, *args, **kwargs)
    finally:
        model.__class__ = cls


def keep_adapter_storage(model: nn.Module, masters: MasterWeights) -> None:
    """Make every peft tuner under ``model`` keep the low-precision storage of the parameters ``masters`` holds
    when peft casts adapter dtypes; no-op for models without one or when peft is not imported."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is None:
        return
    for m in model.modules():
        if isinstance(m, tuners.BaseTuner):
            m._cast_adapter_dtype = functools.partial(_cast_adapter_dtype, m, masters)


def _cast_adapter_dtype(tuner: nn.Module, masters: MasterWeights, *args, **kwargs):
    """peft's own cast, then the held parameters' low-precision tensors back in place of its fp32 copies."""
    held = {p: p.data for p in tuner.parameters() if p in masters.aux}
    result = type(tuner)._cast_adapter_dtype(tuner, *args, **kwargs)
    for p, low in held.items():
        if p.dtype != low.dtype:
            p.data = low
    return result
