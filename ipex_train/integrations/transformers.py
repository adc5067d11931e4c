"""HuggingFace Transformers: checkpoints of an optimized model reload as its exact fp32 weights.

``PreTrainedModel.save_pretrained`` writes the state_dict (fp32 from an optimized model) but records
``config.dtype`` from the model's first floating-point parameter, which optimize(bf16) made bf16 (an embedding);
transformers 5 ``from_pretrained`` then loads the checkpoint in bf16 by default and the weights lose 16 bits.

:func:`optimize` calls :func:`keep_fp32_checkpoints` on every model it trains, only when the user has imported
transformers already (this module imports nothing of it otherwise). It gives the model an instance
``save_pretrained`` that runs transformers' own while the model reports the dtype of its state_dict (fp32), so
``config.json`` says ``"dtype": "float32"``. ``Trainer.save_model`` and the Trainer's checkpoints go through
``model.save_pretrained`` and get the same. ``model.dtype`` outside a save stays bf16: transformers sizes its
caches and attention masks by it.
"""
from __future__ import annotations

import functools
import sys

import torch
from torch import nn

from .. import _record


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


def __getattr__(name: str):  # the drop-in Trainer, loaded on first use: optimize() imports this module too
    if name == "Trainer":
        from .hf_trainer import Trainer
        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
