"""PEFT (LoRA and the other adapter methods).

Adapters optimize() holds in bf16 stay so through peft's own adapter loading: optimize() applies
:func:`keep_adapter_storage` (defined in :mod:`ipex_train.precision.libraries`) to every model it trains when peft
is imported.
"""
from __future__ import annotations

from ..precision.libraries import keep_adapter_storage

__all__ = ["keep_adapter_storage"]
