"""HuggingFace Transformers.

Checkpoints of an optimized model reload as its exact fp32 weights: optimize() applies
:func:`keep_fp32_checkpoints` (defined in :mod:`ipex_train.precision.libraries`) to every transformers model it
trains, so ``save_pretrained`` (and the Trainer's checkpoints) record ``"dtype": "float32"`` in config.json.
"""
from __future__ import annotations

from ..precision.libraries import keep_fp32_checkpoints

__all__ = ["keep_fp32_checkpoints"]  # and Trainer, loaded on first use (below)


def __getattr__(name: str):  # the drop-in Trainer (ipex_train/integrations/hf_trainer.py), loaded on first use
    if name == "Trainer":
        from .hf_trainer import Trainer

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
