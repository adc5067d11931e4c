"""PEFT (LoRA and the other adapter methods): adapters optimize() holds in bf16 stay so through peft's own calls.

peft upcasts adapter weights to fp32 whenever it loads or adds an adapter (``BaseTuner._cast_adapter_dtype``,
called by ``PeftModel.load_adapter``, ``add_adapter`` and ``from_pretrained``) by replacing ``param.data`` with an
fp32 copy. On an optimized model that copy is only the bf16 top: the adapter's fp32 truth lives in its residual or
master, and the fused step takes the top. HF ``Trainer`` resumes a peft model through ``load_adapter``.

:func:`optimize` calls :func:`keep_adapter_storage` on every model it trains, only when the user has imported peft
already (this module imports nothing of it otherwise): each peft tuner of the model gets an instance
``_cast_adapter_dtype`` that runs peft's own, then gives the parameters optimize() holds their low-precision
storage back (the value peft cast is the top itself, so nothing is lost). Adapters added after optimize() are
left as peft makes them (fp32; they train in fp32).
"""
from __future__ import annotations

import functools
import sys

from torch import nn

from ..precision.master_weights import MasterWeights


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
