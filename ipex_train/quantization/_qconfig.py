"""QConfig: how activations and weights are quantized and how activation ranges are observed."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.ao.quantization.observer import HistogramObserver, MinMaxObserver, PerChannelMinMaxObserver

ACTIVATION_QSCHEMES = (torch.per_tensor_affine, torch.per_tensor_symmetric)
WEIGHT_QSCHEMES = (torch.per_channel_symmetric, torch.per_tensor_symmetric)
# JSON "algorithm" names (IPEX's) of the observers.
OBSERVERS = {"minmax": "min_max", "histogram": "histogram"}


@dataclass(frozen=True)
class QConfig:
    """Static post-training quantization settings.

    Args:
        activation_qscheme: torch.per_tensor_affine (uint8 with a zero point, default) or torch.per_tensor_symmetric
            (uint8 centred on 128, seed 002's symmetric option).
        weight_qscheme: torch.per_channel_symmetric (one scale per output channel, default) or
            torch.per_tensor_symmetric; weight zero points are always 0.
        observer: "minmax" (running min/max, default) or "histogram" (torch's HistogramObserver: clips outliers by
            minimising the quantization error; slower calibration).
        weight_bits: None (default) picks 8 where this CPU's int8 kernels add products without saturating (VNNI)
            and 7 where they saturate to int16 (see ipex_train.quantization._kernels); 7 or 8 forces it. Use 7
            for a model that will be deployed on CPUs without VNNI.
        activation_dtype, weight_dtype: torch.quint8 and torch.qint8, the only types torch's quantized CPU
            convolution/linear kernels take.
    """

    activation_qscheme: torch.qscheme = torch.per_tensor_affine
    weight_qscheme: torch.qscheme = torch.per_channel_symmetric
    observer: str = "minmax"
    weight_bits: int | None = None
    activation_dtype: torch.dtype = torch.quint8
    weight_dtype: torch.dtype = torch.qint8

    def __post_init__(self):
        for name, value, accepted in (("activation_qscheme", self.activation_qscheme, ACTIVATION_QSCHEMES),
                                      ("weight_qscheme", self.weight_qscheme, WEIGHT_QSCHEMES)):
            if not isinstance(value, torch.qscheme):
                raise TypeError(f"QConfig: {name} must be a torch.qscheme, got {type(value).__name__}")
            if value not in accepted:
                raise ValueError(f"QConfig: {name} must be one of {', '.join(map(str, accepted))}, got {value}")
        for name, value, accepted in (("activation_dtype", self.activation_dtype, torch.quint8),
                                      ("weight_dtype", self.weight_dtype, torch.qint8)):
            if not isinstance(value, torch.dtype):
                raise TypeError(f"QConfig: {name} must be a torch.dtype, got {type(value).__name__}")
            if value != accepted:
                raise ValueError(f"QConfig: {name} must be {accepted} (what torch's quantized CPU kernels take), "
                                 f"got {value}")
        if not isinstance(self.observer, str) or self.observer not in OBSERVERS:
            raise ValueError(f"QConfig: observer must be one of {sorted(OBSERVERS)}, got {self.observer!r}")
        if self.weight_bits is not None and (type(self.weight_bits) is not int or self.weight_bits not in (7, 8)):
            raise ValueError(f"QConfig: weight_bits must be None, 7 or 8, got {self.weight_bits!r}")

    @property
    def algorithm(self) -> str:
        """The observer's name in the JSON summary ("min_max" or "histogram")."""
        return OBSERVERS[self.observer]

    @property
    def weight_granularity(self) -> str:
        """"per_channel" or "per_tensor", as the JSON summary writes it."""
        return "per_channel" if self.weight_qscheme == torch.per_channel_symmetric else "per_tensor"

    def activation_observer(self):
        """A fresh observer of one activation tensor (uint8, full 0..255 range)."""
        cls = HistogramObserver if self.observer == "histogram" else MinMaxObserver
        return cls(dtype=torch.quint8, qscheme=self.activation_qscheme, quant_min=0, quant_max=255)

    def weight_qparams(self, weight: torch.Tensor, bits: int) -> list[float]:
        """Symmetric weight scales (one per output channel, or one) for a ``bits``-bit signed range."""
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        if self.weight_qscheme == torch.per_channel_symmetric:
            obs = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
                                           quant_min=lo, quant_max=hi)
        else:
            obs = MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric, quant_min=lo, quant_max=hi)
        obs(weight.detach().float())
        scale, _ = obs.calculate_qparams()
        return [float(s) for s in scale.reshape(-1)]


default_static_qconfig = QConfig()
"""Per-tensor affine uint8 activations, per-channel symmetric int8 weights, min-max observers."""

symmetric_static_qconfig = QConfig(activation_qscheme=torch.per_tensor_symmetric)
"""As default_static_qconfig with per-tensor symmetric activations (seed 002's ``per_tensor_symmetric``)."""
