"""HuggingFace Transformers.

Checkpoints of an optimized model reload as its exact fp32 weights: optimize() applies
:func:`keep_fp32_checkpoints` (defined in :mod:`ipex_train.precision.libraries`) to every transformers model it
trains, so ``save_pretrained`` (and the Trainer's checkpoints) record ``"dtype": "float32"`` in config.json.
"""
from __future__ import annotations

from ..precision.libraries import keep_fp32_checkpoints

__all__ = ["keep_fp32_checkpoints"]
